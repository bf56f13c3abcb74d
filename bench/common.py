"""What the benchmarks share: `name=value` output, best-of-N timing, the machine's limits
measured in the same run, the SmolLM2-135M shape, and a torch twin of our weights."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from marft_jax.models.config import ModelConfig
from marft_jax.models.hf_checkpoint import hf_config_dict, hf_tensors

SMOLLM2_SHAPE = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True)


def emit(name: str, value) -> None:
  print(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}", flush=True)


def best_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def memory_bandwidth(repeats: int, scale: int = 1) -> float:
  """Bytes/s read by the faster of a jitted sum and a jitted matrix-vector product."""
  x = jnp.ones((64 << 20 // scale,), jnp.float32)  # 256 MiB
  w = jnp.ones((49152 // scale, 576), jnp.float32)
  v = jnp.ones((576,), jnp.float32)
  total, matvec = jax.jit(jnp.sum), jax.jit(jnp.dot)
  total(x).block_until_ready(), matvec(w, v).block_until_ready()
  return max(x.nbytes / best_time(lambda: total(x), repeats + 2),
             w.nbytes / best_time(lambda: matvec(w, v), repeats + 5))


def matmul_peak(repeats: int, n: int = 2048) -> float:
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  mm(a, a).block_until_ready()
  return 2 * n ** 3 / best_time(lambda: mm(a, a), repeats + 5)


def torch_model(params, config: ModelConfig):
  """A transformers `LlamaForCausalLM` holding exactly `params` (kernels transposed)."""
  import torch
  import transformers
  hf = transformers.LlamaConfig(**hf_config_dict(config))
  model = transformers.LlamaForCausalLM(hf).eval()
  state = {name: torch.from_numpy(w) for name, w in hf_tensors(params, config).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  model.tie_weights()
  return model

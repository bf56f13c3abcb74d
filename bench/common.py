"""What the benchmarks share: `name=value` output, best-of-N timing, the machine's limits
measured in the same run, the SmolLM2-135M and Qwen2.5-1.5B shapes, a torch twin of our
weights, and the two decoders timed side by side (our sampler, transformers' `generate`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from marft_jax.models import sampler
from marft_jax.models.config import ModelConfig
from marft_jax.models.hf_checkpoint import hf_config_dict, hf_tensors

SMOLLM2_SHAPE = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True)

# Qwen2.5-1.5B(-Instruct)'s config.json: q/k/v biases, tied embeddings, 1.54 B parameters.
QWEN2_1P5B_SHAPE = ModelConfig(
    architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
    num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)


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


def read_bandwidth(repeats: int, nbytes: int) -> float:
  """Bytes/s of a jitted sum over an `nbytes` f32 array (an accelerator's read rate: make it
  big enough, ~2 GiB, that launch overheads vanish)."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  rate = x.nbytes / best_time(lambda: total(x), repeats + 2)
  del x
  return rate


def matmul_peak(repeats: int, n: int = 2048, dtype=jnp.float32) -> float:
  """FLOP/s of a jitted n × n matmul in `dtype` (f32 accumulation is the backend's)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  mm = jax.jit(jnp.matmul)
  mm(a, a).block_until_ready()
  return 2 * n ** 3 / best_time(lambda: mm(a, a), repeats + 5)


def load_base(config, num_layers: int = 0):
  """A training config's base (`model_lib.Model`): model.source as `launch.train` loads it,
  or, with `num_layers` > 0, that cut to its first `num_layers` layers (a run too big for
  the host's memory at full depth)."""
  # Imported here: bench.accelerator imports this module on hosts without the packages the
  # trainer's config and loaders need (tests/test_bench_accelerator.py).
  from marft_jax.models import loading
  from marft_jax.train.build import model as model_lib
  if not num_layers:
    return model_lib.load(config)
  dtype = config.model.param_dtype
  return model_lib.Model(*loading.load_model(config.model.source, param_dtype=dtype,
                                            compute_dtype=dtype, num_layers=num_layers))


def model_sizes(params, config: ModelConfig) -> tuple[int, int]:
  """(bytes a decode step reads: every layer weight and the output projection; parameters of
  every matmul, the tied embedding counted once, as the output projection). A token costs
  2 FLOPs per matmul parameter forward; attention over the cache is left out."""
  head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
  layers = params["layers"]
  kernels = [p["kernel"] for p in layers.values() if isinstance(p, dict)]
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(layers)) + head.nbytes
  return weight_bytes, sum(k.size for k in kernels) + head.size


def torch_model(params, config: ModelConfig, device: str = "cpu", dtype=None):
  """A transformers `LlamaForCausalLM` (`Qwen2ForCausalLM` for Qwen2) holding exactly
  `params` (kernels transposed), on torch `device`, in torch `dtype` (default f32)."""
  import torch
  import transformers
  qwen2 = config.architecture == "qwen2"
  hf = (transformers.Qwen2Config if qwen2 else transformers.LlamaConfig)(
      **hf_config_dict(config))
  with torch.device(device):  # initialised where it runs: fast on a GPU for big shapes
    model = (transformers.Qwen2ForCausalLM if qwen2 else transformers.LlamaForCausalLM)(hf)
  model = model.eval().to(dtype or torch.float32)
  state = {name: torch.from_numpy(w) for name, w in hf_tensors(params, config).items()}
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  model.tie_weights()
  return model


def time_marft(dparams, config, prompts, new_tokens, repeats):
  """Our sampler: (compile s, best call s with N new tokens, best call s with 1), the same
  compiled loop (plain sampling at temperature 1, no early stop)."""
  call = lambda n, key: sampler.generate(
      dparams, prompts, config, rng=jax.random.key(key), max_new_tokens=n, temperature=1.0,
      max_new_tokens_bucket=new_tokens).tokens
  start = time.perf_counter()
  jax.block_until_ready(call(new_tokens, 0))
  first = time.perf_counter() - start
  full = best_time(lambda: call(new_tokens, 1), repeats)
  prompt_only = best_time(lambda: call(1, 2), repeats)
  return first - full, full, prompt_only


def torch_generate(model, prompts, new_tokens: int, device: str = "cpu"):
  """transformers' `generate`, sampling exactly `new_tokens` at temperature 1 (tokens on the
  host: a GPU call is finished when it returns)."""
  import torch
  with torch.inference_mode():
    prompts = torch.from_numpy(prompts).to(device)
    return model.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0,
        top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        eos_token_id=None, pad_token_id=0).cpu()

"""The building blocks of the decoder as pure functions: RMSNorm, RoPE, attention.

Shape letters as in `config.py`: B batch, T query time, S key slots, K kv heads,
G query heads per kv head, E head dim, D model width.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from marft_jax.models.config import ModelConfig, RopeScaling

# A finite "minus infinity": a fully masked row (a padding query) then softmaxes to a
# uniform distribution instead of NaN, and NaN never reaches the gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
  """y = x / sqrt(mean(x²) + eps) * weight, computed in f32 as Hugging Face does.

  Args:
    x: [..., D] (or D at `axis`: feature-major layouts keep features on axis 0). weight: [D].
  Returns:
    x's shape and dtype.
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
  shape = [1] * x.ndim
  shape[axis] = weight.shape[0]
  return y.astype(x.dtype) * weight.astype(x.dtype).reshape(shape)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
  """inv_freq[i] = theta^(-2i/E), i < E/2, with linear or Llama-3 scaling applied.

  Llama-3 scaling (`rope_type="llama3"`) keeps high frequencies, divides low frequencies by
  `factor`, and interpolates in between (transformers' `_compute_llama3_parameters`).
  """
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  if scaling.rope_type != "llama3":
    return inv_freq
  old_len = scaling.original_max_position_embeddings
  low_freq_wavelen = old_len / scaling.low_freq_factor
  high_freq_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:
  """Rotates x by its positions, in Hugging Face's half-split ("rotate_half") layout.

  Args:
    x: [B, N, T, E] queries or keys, heads first. positions: [B, T] int.
  Returns:
    [B, N, T, E] in x's dtype.
  """
  inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, E/2]
  cos = jnp.cos(angles)[:, None]
  sin = jnp.sin(angles)[:, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array,
              cached: Optional[tuple[jax.Array, jax.Array, jax.Array]] = None,
              query_block: int = 0, kernel: str = "auto") -> jax.Array:
  """Grouped-query softmax attention over this call's keys and, optionally, a KV cache.

  The softmax runs in f32 over the cached slots and the new keys together (one max, one
  normaliser); in f32 the normaliser divides the output, in a lower precision the
  probabilities, cast to v's dtype once, as Hugging Face's modules do.
  The cache is read as it was before this call, so its update can happen in place afterwards.
  Without a cache (a training pass, or a prompt into an empty cache) `kernel` picks the
  implementation (`self_attention_kernel`): on CPU `_self_attention`, whose gradient is the
  same maths with the probabilities recomputed in the backward pass rather than stored; on
  accelerators a fused kernel, `jax.nn.dot_product_attention` (cuDNN's flash attention on
  NVIDIA GPUs where it applies). They give the same outputs at every query that may attend
  some key; at a padding query (no key allowed) each gives some finite output that nothing
  reads (its key is masked for every query; the trainer masks its loss).

  Args:
    q: [B, K, G, T, E] queries (G query heads per kv head).
    k, v: [B, K, T, E] this call's keys and values.
    allowed: [B, T, T] bool, True where query t may attend new key u (real, and causal
      wherever `query_block` is set).
    cached: None, or (k [B, K, E, S], v [B, K, S, E], valid [B, S]), the KV cache (keys
      stored transposed, so that q·k reads them without a transposed copy: 5-10 % of a
      batch-16 decode step on XLA:CPU). Every valid slot comes before this call's tokens.
    query_block: without a cache, n > 0 runs the queries in blocks of n, each against the
      keys up to its last query only, which skips most scores a causal mask discards (a
      quarter of them at two blocks). Exact only for a causal `allowed` (no key after its
      query): the caller that built the mask says so. 0: one block. Static. n > 0 also
      tells the fused kernels that `allowed` is exactly "u is real and u ≤ t" (what
      `transformer` builds; see `_fused_attention`).
    kernel: without a cache, "auto" (`self_attention_kernel`'s choice for this backend),
      "reference" (the hand-written path, CPU's), "xla_fused" (`jax.nn.dot_product_attention`
      with implementation "xla": runs anywhere, so tests check it on CPU) or "cudnn"
      (NVIDIA GPUs, bf16/f16 only). Ignored with a cache. Static.
  Returns:
    [B, K, G, T, E] in q's dtype.
  """
  if cached is None:
    if kernel == "auto":
      kernel = self_attention_kernel(q.dtype, q.shape[-1])
    if kernel != "reference":
      return _fused_attention(q, k, v, allowed, query_block > 0, kernel)
    return _self_attention(query_blocks(q.shape[3], query_block), q, k, v, allowed)
  return _softmax_attention(q, k, v, allowed, cached)[0]


KERNELS = ("auto", "reference", "xla_fused", "cudnn")


def self_attention_kernel(dtype, head_dim: int) -> str:
  """The kernel `attention(kernel="auto")` runs without a cache, by `jax.default_backend()`.

    cpu   "reference": the hand-written path, tuned on XLA:CPU (its backward keeps no
          [T, T] probabilities and skips the blocks a causal mask discards).
    gpu   "cudnn" on NVIDIA where cuDNN's flash attention takes the call: bf16 or f16, head
          dim a multiple of 8 up to 128 (JAX's own checks; a cuDNN that still refuses the
          call falls back to "xla_fused" when it is traced). Measured on an H200
          (bf16, B 4 × T 1024 × 12 heads × E 128, causal): forward + backward 0.75 ms
          against 1.11 ms for "xla_fused". Otherwise (f32, other shapes, ROCm) "xla_fused".
    tpu   "xla_fused" (unmeasured): XLA's fusion of the textbook attention. It keeps the
          [B, H, T, T] probabilities for the backward: for long rows set `model.remat`, or
          pass kernel="reference".
  """
  backend = jax.default_backend()
  if backend == "cpu":
    return "reference"
  if backend == "gpu" and _cudnn_takes(dtype, head_dim):
    return "cudnn"
  return "xla_fused"


def _cudnn_takes(dtype, head_dim: int) -> bool:
  """An NVIDIA GPU, and a call within cuDNN flash attention's constraints (JAX's checks)."""
  from jax.extend import backend as jex_backend
  if "cuda" not in jex_backend.get_backend().platform_version.lower():
    return False
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and head_dim % 8 == 0 and head_dim <= 128)


def _fused_attention(q, k, v, allowed, causal: bool, kernel: str):
  """`jax.nn.dot_product_attention` on our [B, K, G, T, E] layout.

  Its layout is [B, T, N, E] with query head n = k·G + g reading kv head k: our [K, G]
  axes flattened. A causal `allowed` is read as what `transformer` builds, "key u is real
  and u ≤ t" (the real tokens: its diagonal). Each row's real tokens are then moved first,
  in order, and the kernel runs plain causal attention with no mask: a real query's keys
  are exactly the real tokens up to it, so cuDNN needs no bias (whose gradient it would
  compute: a [B, 1, T, T] pass per layer) and skips the blocks above the diagonal. A padding
  query lands after the real ones and attends what precedes it: finite, and read by nothing.
  A non-causal `allowed` goes to XLA's implementation as a mask.
  """
  if kernel not in ("xla_fused", "cudnn"):
    raise ValueError(f"attention kernel={kernel!r}: must be one of {KERNELS}")
  B, K, G, T, E = q.shape
  time_first = lambda x: jnp.moveaxis(x, -2, 1)  # [B, ..., T, E] -> [B, T, ..., E]
  q, k, v = time_first(q).reshape(B, T, K * G, E), time_first(k), time_first(v.astype(k.dtype))
  if not causal:
    out = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation="xla")
  else:
    real = jnp.diagonal(allowed, axis1=1, axis2=2)  # [B, T]
    order = jnp.argsort(~real, axis=1, stable=True).astype(jnp.int32)  # real tokens first
    inverse = jnp.argsort(order, axis=1).astype(jnp.int32)
    q, k, v = (_permute_time(x, order, inverse) for x in (q, k, v))
    fused = functools.partial(jax.nn.dot_product_attention, q, k, v, is_causal=True)
    try:
      out = fused(implementation="cudnn" if kernel == "cudnn" else "xla")
    except NotImplementedError:  # a GPU or cuDNN version without this case: XLA's
      out = fused(implementation="xla")
    out = _permute_time(out, inverse, order)
  return jnp.moveaxis(out.reshape(B, T, K, G, E), 1, -2)


@jax.custom_vjp
def _permute_time(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """x [B, T, ...] with row b's time steps taken in `order[b]` ([B, T] int, a permutation;
  `inverse` its inverse). The gradient is the inverse gather, not a scatter-add."""
  return _take_time(x, order)


def _take_time(x, order):
  return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)


_permute_time.defvjp(lambda x, order, inverse: (_take_time(x, order), (order, inverse)),
                     lambda res, g: (_take_time(g, res[1]), None, None))


def query_blocks(T: int, size: int) -> tuple[tuple[int, int], ...]:
  """[start, end) of consecutive blocks of `size` queries (the last may be shorter);
  size 0 (or ≥ T): one block."""
  if size <= 0 or size >= T:
    return ((0, T),)
  return tuple((start, min(start + size, T)) for start in range(0, T, size))


def _scores(q: jax.Array, keys: jax.Array, spec: str) -> jax.Array:
  """f32 scores of queries already scaled by 1/√E."""
  return jnp.einsum(spec, q, keys.astype(q.dtype), preferred_element_type=jnp.float32)


def _scaled(q: jax.Array) -> jax.Array:
  return q * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), q.dtype)


def _softmax_attention(q, k, v, allowed, cached):
  """`attention`'s forward: out [B, K, G, T, E], and the softmax's shift and log-normaliser
  ([B, K, G, T, 1] f32 each: kept apart, since a fully masked row's shift would absorb it)."""
  # Scaling q and (in f32) normalising the [T, E] output instead of the [T, S] probabilities
  # saves two passes over the largest tensor; the max is a constant shift of the softmax
  # (exact under stop_gradient), so the backward skips its select-and-scatter. In a lower
  # precision the probabilities are normalised before their cast, as Hugging Face rounds them.
  q = _scaled(q)
  blocks = [(jnp.where(allowed[:, None, None], _scores(q, k, "bkgte,bkse->bkgts"), MASK_VALUE),
             v)]
  if cached is not None:
    old_k, old_v, valid = cached
    old = _scores(q, old_k, "bkgte,bkes->bkgts")
    blocks.insert(0, (jnp.where(valid[:, None, None, None, :], old, MASK_VALUE), old_v))
  top = jax.lax.stop_gradient(
      functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s, _ in blocks]))
  exps = [jnp.exp(s - top) for s, _ in blocks]
  total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
  late = v.dtype == jnp.float32  # normalise the output, not the probabilities
  weights = exps if late else [e / total for e in exps]
  out = sum(jnp.einsum("bkgts,bkse->bkgte", w.astype(v.dtype), values.astype(v.dtype),
                       preferred_element_type=jnp.float32) for w, (_, values) in zip(weights, blocks))
  out = (out / total if late else out).astype(q.dtype)
  return out, (top, jnp.log(total))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _self_attention(blocks, q, k, v, allowed):
  """Attention over this call's own keys (no cache), with a flash-attention-style backward.

  Autodiff of the forward would keep every layer's [B, K, G, T, T] scores and probabilities
  for the backward (stacked over a scan's layers: 0.6 GB at SmolLM2's 8 × 256) and transpose
  them there. This backward keeps only the output and the softmax's shift and normaliser,
  and recomputes the probabilities with one more q·k product: on XLA:CPU a SmolLM2 update's
  attention then costs about half as much. The gradients are computed in f32.

  `blocks`: static ((start, end), ...) query blocks; block [start, end) reads keys [0, end).
  A padding query (no key allowed) is uniform over all keys whatever the blocks.
  """
  return _blocked_forward(blocks, q, k, v, allowed)[0]


def _blocked_forward(blocks, q, k, v, allowed):
  parts = [_softmax_attention(q[:, :, :, start:end], k[:, :, :end], v[:, :, :end],
                              allowed[:, start:end, :end], None) for start, end in blocks]
  out = _join_queries([o for o, _ in parts])
  top, log_total = (_join_queries([n[i] for _, n in parts]) for i in (0, 1))
  if len(blocks) > 1:  # a padding query: over all keys, as in one block, not its block's
    uniform = jnp.mean(v.astype(jnp.float32), axis=2)[:, :, None, None, :]
    out = jnp.where(_real_queries(allowed), out, uniform.astype(out.dtype))
  return out, (top, log_total)


def _join_queries(blocks: list) -> jax.Array:
  """Per-block [B, K, G, T_block, ...] arrays -> [B, K, G, T, ...]."""
  return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=3)


def _real_queries(allowed: jax.Array) -> jax.Array:
  """[B, 1, 1, T, 1] bool: the query may attend some key (not padding)."""
  return jnp.any(allowed, axis=-1)[:, None, None, :, None]


def _self_attention_fwd(blocks, q, k, v, allowed):
  out, normaliser = _blocked_forward(blocks, q, k, v, allowed)
  return out, (q, k, v, allowed, out, normaliser)


def _self_attention_bwd(blocks, residuals, d_out):
  q, k, v, allowed, out, (top, log_total) = residuals
  f32, dtypes = jnp.float32, (q.dtype, k.dtype, v.dtype)
  S = k.shape[2]
  scaled = _scaled(q)
  # A padding query is uniform over all S keys in the forward, and its scores get no
  # gradient: its d_out reaches only the values, d_out / S each, added apart. Zeroing its
  # d_out zeroes its rows of d_scores; every other masked score has a probability of
  # exactly 0, so d_scores needs no [T, S] select of its own.
  d_out = d_out.astype(f32)
  d_real = jnp.where(_real_queries(allowed), d_out, 0.0)
  d_padding = jnp.sum(d_out - d_real, axis=(2, 3)) / S  # [B, K, E]
  # Σ_s p·dp over a query's keys equals dout·out: the softmax's Jacobian without a [T, S] pass.
  row = jnp.sum(d_real * out.astype(f32), axis=-1, keepdims=True)
  # Scores are recomputed in the inputs' dtype, as the forward computed them; the gradients'
  # products run in f32.
  scaled32, k32, v32 = (x.astype(f32) for x in (scaled, k, v))
  d_qs, d_k, d_v = [], 0.0, 0.0  # d_k, d_v key-major [B, K, E, S] until the end
  for start, end in blocks:
    rows = lambda x: x[:, :, :, start:end]
    keys = lambda x: x[:, :, :end]
    scores = jnp.where(allowed[:, None, None, start:end, :end],
                       _scores(rows(scaled), keys(k), "bkgte,bkse->bkgts"), MASK_VALUE)
    probs = jnp.exp((scores - rows(top)) - rows(log_total))
    d_v = d_v + _pad_keys(jnp.einsum("bkgte,bkgts->bkes", rows(d_real), probs), S)
    d_probs = jnp.einsum("bkgte,bkse->bkgts", rows(d_real), keys(v32))
    d_scores = probs * (d_probs - rows(row))
    d_qs.append(jnp.einsum("bkgts,bkse->bkgte", d_scores, keys(k32)))
    d_k = d_k + _pad_keys(jnp.einsum("bkgte,bkgts->bkes", rows(scaled32), d_scores), S)
  d_q = _join_queries(d_qs) * (1.0 / math.sqrt(q.shape[-1]))
  d_k = _key_major(d_k)
  d_v = _key_major(d_v) + d_padding[:, :, None, :]
  return (*(d.astype(dtype) for d, dtype in zip((d_q, d_k, d_v), dtypes)), None)


def _pad_keys(x: jax.Array, S: int) -> jax.Array:
  """[..., E, end] -> [..., E, S], zeros after `end`."""
  return x if x.shape[-1] == S else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, S - x.shape[-1])])


def _key_major(x: jax.Array) -> jax.Array:
  """[..., E, S] -> [..., S, E], transposed after the product that formed it.

  The key gradients contract the G·T queries. XLA:CPU runs that product at about half the
  rate when it writes [S, E] (the layout the caller needs) than when it writes [E, S], and
  left to itself it folds a following transpose into the product's output; the barrier keeps
  the product [E, S] and makes the transpose a copy of the small result (d_k and d_v: 5-7 %
  of a SmolLM2 update's attention).
  """
  return jnp.swapaxes(jax.lax.optimization_barrier(x), -1, -2)


_self_attention.defvjp(_self_attention_fwd, _self_attention_bwd)

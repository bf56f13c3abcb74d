"""The building blocks of the decoder as pure functions: RMSNorm, RoPE, attention.

Shape letters as in `config.py`: B batch, T query time, S key slots, K kv heads,
G query heads per kv head, E head dim, D model width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from marft_jax.models.config import ModelConfig, RopeScaling

# A finite "minus infinity": a fully masked row (a padding query) then softmaxes to a
# uniform distribution instead of NaN, and NaN never reaches the gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = -1) -> jax.Array:
  """y = x / sqrt(mean(x²) + eps) * weight, computed in f32 as Hugging Face does.

  Args:
    x: [..., D] (or D at `axis`: the decode layout keeps features on axis 0). weight: [D].
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
    x: [B, T, N, E] queries or keys. positions: [B, T] int.
  Returns:
    [B, T, N, E] in x's dtype.
  """
  inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, E/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
  """Grouped-query softmax attention without repeating the kv heads.

  Args:
    q: [B, T, K, G, E] queries. k, v: [B, S, K, E].
    allowed: [B, T, S] bool, True where query t may attend slot s.
  Returns:
    [B, T, K, G, E] in q's dtype.
  """
  scale = 1.0 / math.sqrt(q.shape[-1])
  scores = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bske->btkge", probs, v)

"""Masked reductions shared by the losses and the normalisers, and their float32 floor.

A mask is 0/1 (or bool) with the shape of the data; anything non-zero marks a valid
element. Masked-out elements never reach the arithmetic (they are selected away with
`jnp.where`, not multiplied by 0), so padding that holds garbage, inf or NaN is harmless,
and an all-masked input reduces to 0 instead of NaN.

Every ppo function computes in float32 or wider (`at_least_float32`): bfloat16 or float16
inputs are cast up first and the results are float32. The RL maths amplifies rounding. In
bf16 a 200-token reply's log-likelihood of about −119 rounds to a multiple of 0.5, so a PPO
ratio of 1.15 computed from bf16 sums came out as exactly 1; and k3 = (r − 1) − log r, a
difference of terms 200 times its size for log-ratios near 0.01, came out 0 for 40 % of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.validation import check_same_shape


def at_least_float32(x: jax.Array) -> jax.Array:
  """`x` as an array of float32 or wider: bfloat16, float16, ints and bools become float32;
  float32 and float64 are kept."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Σᵢ xᵢ over the valid elements of `x` (any shape, same shape as `mask`), at least f32.

  Example: the padding's NaN never reaches the sum.

    >>> print(masked_sum(jnp.array([1.0, 2.0, jnp.nan]), jnp.array([1, 1, 0])))
    3.0
  """
  check_same_shape(x=x, mask=mask)
  x = at_least_float32(x)
  return jnp.sum(jnp.where(mask != 0, x, jnp.zeros_like(x)))


def masked_count(mask: jax.Array) -> jax.Array:
  """Number of valid elements, as a float so it can divide.

  Example:

    >>> print(masked_count(jnp.array([1, 1, 0])))
    2.0
  """
  return jnp.sum((mask != 0).astype(jnp.float32))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Σᵢ mᵢxᵢ / max(Σᵢ mᵢ, 1): the mean over valid elements, 0 when there are none; at
  least f32.

  Example: the padding's NaN is not counted; nothing valid gives 0, not NaN.

    >>> print(masked_mean(jnp.array([1.0, 2.0, jnp.nan]), jnp.array([1, 1, 0])))
    1.5
    >>> print(masked_mean(jnp.array([1.0, 2.0, jnp.nan]), jnp.zeros(3)))
    0.0
  """
  return masked_sum(x, mask) / jnp.maximum(masked_count(mask), 1.0)

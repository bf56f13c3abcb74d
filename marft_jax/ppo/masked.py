"""Masked reductions shared by the losses and the normalisers.

A mask is 0/1 (or bool) with the shape of the data; anything non-zero marks a valid
element. Masked-out elements never reach the arithmetic (they are selected away with
`jnp.where`, not multiplied by 0), so padding that holds garbage, inf or NaN is harmless,
and an all-masked input reduces to 0 instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.validation import check_same_shape


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Σᵢ xᵢ over the valid elements of `x` (any shape, same shape as `mask`)."""
  check_same_shape(x=x, mask=mask)
  return jnp.sum(jnp.where(mask != 0, x, jnp.zeros_like(x)))


def masked_count(mask: jax.Array) -> jax.Array:
  """Number of valid elements, as a float so it can divide."""
  return jnp.sum((mask != 0).astype(jnp.float32))


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Σᵢ mᵢxᵢ / max(Σᵢ mᵢ, 1): the mean over valid elements, 0 when there are none."""
  return masked_sum(x, mask) / jnp.maximum(masked_count(mask), 1.0)

"""Critic losses: clipped squared error and clipped Huber, masked means over elements.

Index convention as in `policy_loss`: t indexes an action (action-level critic) or a
token (token-level critic); all arrays have the same, arbitrary shape. Gradients flow
through `v_t` only.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from marft_jax.ppo.masked import masked_mean

_sg = jax.lax.stop_gradient


def huber_loss(x: jax.Array, delta: float) -> jax.Array:
  """h(x) = ½x² for |x| ≤ δ, δ(|x| − ½δ) otherwise, elementwise.

  Both signs are handled: the original's `b = (e > d)` dropped the branch e < −δ and gave
  those errors zero loss (reference defect D12).
  """
  abs_x = jnp.abs(x)
  quadratic = jnp.minimum(abs_x, delta)
  return 0.5 * quadratic**2 + delta * (abs_x - quadratic)


def _pessimistic(error_fn, v_t, old_v_t, returns_t, clip_eps):
  # PPO's value clip: the worse of the unclipped and the clipped prediction's error.
  loss = error_fn(_sg(returns_t) - v_t)
  if clip_eps is None:
    return loss
  old_v_t = _sg(old_v_t)
  v_clipped = old_v_t + jnp.clip(v_t - old_v_t, -clip_eps, clip_eps)
  return jnp.maximum(loss, error_fn(_sg(returns_t) - v_clipped))


def clipped_value_loss(v_t: jax.Array, old_v_t: jax.Array, returns_t: jax.Array,
                       mask_t: jax.Array, clip_eps: float | None = None) -> jax.Array:
  """L_V = (1/Σm) Σ_t m_t max(½(R_t − v_t)², ½(R_t − v̂_t)²), v̂_t = v_old + clip(v − v_old, ±ε_v).

  AReaL's critic loss (ε_v = 0.5 there). clip_eps=None gives the plain ½(R − v)².

  Args:
    v_t: current values. old_v_t: values at rollout time. returns_t: targets R_t.
    mask_t: non-zero where the element counts. All the same shape.
  Returns:
    scalar loss.
  """
  chex.assert_equal_shape([v_t, old_v_t, returns_t, mask_t])
  return masked_mean(_pessimistic(lambda e: 0.5 * e**2, v_t, old_v_t, returns_t, clip_eps),
                     mask_t)


def clipped_huber_value_loss(v_t: jax.Array, old_v_t: jax.Array, returns_t: jax.Array,
                             mask_t: jax.Array, delta: float,
                             clip_eps: float | None = None) -> jax.Array:
  """L_V = (1/Σm) Σ_t m_t max(h(R_t − v_t), h(R_t − v̂_t)) with h the Huber loss.

  The original MARFT critic loss (δ = 10, ε_v = 0.2), with both error signs (D12).

  Args:
    v_t, old_v_t, returns_t, mask_t: as `clipped_value_loss`.
    delta: Huber threshold δ.
    clip_eps: value clip ε_v; None for no clipping.
  Returns:
    scalar loss.
  """
  chex.assert_equal_shape([v_t, old_v_t, returns_t, mask_t])
  error_fn = functools.partial(huber_loss, delta=delta)
  return masked_mean(_pessimistic(error_fn, v_t, old_v_t, returns_t, clip_eps), mask_t)

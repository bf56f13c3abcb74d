"""Critic losses: clipped squared error and clipped Huber, masked means over elements.

Index convention as in `policy_loss`: t indexes an action (action-level critic) or a
token (token-level critic); all arrays have the same, arbitrary shape. Gradients flow
through `v_t` only. Masked elements of v_t, old_v_t and returns_t are replaced by 0 before
the error is formed, so NaN or inf padding contributes exactly 0 to the loss and to the
gradient (multiplying or selecting after the arithmetic would still give 0 · NaN in the
backward pass and turn the critic's parameters into NaN).

Checks: a concrete Huber δ ≤ 0, NaN or inf, or a value clip ε_v < 0 or NaN raises
`ValueError` naming the argument. Traced values are checked only under `checkify` (see
`marft_jax.ppo`); without it δ ≤ 0 gives a loss ≤ 0 and a negative ε_v inverts the clip.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from marft_jax.validation import check_positive, check_range, check_same_shape
from marft_jax.ppo.masked import at_least_float32, masked_mean

_sg = jax.lax.stop_gradient


def huber_loss(x: jax.Array, delta: float) -> jax.Array:
  """h(x) = ½x² for |x| ≤ δ, δ(|x| − ½δ) otherwise, elementwise.

  Both signs are handled: the original's `b = (e > d)` dropped the branch e < −δ and gave
  those errors zero loss (reference defect D12, docs/references.md). δ must be finite and
  > 0 (ValueError otherwise, when concrete).
  """
  check_positive("delta", delta)
  return _huber(at_least_float32(x), delta)


def _huber(x: jax.Array, delta: float) -> jax.Array:
  abs_x = jnp.abs(x)
  quadratic = jnp.minimum(abs_x, delta)
  return 0.5 * quadratic**2 + delta * (abs_x - quadratic)


def _pessimistic(error_fn, v_t, old_v_t, returns_t, mask_t, clip_eps):
  # PPO's value clip: the worse of the unclipped and the clipped prediction's error.
  check_range("clip_eps", clip_eps, 0.0)
  valid = mask_t != 0
  v_t, old_v_t, returns_t = (jnp.where(valid, x, jnp.zeros_like(x))
                             for x in map(at_least_float32, (v_t, old_v_t, returns_t)))
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
    clip_eps: ε_v ≥ 0, or None.
  Returns:
    scalar loss.
  Raises:
    ValueError: a concrete clip_eps < 0 or NaN.
  """
  check_same_shape(v_t=v_t, old_v_t=old_v_t, returns_t=returns_t, mask_t=mask_t)
  loss = _pessimistic(lambda e: 0.5 * e**2, v_t, old_v_t, returns_t, mask_t, clip_eps)
  return masked_mean(loss, mask_t)


def clipped_huber_value_loss(v_t: jax.Array, old_v_t: jax.Array, returns_t: jax.Array,
                             mask_t: jax.Array, delta: float,
                             clip_eps: float | None = None) -> jax.Array:
  """L_V = (1/Σm) Σ_t m_t max(h(R_t − v_t), h(R_t − v̂_t)) with h the Huber loss.

  The original MARFT critic loss (δ = 10, ε_v = 0.2), with both error signs (D12,
  docs/references.md).

  Args:
    v_t, old_v_t, returns_t, mask_t: as `clipped_value_loss`.
    delta: Huber threshold δ, finite and > 0.
    clip_eps: value clip ε_v ≥ 0; None for no clipping.
  Returns:
    scalar loss.
  Raises:
    ValueError: a concrete delta ≤ 0, NaN or inf, or clip_eps < 0 or NaN.
  """
  check_same_shape(v_t=v_t, old_v_t=old_v_t, returns_t=returns_t, mask_t=mask_t)
  check_positive("delta", delta)
  error_fn = functools.partial(_huber, delta=delta)
  return masked_mean(_pessimistic(error_fn, v_t, old_v_t, returns_t, mask_t, clip_eps), mask_t)

"""PPO policy losses: clipped surrogate, dual clip, clip-higher, decoupled PPO.

Index convention: t indexes whatever carries a ratio. For action-level PPO (MARFT-A) it
is one action per (sample, agent) and log-probs come from `action_log_prob*`; for
per-token PPO (MARFT-T, AReaL) it is one token. Arrays may have any shape as long as all
have the same; losses are masked means over every element, so vmap over sequences gives
per-sequence means and a flat call gives the token mean over the batch.

Gradients flow through `logp_t` only: old, proximal and behaviour log-probs and the
advantages are wrapped in `stop_gradient`. Losses are to be minimised. Masked elements
are selected away before any arithmetic, so padding that holds NaN or inf (log-probs of
pad tokens, advantages never written) contributes exactly 0 to the loss and to the
gradient. The papers cited below are listed in docs/references.md.

Checks: a concrete ε or ε_high < 0 or NaN, a dual clip c ≤ 1 or NaN, or an importance
weight cap ≤ 0 or NaN raises `ValueError` naming the argument (+inf is allowed: no
clip). Traced values are checked only under `checkify` (see `marft_jax.ppo`); without it
a negative ε inverts the clip range and a NaN one makes the loss NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.ppo._checks import check_range
from marft_jax.validation import check_same_shape
from marft_jax.ppo.masked import at_least_float32, masked_count, masked_mean, masked_sum

_sg = jax.lax.stop_gradient


def _check_clip(epsilon, epsilon_high=None, dual_clip=None) -> None:
  check_range("epsilon", epsilon, 0.0)
  check_range("epsilon_high", epsilon_high, 0.0)
  check_range("dual_clip", dual_clip, 1.0, low_open=True)


def _select(x_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """x_t (at least f32) where mask_t is set, 0 elsewhere."""
  x_t = at_least_float32(x_t)
  return jnp.where(mask_t != 0, x_t, jnp.zeros_like(x_t))


def _ratio(logp_t: jax.Array, old_logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  # Padding may hold garbage log-probs (inf − inf, exp overflow): select them away first.
  check_same_shape(logp_t=logp_t, old_logp_t=old_logp_t, mask_t=mask_t)
  return jnp.exp(_select(logp_t, mask_t) - _sg(_select(old_logp_t, mask_t)))


def clipped_surrogate(ratio_t: jax.Array, adv_t: jax.Array, epsilon: float,
                      epsilon_high: float | None = None,
                      dual_clip: float | None = None) -> jax.Array:
  """Per-element PPO loss (Schulman et al. 2017) with clip-higher and dual clip.

      ℓ_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε, 1 + ε_high))
      dual clip (c > 1, Ye et al. 2020):  ℓ_t ← min(ℓ_t, −c A_t)  where A_t < 0

  ε_high > ε (DAPO's clip-higher) lets unlikely tokens grow faster; it defaults to ε.
  The dual clip bounds the loss of a negative-advantage element whose ratio exploded.

  Args:
    ratio_t: ρ_t = π(a_t) / π_old(a_t), any shape.
    adv_t: A_t, same shape.
    epsilon, epsilon_high: ≥ 0 (+inf: no clip on that side).
    dual_clip: c > 1, or None for no dual clip.
  Returns:
    ℓ_t, same shape.
  Raises:
    ValueError: a concrete epsilon or epsilon_high < 0 or NaN, or dual_clip ≤ 1 or NaN.

  Example: ratios 0.5, 1, 1.5 with ε = 0.2. A = 1: ℓ = −min(ρ, clip(ρ)), the gain stops at
  1.2. A = −1: ℓ = max(ρ, clip(ρ)), a ratio pushed down stops at 0.8; the dual clip c = 1.3
  caps the loss of the exploded ratio 1.5.

    >>> ratio = jnp.array([0.5, 1.0, 1.5])
    >>> print(clipped_surrogate(ratio, jnp.ones(3), 0.2))
    [-0.5 -1.  -1.2]
    >>> print(clipped_surrogate(ratio, -jnp.ones(3), 0.2))
    [0.8 1.  1.5]
    >>> print(clipped_surrogate(ratio, -jnp.ones(3), 0.2, dual_clip=1.3))
    [0.8 1.  1.3]
  """
  check_same_shape(ratio_t=ratio_t, adv_t=adv_t)
  _check_clip(epsilon, epsilon_high, dual_clip)
  return _surrogate(at_least_float32(ratio_t), at_least_float32(adv_t), epsilon, epsilon_high,
                    dual_clip)


def _surrogate(ratio_t, adv_t, epsilon, epsilon_high, dual_clip):
  # `clipped_surrogate` without the argument checks.
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  clipped = jnp.clip(ratio_t, 1.0 - epsilon, 1.0 + epsilon_high)
  loss = jnp.maximum(-adv_t * ratio_t, -adv_t * clipped)
  if dual_clip is not None:
    loss = jnp.where(adv_t < 0, jnp.minimum(loss, -dual_clip * adv_t), loss)
  return loss


def ppo_clip_loss(logp_t: jax.Array, old_logp_t: jax.Array, adv_t: jax.Array,
                  mask_t: jax.Array, epsilon: float, epsilon_high: float | None = None,
                  dual_clip: float | None = None) -> jax.Array:
  """L = (1/Σm) Σ_t m_t ℓ_t(ρ_t, A_t) with ρ_t = exp(log π(a_t) − log π_old(a_t)).

  ℓ_t is `clipped_surrogate`. Action-level (MARFT-A): t = (sample, agent) and log π is an
  action log-prob. Per-token (MARFT-T): t = token, A_t the token advantage.

  Args:
    logp_t, old_logp_t, adv_t, mask_t: same shape.
    epsilon, epsilon_high, dual_clip: see `clipped_surrogate`.
  Returns:
    scalar loss, 0 when every element is masked.
  Raises:
    ValueError: as `clipped_surrogate`.

  Example: ratios 1.5 and 0.5 with A = 1, a third element masked: ℓ = (−1.2, −0.5), mean
  −0.85. The clipped element gets no gradient; the other −ρ/2 = −0.25 in its log-prob.

    >>> logp, old_logp = jnp.log(jnp.array([1.5, 0.5, 1.0])), jnp.zeros(3)
    >>> adv, mask = jnp.array([1.0, 1.0, 9.0]), jnp.array([1, 1, 0])
    >>> print(f"{ppo_clip_loss(logp, old_logp, adv, mask, epsilon=0.2):.3f}")
    -0.850
    >>> grad = jax.grad(ppo_clip_loss)(logp, old_logp, adv, mask, 0.2)
    >>> print(grad[1], grad[0] == 0, grad[2] == 0)  # (0 == −0: the sign of a 0 may vary)
    -0.25 True True
  """
  check_same_shape(logp_t=logp_t, old_logp_t=old_logp_t, adv_t=adv_t, mask_t=mask_t)
  _check_clip(epsilon, epsilon_high, dual_clip)
  ratio = _ratio(logp_t, old_logp_t, mask_t)
  adv_t = _sg(_select(adv_t, mask_t))
  return masked_mean(_surrogate(ratio, adv_t, epsilon, epsilon_high, dual_clip), mask_t)


def decoupled_ppo_loss(logp_t: jax.Array, prox_logp_t: jax.Array, behav_logp_t: jax.Array,
                       adv_t: jax.Array, mask_t: jax.Array, epsilon: float,
                       epsilon_high: float | None = None, dual_clip: float | None = None,
                       imp_weight_cap: float | None = None) -> jax.Array:
  """Decoupled PPO (Hilton et al. 2022; AReaL): clip against π_prox, correct for π_behav.

      ρ_t = π_θ(a_t) / π_prox(a_t),    w_t = π_prox(a_t) / π_behav(a_t)
      L = (1/Σm) Σ_t m_t 1[w_t ≤ cap] w_t ℓ_t(ρ_t, A_t)

  π_behav generated the tokens (possibly several policy versions ago, or one version per
  token after an interrupted generation); π_prox is the recent policy recomputed on the
  same tokens. Elements whose weight exceeds the cap are dropped from the sum but still
  count in the denominator, as in AReaL.

  Args:
    logp_t, prox_logp_t, behav_logp_t, adv_t, mask_t: same shape.
    epsilon, epsilon_high, dual_clip: see `clipped_surrogate`.
    imp_weight_cap: drop elements with w_t above it, > 0; None keeps all.
  Returns:
    scalar loss.
  Raises:
    ValueError: as `clipped_surrogate`, or a concrete imp_weight_cap ≤ 0 or NaN.

  Example: `ppo_clip_loss`' ratios (1.5 and 0.5 against π_prox), the second token sampled
  by a π_behav half as likely as π_prox (w = 2): ℓ = (−1.2, 2 · −0.5), mean −1.1. A cap of
  1.5 drops it from the sum but not from the count: −1.2 / 2.

    >>> logp, prox_logp = jnp.log(jnp.array([1.5, 0.5])), jnp.zeros(2)
    >>> behav_logp = jnp.log(jnp.array([1.0, 0.5]))
    >>> adv, mask = jnp.ones(2), jnp.ones(2)
    >>> print(f"{decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, mask, 0.2):.3f}")
    -1.100
    >>> capped = decoupled_ppo_loss(logp, prox_logp, behav_logp, adv, mask, 0.2,
    ...                             imp_weight_cap=1.5)
    >>> print(f"{capped:.3f}")
    -0.600
  """
  check_same_shape(logp_t=logp_t, prox_logp_t=prox_logp_t, behav_logp_t=behav_logp_t,
                   adv_t=adv_t, mask_t=mask_t)
  _check_clip(epsilon, epsilon_high, dual_clip)
  ratio = _ratio(logp_t, prox_logp_t, mask_t)
  weight, keep = importance_weights(prox_logp_t, behav_logp_t, mask_t, imp_weight_cap)
  adv_t = _sg(_select(adv_t, mask_t))
  loss = weight * _surrogate(ratio, adv_t, epsilon, epsilon_high, dual_clip)
  return masked_sum(loss, keep) / jnp.maximum(masked_count(mask_t), 1.0)


def importance_weights(prox_logp_t: jax.Array, behav_logp_t: jax.Array, mask_t: jax.Array,
                       imp_weight_cap: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Decoupled PPO's behaviour weights and the elements they keep (no gradient).

      w_t = π_prox(a_t) / π_behav(a_t),    keep_t = m_t ∧ (w_t ≤ cap)

  Args:
    prox_logp_t, behav_logp_t, mask_t: same shape (masked elements get w_t = 1).
    imp_weight_cap: > 0, or None to keep every valid element.
  Returns:
    (w_t, keep_t bool), same shape.
  Raises:
    ValueError: a concrete imp_weight_cap ≤ 0 or NaN.

  Example: π_prox / π_behav = 0.5 / 0.5 and 0.5 / 0.25; a cap of 1.5 keeps the first.

    >>> prox_logp, behav_logp = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.5, 0.25]))
    >>> weight, keep = importance_weights(prox_logp, behav_logp, jnp.ones(2), 1.5)
    >>> print(weight, keep)
    [1. 2.] [ True False]
  """
  check_range("imp_weight_cap", imp_weight_cap, 0.0, low_open=True)
  weight = _sg(_ratio(prox_logp_t, behav_logp_t, mask_t))
  keep = mask_t != 0
  if imp_weight_cap is not None:
    keep = keep & (weight <= imp_weight_cap)
  return weight, keep


def clip_fraction(logp_t: jax.Array, old_logp_t: jax.Array, mask_t: jax.Array,
                  epsilon: float, epsilon_high: float | None = None) -> jax.Array:
  """Diagnostic: fraction of valid elements with ρ_t outside [1 − ε, 1 + ε_high].

  Any shape; returns a scalar in [0, 1] with no gradient. ValueError as `clipped_surrogate`.

  Example: ratios 1.5, 0.5, 1.1 with ε = 0.2: two of the three lie outside [0.8, 1.2].

    >>> logp, old_logp = jnp.log(jnp.array([1.5, 0.5, 1.1])), jnp.zeros(3)
    >>> print(f"{clip_fraction(logp, old_logp, jnp.ones(3), 0.2):.3f}")
    0.667
  """
  _check_clip(epsilon, epsilon_high)
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  ratio = _sg(_ratio(logp_t, old_logp_t, mask_t))
  outside = (ratio < 1.0 - epsilon) | (ratio > 1.0 + epsilon_high)
  return masked_mean(outside.astype(jnp.float32), mask_t)

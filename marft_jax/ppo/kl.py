"""KL estimators from sampled-token log-probs (Schulman, "Approximating KL divergence";
see docs/references.md).

With tokens w ~ π and log r = log π_ref(w) − log π(w), each estimator's mean over samples
estimates KL(π ‖ π_ref):

    k1 = −log r              unbiased, high variance, negative on some samples
    k2 = ½ (log r)²          biased (exact to second order), low variance
    k3 = (r − 1) − log r     unbiased, low variance, never negative

As a loss term the gradient matters, not the value. On on-policy samples, ∇ mean(k2) is
∇KL(π ‖ π_ref); ∇ mean(k1) is 0 in expectation (the score function has mean 0), so a k1
loss does nothing on average; ∇ mean(k3) is ∇KL(π_ref ‖ π), the forward KL. As a reward
(`kl_reward`, AReaL's KL-in-reward, k3 with coefficient 0.1 in MARFT) only the value is
used and the critic and GAE carry it.

All functions are elementwise or masked means over arrays of any (equal) shape.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from marft_jax.ppo._checks import check_range
from marft_jax.validation import check_same_shape
from marft_jax.ppo.masked import at_least_float32, masked_mean


def kl_k1(logp_t: jax.Array, ref_logp_t: jax.Array) -> jax.Array:
  """k1 = log π(w_t) − log π_ref(w_t), elementwise.

  Example: π(w) = 0.5 against π_ref(w) = 0.25, then 0.5 against 0.5: log 2 ≈ 0.693, then 0.

    >>> import numpy as np  # rounded on the host: the digits are the same on every CPU
    >>> logp, ref_logp = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.5]))
    >>> print(np.asarray(kl_k1(logp, ref_logp)).round(3))
    [0.693 0.   ]
  """
  check_same_shape(logp_t=logp_t, ref_logp_t=ref_logp_t)
  return at_least_float32(logp_t) - at_least_float32(ref_logp_t)


def kl_k2(logp_t: jax.Array, ref_logp_t: jax.Array) -> jax.Array:
  """k2 = ½ (log π(w_t) − log π_ref(w_t))², elementwise.

  Example: as `kl_k1`'s, ½ (log 2)² ≈ 0.240.

    >>> import numpy as np
    >>> logp, ref_logp = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.5]))
    >>> print(np.asarray(kl_k2(logp, ref_logp)).round(3))
    [0.24 0.  ]
  """
  check_same_shape(logp_t=logp_t, ref_logp_t=ref_logp_t)
  return 0.5 * (at_least_float32(logp_t) - at_least_float32(ref_logp_t)) ** 2


def kl_k3(logp_t: jax.Array, ref_logp_t: jax.Array) -> jax.Array:
  """k3 = exp(log r) − 1 − log r with log r = log π_ref(w_t) − log π(w_t), elementwise.

  Example: as `kl_k1`'s, r = 0.5: (0.5 − 1) + log 2 ≈ 0.193.

    >>> import numpy as np
    >>> logp, ref_logp = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.5]))
    >>> print(np.asarray(kl_k3(logp, ref_logp)).round(3))
    [0.193 0.   ]
  """
  check_same_shape(logp_t=logp_t, ref_logp_t=ref_logp_t)
  log_r = at_least_float32(ref_logp_t) - at_least_float32(logp_t)
  return jnp.expm1(log_r) - log_r


KLEstimator = Callable[[jax.Array, jax.Array], jax.Array]

# The estimators by the names configs use (`LossConfig.kl_estimator`, AReaL's `kl_estimator`).
KL_ESTIMATORS: dict[str, KLEstimator] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logp_t: jax.Array, ref_logp_t: jax.Array, mask_t: jax.Array,
               estimator: KLEstimator = kl_k3) -> jax.Array:
  """KL loss term: (1/Σm) Σ_t m_t k(log π(w_t), log π_ref(w_t)).

  Args:
    logp_t: current-policy log-probs (carry the gradient).
    ref_logp_t: reference-policy log-probs (treated as constants).
    mask_t: non-zero on valid tokens. All the same shape.
    estimator: `kl_k1`, `kl_k2` or `kl_k3` (static under jit).
  Returns:
    scalar.

  Example: `kl_k3`'s two tokens; the second is padding, so the mean is over the first alone.

    >>> logp, ref_logp = jnp.log(jnp.array([0.5, 0.5])), jnp.log(jnp.array([0.25, 0.5]))
    >>> print(f"{kl_penalty(logp, ref_logp, jnp.array([1, 0])):.3f}")
    0.193
    >>> print(f"{kl_penalty(logp, ref_logp, jnp.array([1, 0]), kl_k2):.3f}")
    0.240
  """
  check_same_shape(logp_t=logp_t, ref_logp_t=ref_logp_t, mask_t=mask_t)
  valid = mask_t != 0
  logp_t, ref_logp_t = at_least_float32(logp_t), at_least_float32(ref_logp_t)
  # Padding may hold garbage; keep it out of exp() so no inf reaches the gradient.
  logp_t = jnp.where(valid, logp_t, jnp.zeros_like(logp_t))
  ref_logp_t = jnp.where(valid, jax.lax.stop_gradient(ref_logp_t), jnp.zeros_like(ref_logp_t))
  return masked_mean(estimator(logp_t, ref_logp_t), mask_t)


def kl_reward(logp_t: jax.Array, ref_logp_t: jax.Array, mask_t: jax.Array, kl_coef: float,
              estimator: KLEstimator = kl_k3) -> jax.Array:
  """KL-in-reward: r_t^KL = −β k(log π_behav(w_t), log π_ref(w_t)) on valid tokens, 0 elsewhere.

  Add it to the per-position rewards before the backup (`turn_chain_advantages`'
  `kl_reward_t`; the trainer: `advantage.kl_reward_coef`).

  Args:
    logp_t: log-probs of the policy that sampled the tokens.
    ref_logp_t: reference-policy log-probs.
    mask_t: non-zero on valid tokens. All the same shape.
    kl_coef: β, finite and ≥ 0.
    estimator: `kl_k1`, `kl_k2` or `kl_k3` (static under jit).
  Returns:
    rewards, same shape.
  Raises:
    ValueError: a concrete kl_coef < 0, NaN or inf (a negative β would reward moving away
      from the reference). A traced β is checked only under `checkify` (`marft_jax.ppo`);
      without it a NaN β makes every valid reward NaN.

  Example: `kl_k3`'s first token with β = 0.1: −0.1 · 0.193; the padding gets 0.

    >>> import numpy as np
    >>> logp, ref_logp = jnp.log(jnp.array([0.5, 0.25])), jnp.log(jnp.array([0.25, 0.5]))
    >>> print(np.asarray(kl_reward(logp, ref_logp, jnp.array([1, 0]), kl_coef=0.1)).round(4))
    [-0.0193  0.    ]
  """
  check_same_shape(logp_t=logp_t, ref_logp_t=ref_logp_t, mask_t=mask_t)
  check_range("kl_coef", kl_coef, 0.0, math.inf, high_open=True)
  valid = mask_t != 0
  logp_t, ref_logp_t = at_least_float32(logp_t), at_least_float32(ref_logp_t)
  kl = estimator(jnp.where(valid, logp_t, 0.0), jnp.where(valid, ref_logp_t, 0.0))
  return jnp.where(valid, -kl_coef * jax.lax.stop_gradient(kl), jnp.zeros_like(kl))


def approx_kl(logp_t: jax.Array, old_logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """Diagnostic KL(π_old ‖ π) ≈ mean_t[(ρ_t − 1) − log ρ_t], ρ_t = π(a_t)/π_old(a_t).

  k3 on samples from π_old, as the original's `approx_kl`. Any shape; scalar, no gradient.

  Example: ρ = 2 on one token: (2 − 1) − log 2 ≈ 0.307.

    >>> kl = approx_kl(jnp.log(jnp.array([0.5])), jnp.log(jnp.array([0.25])), jnp.array([1]))
    >>> print(f"{kl:.3f}")
    0.307
  """
  check_same_shape(logp_t=logp_t, old_logp_t=old_logp_t, mask_t=mask_t)
  valid = mask_t != 0
  kl = kl_k3(jnp.where(valid, old_logp_t, 0.0), jnp.where(valid, logp_t, 0.0))  # k3 casts up
  return jax.lax.stop_gradient(masked_mean(kl, mask_t))

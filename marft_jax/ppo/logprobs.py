"""Log-probabilities and entropies of actions from per-token logits.

An action is one agent's reply: a run of tokens w_0 … w_{ℓ−1}, selected by a mask over a
padded [T] axis. logits[t] is the model's output that scores tokens[t] (the caller aligns
them: the logits at sequence position p predict the token at p+1).

Score at the sampling temperature (reference defect D9 in docs/references.md: the
original sampled at T = 0.5 and scored at T = 1, so its π_old was not the behaviour policy).

Temperature must be finite and > 0; a concrete τ = 0, negative, NaN or inf raises
`ValueError` naming `temperature`. τ = 0 is refused rather than read as "greedy": the
τ → 0 limit gives log-prob 0 to the argmax token and −inf to every other, so PPO ratios
become 0, 1 or NaN, the log-prob has no gradient in the logits, and ties have no answer.
A greedy sampler is a deterministic policy that PPO cannot score; score its tokens at the
temperature the policy is trained at (usually 1) and treat them as off-policy. A traced τ
is checked only under `checkify` (see `marft_jax.ppo`); without it τ = 0 gives NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.ppo._checks import check_positive
from marft_jax.validation import check_rank, check_same_shape
from marft_jax.ppo.masked import at_least_float32, masked_mean, masked_sum


def logprobs_and_entropy(logits: jax.Array, tokens: jax.Array, temperature=1.0,
                         with_entropy: bool = True) -> tuple[jax.Array, jax.Array]:
  """log π(w) and H(π) of the distribution π = softmax(logits / τ) at each position.

      log π(w) = z_w − lse(z),    H = −Σ_v π_v log π_v = lse(z) − Σ_v π_v z_v,    z = logits/τ

  with lse(z) = m + log Σ_v e^(z_v − m), m = max_v z_v. e^(z − m) is formed once and shared
  by the normaliser and the entropy; no [..., V] log-softmax is materialised (the trainer's
  SmolLM2 update on XLA:CPU spends its time in these exponentials). The gradient is exact:
  lse does not depend on m, so m carries none.

  Vocabulary entries with probability 0 (logit −inf) contribute 0, not NaN, to the entropy
  and to its gradient. A token id outside [0, V) scores NaN (negative ids do not wrap
  around): harmless at a masked position once a masked reduction (`action_log_prob`)
  selects it away, loud anywhere else, so padding may hold −1 or −100. Positions are
  independent, but a NaN or inf logit row gives NaN in the gradient of the whole call even
  where its value is masked away: gather the positions to score first (the trainer does).

  Args:
    logits: [..., V] logits scoring each position; bfloat16 is scored in float32 (the
      log-probs feed exp(Δ) ratios, where bf16 rounding would read as a policy change).
    tokens: [...] int token ids.
    temperature: τ, the sampling temperature, finite and > 0: a scalar, or [...] per
      position.
    with_entropy: False returns zeros for the entropy (the normaliser alone is computed).
  Returns:
    (log π(w) [...], H [...]), at least float32.
  Raises:
    ValueError: a concrete temperature ≤ 0, NaN or inf (see the module docstring for τ = 0).

  Example: two positions over a vocabulary of 2, scoring token 0: uniform logits give
  log π = −log 2 and H = log 2; logits (log 3, 0) give π = (0.75, 0.25), log π = log 0.75
  and H = −(0.75 log 0.75 + 0.25 log 0.25).

    >>> logits = jnp.array([[0.0, 0.0], [jnp.log(3.0), 0.0]])
    >>> logp, entropy = logprobs_and_entropy(logits, jnp.array([0, 0]))
    >>> import numpy as np  # rounded on the host: the digits are the same on every CPU
    >>> print(np.asarray(logp).round(3), np.asarray(entropy).round(3))
    [-0.693 -0.288] [0.693 0.562]
  """
  check_positive("temperature", temperature)
  logits, tokens, temperature = (jnp.asarray(x) for x in (logits, tokens, temperature))
  check_rank(logits.ndim - 1, tokens=tokens)
  check_same_shape(leading=tokens.ndim, logits=logits, tokens=tokens)
  if temperature.ndim:
    check_same_shape(tokens=tokens, temperature=temperature)
    temperature = temperature[..., None]
  logits = at_least_float32(logits)
  logits = logits / temperature
  top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  exps = jnp.exp(logits - top)  # [..., V]
  total = jnp.sum(exps, axis=-1)
  lse = top[..., 0] + jnp.log(total)
  in_vocab = (tokens >= 0) & (tokens < logits.shape[-1])
  safe = jnp.where(in_vocab, tokens, 0)
  logp = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0] - lse
  logp = jnp.where(in_vocab, logp, jnp.full_like(logp, jnp.nan))
  entropy = jnp.zeros_like(logp)
  if with_entropy:
    # Select before multiplying: 0 · (−inf) would be NaN in the gradient, not only the value.
    z = jnp.where(exps > 0, logits, jnp.zeros_like(logits))
    entropy = lse - jnp.sum(exps * z, axis=-1) / total
  return logp, entropy


def action_log_prob(logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """log π(a) = Σ_t m_t log π(w_t): the sequence log-likelihood (original mode `sum`).

  The PPO ratio exp(Σ Δ) is sharp for long replies. logp_t, mask_t: [T]; returns scalar.

  Example: two tokens of probability 0.5 and a pad slot: log 0.25.

    >>> logp_t = jnp.log(jnp.array([0.5, 0.5, 0.1]))
    >>> print(f"{action_log_prob(logp_t, jnp.array([1, 1, 0])):.3f}")
    -1.386
  """
  check_rank(1, logp_t=logp_t, mask_t=mask_t)
  return masked_sum(logp_t, mask_t)


def action_log_prob_per_token(logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """(1/ℓ) Σ_t m_t log π(w_t) with ℓ = Σ_t m_t (original mode `token`, TWOSOME).

  The ratio exp of its difference is GSPO's length-normalised sequence ratio (Zheng et al.
  2025). The original divided by the last valid index + 1, which is ℓ for a prefix mask.
  logp_t, mask_t: [T]; returns scalar, 0 for an empty action.

  Example: `action_log_prob`'s reply, per token: log 0.5.

    >>> logp_t = jnp.log(jnp.array([0.5, 0.5, 0.1]))
    >>> print(f"{action_log_prob_per_token(logp_t, jnp.array([1, 1, 0])):.3f}")
    -0.693
  """
  check_rank(1, logp_t=logp_t, mask_t=mask_t)
  return masked_mean(logp_t, mask_t)

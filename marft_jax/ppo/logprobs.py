"""Log-probabilities and entropies of actions from per-token logits.

An action is one agent's reply: a run of tokens w_0 … w_{ℓ−1}, selected by a mask over a
padded [T] axis. logits_t[t] is the model's output that scores tokens_t[t] (the caller
aligns them: the logits at sequence position p predict the token at p+1).

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

import chex
import jax
import jax.numpy as jnp

from marft_jax.validation import check_positive
from marft_jax.ppo.masked import masked_mean, masked_sum


def _log_softmax(logits_t: jax.Array, temperature: float) -> jax.Array:
  # bf16 logits are scored in f32: the log-probs feed exp(Δ) ratios, where bf16 rounding
  # would read as a spurious policy change.
  check_positive("temperature", temperature)
  logits_t = jnp.asarray(logits_t)
  logits_t = logits_t.astype(jnp.promote_types(logits_t.dtype, jnp.float32))
  return jax.nn.log_softmax(logits_t / temperature, axis=-1)


def token_logprobs(logits_t: jax.Array, tokens_t: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log π(w_t) = log_softmax(logits_t / τ)[w_t].

  A token id outside [0, V) scores NaN (negative ids do not wrap around): harmless at a
  masked position, since every masked reduction here selects it away, and loud anywhere
  else. So padding may hold −1 or −100.

  Args:
    logits_t: [T, V] logits scoring position t.
    tokens_t: [T] int token ids.
    temperature: τ, the sampling temperature, finite and > 0.
  Returns:
    [T] log-probabilities, at least float32.
  Raises:
    ValueError: temperature ≤ 0, NaN or inf (see the module docstring for τ = 0).
  """
  chex.assert_rank([logits_t, tokens_t], [2, 1])
  chex.assert_equal_shape_prefix([logits_t, tokens_t], 1)
  logp = _log_softmax(logits_t, temperature)
  tokens_t = jnp.asarray(tokens_t)
  in_vocab = (tokens_t >= 0) & (tokens_t < logp.shape[-1])
  safe = jnp.where(in_vocab, tokens_t, 0)
  picked = jnp.take_along_axis(logp, safe[:, None], axis=-1)[:, 0]
  return jnp.where(in_vocab, picked, jnp.full_like(picked, jnp.nan))


def token_entropy(logits_t: jax.Array, temperature: float = 1.0) -> jax.Array:
  """H_t = −Σ_v p_v log p_v with p = softmax(logits_t / τ); [T, V] → [T], at least f32.

  Vocabulary entries with probability 0 (logit −inf) contribute 0, not NaN, to the value
  and to the gradient. Raises ValueError for temperature ≤ 0, NaN or inf.
  """
  chex.assert_rank(logits_t, 2)
  logp = _log_softmax(logits_t, temperature)
  p = jnp.exp(logp)
  # Select before multiplying: 0 · (−inf) would be NaN in the gradient, not only the value.
  return -jnp.sum(p * jnp.where(p > 0, logp, jnp.zeros_like(logp)), axis=-1)


def masked_entropy(logits_t: jax.Array, mask_t: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Mean token entropy over an action, (1/ℓ) Σ_t m_t H_t; 0 for an empty action.

  Logit rows at masked positions are replaced before the softmax, so NaN or inf there
  reaches neither the value nor the gradient.

  Args:
    logits_t: [T, V]. mask_t: [T] non-zero on the action's tokens.
    temperature: τ, finite and > 0 (ValueError otherwise).
  Returns:
    scalar.
  """
  chex.assert_rank([logits_t, mask_t], [2, 1])
  chex.assert_equal_shape_prefix([logits_t, mask_t], 1)
  valid = (jnp.asarray(mask_t) != 0)[:, None]
  logits_t = jnp.where(valid, logits_t, jnp.zeros((), jnp.asarray(logits_t).dtype))
  return masked_mean(token_entropy(logits_t, temperature), mask_t)


def action_log_prob(logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """log π(a) = Σ_t m_t log π(w_t): the sequence log-likelihood (original mode `sum`).

  The PPO ratio exp(Σ Δ) is sharp for long replies. logp_t, mask_t: [T]; returns scalar.
  """
  chex.assert_rank([logp_t, mask_t], 1)
  return masked_sum(logp_t, mask_t)


def action_log_prob_per_token(logp_t: jax.Array, mask_t: jax.Array) -> jax.Array:
  """(1/ℓ) Σ_t m_t log π(w_t) with ℓ = Σ_t m_t (original mode `token`, TWOSOME).

  The original divided by the last valid index + 1, which is ℓ for a prefix mask.
  logp_t, mask_t: [T]; returns scalar, 0 for an empty action.
  """
  chex.assert_rank([logp_t, mask_t], 1)
  return masked_mean(logp_t, mask_t)

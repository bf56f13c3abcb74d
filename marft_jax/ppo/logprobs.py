"""Log-probabilities and entropies of actions from per-token logits.

An action is one agent's reply: a run of tokens w_0 … w_{ℓ−1}, selected by a mask over a
padded [T] axis. logits_t[t] is the model's output that scores tokens_t[t] (the caller
aligns them: the logits at sequence position p predict the token at p+1).

Score at the sampling temperature (reference defect D9: the original sampled at T = 0.5
and scored at T = 1, so its π_old was not the behaviour policy).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from marft_jax.ppo.masked import masked_mean, masked_sum


def _log_softmax(logits_t: jax.Array, temperature: float) -> jax.Array:
  # bf16 logits are scored in f32: the log-probs feed exp(Δ) ratios, where bf16 rounding
  # would read as a spurious policy change.
  logits_t = jnp.asarray(logits_t)
  logits_t = logits_t.astype(jnp.promote_types(logits_t.dtype, jnp.float32))
  return jax.nn.log_softmax(logits_t / temperature, axis=-1)


def token_logprobs(logits_t: jax.Array, tokens_t: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log π(w_t) = log_softmax(logits_t / τ)[w_t].

  Args:
    logits_t: [T, V] logits scoring position t.
    tokens_t: [T] int token ids.
    temperature: τ, the sampling temperature.
  Returns:
    [T] log-probabilities, at least float32.
  """
  chex.assert_rank([logits_t, tokens_t], [2, 1])
  chex.assert_equal_shape_prefix([logits_t, tokens_t], 1)
  logp = _log_softmax(logits_t, temperature)
  return jnp.take_along_axis(logp, tokens_t[:, None], axis=-1)[:, 0]


def token_entropy(logits_t: jax.Array, temperature: float = 1.0) -> jax.Array:
  """H_t = −Σ_v p_v log p_v with p = softmax(logits_t / τ); [T, V] → [T], at least f32.

  Vocabulary entries with probability 0 (logit −inf) contribute 0, not NaN.
  """
  chex.assert_rank(logits_t, 2)
  logp = _log_softmax(logits_t, temperature)
  p = jnp.exp(logp)
  return -jnp.sum(jnp.where(p > 0, p * logp, jnp.zeros_like(p)), axis=-1)


def masked_entropy(logits_t: jax.Array, mask_t: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Mean token entropy over an action, (1/ℓ) Σ_t m_t H_t; 0 for an empty action.

  Args:
    logits_t: [T, V]. mask_t: [T] non-zero on the action's tokens.
  Returns:
    scalar.
  """
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


def action_log_prob_per_word(logp_t: jax.Array, mask_t: jax.Array,
                             num_words: jax.Array | int) -> jax.Array:
  """(1/n_words) Σ_t m_t log π(w_t) (original mode `word`, TWOSOME).

  n_words = len(decode(a).split()) is counted on the host; 0 words is treated as 1, so an
  action of only whitespace keeps its summed log-prob. logp_t, mask_t: [T]; returns scalar.
  """
  chex.assert_rank([logp_t, mask_t], 1)
  return masked_sum(logp_t, mask_t) / jnp.maximum(jnp.asarray(num_words, jnp.float32), 1.0)


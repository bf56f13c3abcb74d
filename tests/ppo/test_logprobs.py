"""Token and action log-probabilities and entropies against NumPy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo

ATOL = 1e-5


def np_log_softmax(row):
  shifted = row - row.max()
  return shifted - np.log(np.exp(shifted).sum())


def np_token_logprobs(logits, tokens, temperature):
  return np.array([np_log_softmax(logits[t] / temperature)[tokens[t]] for t in range(len(tokens))])


def np_token_entropy(logits, temperature):
  out = []
  for row in logits:
    logp = np_log_softmax(row / temperature)
    p = np.exp(logp)
    out.append(-sum(p[v] * logp[v] for v in range(len(row)) if p[v] > 0))
  return np.array(out)


def masks(T):
  """Empty action, single token, full, a prefix, and a mask with a hole."""
  return [np.zeros(T, bool), np.eye(T, dtype=bool)[0], np.ones(T, bool),
          np.arange(T) < T // 2, np.array([1, 0] * (T // 2) + [1] * (T % 2), bool)]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_logprobs_and_entropy_match_numpy(temperature):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 11)).astype(np.float32) * 3
  tokens = rng.integers(0, 11, size=6)
  np.testing.assert_allclose(ppo.token_logprobs(logits, tokens, temperature),
                             np_token_logprobs(logits, tokens, temperature), atol=ATOL)
  np.testing.assert_allclose(ppo.token_entropy(logits, temperature),
                             np_token_entropy(logits, temperature), atol=ATOL)


def test_entropy_of_masked_vocabulary_is_finite():
  # By hand: uniform over the two finite entries, entropy log 2.
  logits = jnp.array([[0.0, 0.0, -jnp.inf, -jnp.inf]])
  np.testing.assert_allclose(ppo.token_entropy(logits), [np.log(2.0)], atol=ATOL)


@pytest.mark.parametrize("mask_index", range(5))
def test_action_log_probs_match_numpy(mask_index):
  rng = np.random.default_rng(mask_index)
  T = 7
  mask = masks(T)[mask_index]
  logp = np.where(mask, -rng.random(T) * 3, rng.normal(size=T) * 1e4)  # garbage in padding
  n_tokens = mask.sum()
  total = sum(logp[t] for t in range(T) if mask[t])
  np.testing.assert_allclose(ppo.action_log_prob(logp, mask), total, atol=1e-4)
  np.testing.assert_allclose(ppo.action_log_prob_per_token(logp, mask),
                             total / n_tokens if n_tokens else 0.0, atol=ATOL)


@pytest.mark.parametrize("mask_index", range(5))
def test_masked_entropy_matches_numpy(mask_index):
  rng = np.random.default_rng(mask_index)
  logits = rng.normal(size=(7, 5)).astype(np.float32)
  mask = masks(7)[mask_index]
  h = np_token_entropy(logits, 1.0)
  expected = h[mask].mean() if mask.any() else 0.0
  np.testing.assert_allclose(ppo.masked_entropy(logits, mask), expected, atol=ATOL)


def test_logprobs_under_jit_and_vmap():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 7, size=(3, 5)))
  mask = jnp.asarray(np.stack(masks(5)[:3]))
  fn = jax.jit(jax.vmap(lambda l, w, m: ppo.action_log_prob(ppo.token_logprobs(l, w, 0.7), m)))
  batched = fn(logits, tokens, mask)
  for b in range(3):
    np.testing.assert_allclose(
        batched[b], ppo.action_log_prob(ppo.token_logprobs(logits[b], tokens[b], 0.7), mask[b]),
        atol=ATOL)

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


def np_logprobs(logits, tokens, temperature):
  return np.array([np_log_softmax(logits[t] / temperature)[tokens[t]] for t in range(len(tokens))])


def np_entropy(logits, temperature):
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


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.5, "per_position"])
def test_logprobs_and_entropy_match_numpy(temperature, jit):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, 11)).astype(np.float32) * 3
  tokens = rng.integers(0, 11, size=6)
  if temperature == "per_position":
    temperature = rng.uniform(0.3, 2.0, 6).astype(np.float32)
  tau = np.broadcast_to(temperature, (6,))
  fn = ppo.logprobs_and_entropy
  if jit:
    fn = jax.jit(fn, static_argnames="with_entropy")
  logp, entropy = fn(logits, tokens, temperature)
  np.testing.assert_allclose(
      logp, [np_logprobs(logits[t:t + 1], tokens[t:t + 1], tau[t])[0] for t in range(6)],
      atol=ATOL)
  np.testing.assert_allclose(
      entropy, [np_entropy(logits[t:t + 1], tau[t])[0] for t in range(6)], atol=ATOL)
  logp_only, zeros = fn(logits, tokens, temperature, with_entropy=False)
  np.testing.assert_array_equal(logp_only, logp)
  np.testing.assert_array_equal(zeros, 0.0)


def test_logprobs_and_entropy_any_leading_shape():
  # [B, P, V] as the trainer calls it: the same numbers as position by position.
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
  tokens, tau = rng.integers(0, 7, (2, 3)), rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
  logp, entropy = ppo.logprobs_and_entropy(logits, tokens, tau)
  for b in range(2):
    for p in range(3):
      np.testing.assert_allclose(logp[b, p], np_log_softmax(logits[b, p] / tau[b, p])[
          tokens[b, p]], atol=ATOL)
      np.testing.assert_allclose(entropy[b, p], np_entropy(logits[b, p][None],
                                                                 tau[b, p])[0], atol=ATOL)


def test_entropy_of_masked_vocabulary_is_finite():
  # By hand: uniform over the two finite entries, entropy log 2; one finite entry, entropy 0.
  logits = jnp.array([[0.0, 0.0, -jnp.inf, -jnp.inf], [1.5, -jnp.inf, -jnp.inf, -jnp.inf]])
  logp, entropy = ppo.logprobs_and_entropy(logits, jnp.array([1, 0]))
  np.testing.assert_allclose(entropy, [np.log(2.0), 0.0], atol=ATOL)
  np.testing.assert_allclose(logp, [-np.log(2.0), 0.0], atol=ATOL)


def test_bfloat16_logits_are_scored_in_float32():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(5, 9)) * 3, jnp.bfloat16)
  tokens = rng.integers(0, 9, 5)
  logp, entropy = ppo.logprobs_and_entropy(logits, tokens, 0.7)
  assert logp.dtype == entropy.dtype == jnp.float32
  exact = np.asarray(logits.astype(jnp.float32))  # the bf16 values, held exactly
  np.testing.assert_allclose(logp, np_logprobs(exact, tokens, 0.7), atol=ATOL)
  np.testing.assert_allclose(entropy, np_entropy(exact, 0.7), atol=ATOL)


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


def test_logprobs_under_jit_and_vmap():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 7, size=(3, 5)))
  mask = jnp.asarray(np.stack(masks(5)[:3]))
  logprobs = lambda l, w: ppo.logprobs_and_entropy(l, w, 0.7, with_entropy=False)[0]
  fn = jax.jit(jax.vmap(lambda l, w, m: ppo.action_log_prob(logprobs(l, w), m)))
  batched = fn(logits, tokens, mask)
  for b in range(3):
    np.testing.assert_allclose(
        batched[b], ppo.action_log_prob(logprobs(logits[b], tokens[b]), mask[b]),
        atol=ATOL)

"""NaN and inf at masked positions reach neither a loss nor its gradient.

Each case computes a function twice: on clean inputs (finite values everywhere) and on the
same inputs with the masked positions overwritten by NaN, +inf and −inf. The value must be
the same, and the gradient must be finite, exactly 0 at masked positions and equal to the
clean gradient elsewhere. Inputs are random draws; only their agreement is tested.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import ppo

T = 7
MASK = np.array([1, 0, 1, 1, 0, 1, 0], bool)  # arbitrary, three masked positions
PADDING = np.array([np.nan, np.inf, -np.inf])


def _pad(x, mask):
  """x with its masked positions (along the leading axes) set to NaN, +inf, −inf in turn."""
  mask = np.broadcast_to(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x.shape)
  garbage = np.resize(PADDING, x.size).reshape(x.shape)
  return np.where(mask, x, garbage).astype(x.dtype)


def _assert_padding_is_inert(fn, clean, padded, mask):
  """fn(*args) -> scalar; the tuples clean and padded differ only where mask is 0.

  Checks the value and the gradient with respect to the first argument.
  """
  value, grad = jax.jit(fn), jax.jit(jax.grad(fn))
  np.testing.assert_allclose(value(*padded), value(*clean), rtol=1e-6, atol=1e-6)
  g_clean, g_padded = (np.asarray(grad(*args)) for args in (clean, padded))
  assert np.all(np.isfinite(g_padded))
  mask = np.broadcast_to(mask.reshape(mask.shape + (1,) * (g_clean.ndim - mask.ndim)),
                         g_clean.shape)
  np.testing.assert_array_equal(g_padded[~mask], 0.0)
  np.testing.assert_allclose(g_padded[mask], g_clean[mask], rtol=1e-6, atol=1e-6)


def _values(seed):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=T).astype(np.float32), rng.normal(size=T).astype(np.float32),
          rng.normal(size=T).astype(np.float32) * 3)


@pytest.mark.parametrize("huber", [False, True])
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_losses_ignore_nan_padding(huber, clip_eps):
  v, old_v, ret = _values(0)
  if huber:
    loss = functools.partial(ppo.clipped_huber_value_loss, delta=1.0, clip_eps=clip_eps)
  else:
    loss = functools.partial(ppo.clipped_value_loss, clip_eps=clip_eps)
  clean = (v, old_v, ret)
  _assert_padding_is_inert(lambda *args: loss(*args, MASK), clean,
                           tuple(_pad(x, MASK) for x in clean), MASK)


def test_value_loss_padding_in_each_input_alone():
  v, old_v, ret = _values(1)
  loss = lambda *args: ppo.clipped_huber_value_loss(*args, MASK, 1.0, 0.2)
  clean = loss(v, old_v, ret)
  for args in [(_pad(v, MASK), old_v, ret), (v, _pad(old_v, MASK), ret),
               (v, old_v, _pad(ret, MASK))]:
    np.testing.assert_allclose(loss(*args), clean, rtol=1e-6)
    grad = jax.jit(jax.grad(loss))(*args)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~MASK] == 0.0)


def _policy(seed):
  rng = np.random.default_rng(seed)
  old = -rng.random(T).astype(np.float32) * 2
  logp = old + rng.normal(size=T).astype(np.float32) * 0.3
  return logp, old, rng.normal(size=T).astype(np.float32)


POLICY_LOSSES = {
    "ppo_clip_loss": lambda lp, old, adv: ppo.ppo_clip_loss(lp, old, adv, MASK, 0.2, 0.28, 3.0),
    "decoupled_ppo_loss": lambda lp, old, adv: ppo.decoupled_ppo_loss(
        lp, old, old - 0.1 * jnp.where(MASK, 1.0, old), adv, MASK, 0.2, imp_weight_cap=5.0),
    "kl_penalty_k2": lambda lp, old, adv: ppo.kl_penalty(lp, old, MASK, ppo.kl_k2),
    "kl_penalty_k3": lambda lp, old, adv: ppo.kl_penalty(lp, old, MASK, ppo.kl_k3),
    "action_log_prob": lambda lp, old, adv: ppo.action_log_prob(lp, MASK),
    "action_log_prob_per_token": lambda lp, old, adv: ppo.action_log_prob_per_token(lp, MASK),
}


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_losses_ignore_nan_padding(name):
  logp, old, adv = _policy(2)
  padded = (_pad(logp, MASK), _pad(old, MASK), _pad(adv, MASK))
  _assert_padding_is_inert(POLICY_LOSSES[name], (logp, old, adv), padded, MASK)


def test_logprobs_and_entropy_rows_are_independent():
  # A NaN or inf logit row (the vocabulary scores of a position never trained) changes only
  # its own position's values.
  logits = np.random.default_rng(4).normal(size=(T, 5)).astype(np.float32)
  tokens, temperature = np.arange(T) % 5, np.full(T, 0.7, np.float32)
  clean = ppo.logprobs_and_entropy(logits, tokens, temperature)
  padded = ppo.logprobs_and_entropy(_pad(logits, MASK), tokens, temperature)
  for c, p in zip(clean, padded):
    np.testing.assert_array_equal(np.asarray(p)[MASK], np.asarray(c)[MASK])


def test_entropy_gradient_with_masked_vocabulary_is_finite():
  # A −inf logit (a vocabulary entry ruled out) has probability 0: no NaN in the gradient,
  # and the gradient on the other entries equals that of the entropy over them alone.
  logits = jnp.array([[0.3, -0.2, -jnp.inf, 1.0]])
  entropy_grad = jax.jit(jax.grad(lambda l: ppo.logprobs_and_entropy(l, np.zeros(1, int))[1]
                                  .sum()))
  grad = entropy_grad(logits)
  assert np.all(np.isfinite(grad))
  alone = entropy_grad(logits[:, [0, 1, 3]])
  np.testing.assert_allclose(np.asarray(grad)[:, [0, 1, 3]], alone, atol=1e-6)
  assert grad[0, 2] == 0.0


def test_logprobs_out_of_vocabulary_is_nan_not_wrapped():
  logits = np.random.default_rng(5).normal(size=(4, 5)).astype(np.float32)
  tokens = np.array([0, -1, 5, -100])
  logp = np.asarray(ppo.logprobs_and_entropy(logits, tokens)[0])
  assert np.isfinite(logp[0]) and np.all(np.isnan(logp[1:]))
  mask = np.array([1, 0, 0, 0])
  np.testing.assert_allclose(ppo.action_log_prob(logp, mask), logp[0])
  grad = jax.grad(lambda l: ppo.action_log_prob(
      ppo.logprobs_and_entropy(l, tokens, with_entropy=False)[0], mask))(logits)
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[1:] == 0.0)


def test_normalisers_ignore_nan_padding():
  x = np.random.default_rng(6).normal(size=T).astype(np.float32)
  groups = np.array([0, 1, 0, 1, 0, 2, 1])  # group 1 has a single valid element
  agents = np.zeros(T, int)  # one agent: the pools are the groups
  weights = np.arange(T, dtype=np.float32)  # a non-trivial scalar function of the output
  for fn in (lambda x_: ppo.normalize(x_, MASK, unbiased=True),
             lambda x_: ppo.agent_group_normalize(x_, MASK, groups, agents, 3, 1),
             lambda x_: ppo.agent_group_normalize(x_, MASK, groups, agents, 3, 1,
                                                  leave_one_out=True)):
    _assert_padding_is_inert(lambda x_: jnp.sum(fn(x_) * weights), (x,),
                             (_pad(x, MASK),), MASK)


def test_normalize_gradient_of_a_constant_pool_is_finite():
  # σ = 0 (one element, or equal elements): sqrt'(0) = inf must not turn into NaN.
  for x in (np.array([2.0], np.float32), np.full(3, 0.5, np.float32)):
    grad = jax.jit(jax.grad(lambda x_: ppo.normalize(x_, np.ones(len(x_), bool)).sum()))(x)
    assert np.all(np.isfinite(grad))


def test_returns_ignore_nan_values_at_masked_positions():
  rng = np.random.default_rng(7)
  r, v = rng.normal(size=T).astype(np.float32), rng.normal(size=T).astype(np.float32)
  weights = np.arange(T, dtype=np.float32)
  fn = lambda v_: ppo.masked_gae(r, np.full(T, 0.9, np.float32), 0.8, v_, MASK, 0.5)
  _assert_padding_is_inert(lambda v_: jnp.sum(fn(v_) * weights), (v,), (_pad(v, MASK),), MASK)
  v3 = rng.normal(size=(2, 2, 3)).astype(np.float32)
  mask3 = np.array([[[1, 1, 0], [1, 0, 0]], [[0, 0, 0], [1, 1, 1]]], bool)
  token_fn = lambda v_: jnp.sum(ppo.token_level_advantages(
      np.ones((2, 2), np.float32), v_, mask3, np.array([0, 1]), 0.2, 0.9, 0.8)[1])
  _assert_padding_is_inert(token_fn, (v3,), (_pad(v3, mask3),), mask3)

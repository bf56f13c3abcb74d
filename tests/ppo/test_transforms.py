"""Every public function of marft_jax.ppo under jax.jit and jax.vmap; loss gradients vs
finite differences."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from marft_jax import ppo

T, N, K, V, G, A = 6, 2, 3, 5, 2, 2


def _f(rng, *shape):
  return rng.normal(size=shape).astype(np.float32)


def _logp(rng, *shape):
  return -rng.random(shape).astype(np.float32) * 2


def _mask(rng, *shape):
  mask = rng.random(shape) < 0.7
  mask.reshape(-1)[0] = True
  return mask


def _step_ids(rng):
  # A hand-built action-frame layout of 3 steps (−1: no decision).
  return np.array([-1, 0, 0, -1, 1, 2])[np.sort(rng.permutation(T))]


def _successors(rng):
  # next_t[t] in (t, T]: a hop may skip positions (parallel branches joining).
  return np.minimum(np.arange(T) + rng.integers(1, 3, T), T).astype(np.int32)


def _turns(rng):
  """T turns: env steps of layers of parallel turns, padding last. Returns step_k, sees_kk
  (`layer_sees`), valid_k, next_k (`turn_successors`), length_k (1–3 positions a real turn,
  0 padding) and layer_k."""
  step, layer = np.zeros(T, np.int32), np.zeros(T, np.int32)
  for k, (new_step, new_layer) in enumerate(rng.random((T, 2)) < [0.3, 0.5]):
    if k:
      step[k] = step[k - 1] + new_step
      layer[k] = 0 if new_step else layer[k - 1] + new_layer
  valid = np.arange(T) < rng.integers(1, T + 1)
  sees = np.asarray(ppo.layer_sees(step, layer, valid))
  next_k = np.asarray(ppo.turn_successors(step, sees, valid))
  return step, sees, valid, next_k, np.where(valid, rng.integers(1, 4, T), 0), layer


def _pick(xs, *indices):
  return tuple(xs[i] for i in indices)


def _chain_args(rng):
  """`turn_chain_advantages`' arrays: v_t over 3T positions, 0 past those the turns fill."""
  step, sees, valid, length = _pick(_turns(rng), 0, 1, 2, 4)
  v = np.where(np.arange(3 * T) < length.sum(), _f(rng, 3 * T), 0.0).astype(np.float32)
  return step, sees, valid, length, _f(rng, T), _f(rng, T), rng.random(T) < 0.3, v


# name -> (function with static arguments bound, example arguments for one instance)
EXAMPLES = {
    "masked_sum": (ppo.masked_sum, lambda r: (_f(r, T), _mask(r, T))),
    "masked_mean": (ppo.masked_mean, lambda r: (_f(r, T), _mask(r, T))),
    "masked_count": (ppo.masked_count, lambda r: (_mask(r, T),)),
    "masked_gae": (ppo.masked_gae, lambda r: (
        _f(r, T), r.random(T).astype(np.float32), r.random(T).astype(np.float32), _f(r, T),
        _mask(r, T), _f(r))),
    "action_level_advantages": (
        functools.partial(ppo.action_level_advantages, gamma=0.9, lambda_=0.8),
        lambda r: (_f(r, T, N), _f(r, T, N), r.random(T) < 0.3, _f(r))),
    "token_level_advantages": (
        functools.partial(ppo.token_level_advantages, gamma=0.9, lambda_=0.8, gamma_token=1.0),
        lambda r: (_f(r, T, N), _f(r, T, N, K), _mask(r, T, N, K), r.random(T) < 0.3, _f(r))),
    "successor_gae": (ppo.successor_gae, lambda r: (
        _f(r, T), r.random(T).astype(np.float32), r.random(T).astype(np.float32), _f(r, T),
        _mask(r, T), _successors(r))),
    "turn_chain_advantages": (
        functools.partial(ppo.turn_chain_advantages, credit="step_discount", gamma=0.9,
                          lambda_=0.8, gamma_agent=0.95, gamma_token=0.9, credit_discount=0.5),
        lambda r: _chain_args(r)),
    "turn_successors": (ppo.turn_successors, lambda r: _turns(r)[:3]),
    "layer_sees": (ppo.layer_sees, lambda r: _pick(_turns(r), 0, 5, 2)),
    "hops_to_sink": (ppo.hops_to_sink, lambda r: _pick(_turns(r), 0, 3)),
    "turn_hops": (functools.partial(ppo.turn_hops, gamma=0.9, lambda_=0.8, gamma_agent=0.95),
                  lambda r: _pick(_turns(r), 0, 3) + (r.random(T) < 0.3,)),
    "expand_turns": (functools.partial(ppo.expand_turns, width=3 * T, gamma_token=0.9),
                     lambda r: (_f(r, T), r.random(T).astype(np.float32),
                                r.random(T).astype(np.float32), *_turns(r)[3:5])),
    "token_to_action_frame": (lambda x: ppo.token_to_action_frame(x, -1),
                              lambda r: (_step_ids(r),)),
    "turn_credit": (functools.partial(ppo.turn_credit, credit="step_discount", gamma_c=0.5),
                    lambda r: (_f(r, T), _f(r, T), *_pick(_turns(r), 0, 3, 2))),
    "logprobs_and_entropy": (ppo.logprobs_and_entropy, lambda r: (
        _f(r, T, V), r.integers(0, V, T), r.uniform(0.5, 2.0, T).astype(np.float32))),
    "action_log_prob": (ppo.action_log_prob, lambda r: (_logp(r, T), _mask(r, T))),
    "action_log_prob_per_token": (ppo.action_log_prob_per_token,
                                  lambda r: (_logp(r, T), _mask(r, T))),
    "clipped_surrogate": (functools.partial(ppo.clipped_surrogate, epsilon=0.2, dual_clip=3.0),
                          lambda r: (np.exp(_f(r, T) * 0.3), _f(r, T))),
    "ppo_clip_loss": (functools.partial(ppo.ppo_clip_loss, epsilon=0.2, epsilon_high=0.28),
                      lambda r: (_logp(r, T), _logp(r, T), _f(r, T), _mask(r, T))),
    "decoupled_ppo_loss": (
        functools.partial(ppo.decoupled_ppo_loss, epsilon=0.2, imp_weight_cap=2.0),
        lambda r: (_logp(r, T), _logp(r, T), _logp(r, T), _f(r, T), _mask(r, T))),
    "importance_weights": (functools.partial(ppo.importance_weights, imp_weight_cap=1.5),
                           lambda r: (_logp(r, T), _logp(r, T), _mask(r, T))),
    "clip_fraction": (functools.partial(ppo.clip_fraction, epsilon=0.2),
                      lambda r: (_logp(r, T), _logp(r, T), _mask(r, T))),
    "huber_loss": (functools.partial(ppo.huber_loss, delta=1.0), lambda r: (_f(r, T) * 3,)),
    "clipped_value_loss": (functools.partial(ppo.clipped_value_loss, clip_eps=0.2),
                           lambda r: (_f(r, T), _f(r, T), _f(r, T), _mask(r, T))),
    "clipped_huber_value_loss": (
        functools.partial(ppo.clipped_huber_value_loss, delta=1.0, clip_eps=0.2),
        lambda r: (_f(r, T), _f(r, T), _f(r, T) * 3, _mask(r, T))),
    "kl_k1": (ppo.kl_k1, lambda r: (_logp(r, T), _logp(r, T))),
    "kl_k2": (ppo.kl_k2, lambda r: (_logp(r, T), _logp(r, T))),
    "kl_k3": (ppo.kl_k3, lambda r: (_logp(r, T), _logp(r, T))),
    "kl_penalty": (ppo.kl_penalty, lambda r: (_logp(r, T), _logp(r, T), _mask(r, T))),
    "kl_reward": (functools.partial(ppo.kl_reward, kl_coef=0.1, estimator=ppo.kl_k1),
                  lambda r: (_logp(r, T), _logp(r, T), _mask(r, T))),
    "approx_kl": (ppo.approx_kl, lambda r: (_logp(r, T), _logp(r, T), _mask(r, T))),
    "shape_rewards": (functools.partial(ppo.shape_rewards, scale=2.0, bias=-0.5, clip=1.0),
                      lambda r: (_f(r, T),)),
    "normalize": (functools.partial(ppo.normalize, unbiased=True),
                  lambda r: (_f(r, T), _mask(r, T))),
    "agent_group_normalize": (
        functools.partial(ppo.agent_group_normalize, num_groups=G, num_agents=A),
        lambda r: (_f(r, T), _mask(r, T), r.integers(0, G, T), r.integers(0, A, T))),
}


def test_every_public_function_is_covered():
  public = {name for name, obj in vars(ppo).items()
            if inspect.isfunction(obj) and not name.startswith("_")}
  assert public == set(EXAMPLES)


def _assert_trees_close(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), a, b)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_jit_and_vmap(name):
  fn, make_args = EXAMPLES[name]
  rng = np.random.default_rng(0)
  instances = [make_args(rng) for _ in range(2)]
  jitted = jax.jit(fn)
  _assert_trees_close(jitted(*instances[0]), fn(*instances[0]))
  stacked = [np.stack(column) for column in zip(*instances)]
  batched = jax.jit(jax.vmap(fn))(*stacked)
  for b, args in enumerate(instances):
    _assert_trees_close(jax.tree.map(lambda x: x[b], batched), jitted(*args))


# --- Gradients against finite differences (float64, inputs away from the clip kinks) ----------

def _away_from(x, kinks, margin=0.02):
  for kink in kinks:
    x = np.where(np.abs(x - kink) < margin, kink + margin * np.sign(x - kink + 1e-12), x)
  return x


def _policy_inputs(rng):
  old = -rng.random(T) * 2
  # Kinks of the clip at 1 ± 0.2 and 1 + ε_high = 1.28 (the losses below).
  ratio = _away_from(np.exp(rng.normal(size=T) * 0.4), [0.8, 1.2, 1.28])
  adv = _away_from(rng.normal(size=T), [0.0])
  return old + np.log(ratio), old, adv, np.array([1, 1, 0, 1, 1, 1], bool)  # one masked


LOSSES = {
    "ppo_clip_loss": lambda lp, old, adv, m: ppo.ppo_clip_loss(lp, old, adv, m, 0.2, 0.28),
    "ppo_dual_clip": lambda lp, old, adv, m: ppo.ppo_clip_loss(lp, old, adv, m, 0.2,
                                                               dual_clip=1.1),
    "decoupled_ppo_loss": lambda lp, old, adv, m: ppo.decoupled_ppo_loss(
        lp, old, old + 0.1, adv, m, 0.2, imp_weight_cap=5.0),
    "gspo": lambda lp, old, adv, m: ppo.ppo_clip_loss(  # loss.action_logprob="mean"
        ppo.action_log_prob_per_token(lp, m), ppo.action_log_prob_per_token(old, m), adv[0],
        jnp.ones((), bool), 0.2),
    "kl_penalty_k2": lambda lp, old, adv, m: ppo.kl_penalty(lp, old, m, ppo.kl_k2),
    "kl_penalty_k3": lambda lp, old, adv, m: ppo.kl_penalty(lp, old, m, ppo.kl_k3),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_policy_loss_gradients_match_finite_differences(name):
  with jax.enable_x64(True):
    logp, old, adv, mask = _policy_inputs(np.random.default_rng(1))
    loss = functools.partial(LOSSES[name], old=jnp.asarray(old), adv=jnp.asarray(adv),
                             m=jnp.asarray(mask))
    check_grads(lambda lp: loss(lp), (jnp.asarray(logp),), order=1, modes=("rev",),
                eps=1e-6, atol=1e-6, rtol=1e-6)
    assert np.all(np.asarray(jax.grad(loss)(jnp.asarray(logp)))[~mask] == 0.0)


@pytest.mark.parametrize("huber", [False, True])
def test_value_loss_gradients_match_finite_differences(huber):
  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    old_v = rng.normal(size=T)
    v = old_v + _away_from(rng.normal(size=T) * 0.4, [-0.2, 0.2])
    ret = v + _away_from(rng.normal(size=T) * 2, [-1.0, 0.0, 1.0], margin=0.05)
    mask = jnp.asarray(np.array([1, 0, 1, 1, 1, 1], bool))
    if huber:
      loss = lambda v_: ppo.clipped_huber_value_loss(v_, old_v, ret, mask, 1.0, 0.2)
    else:
      loss = lambda v_: ppo.clipped_value_loss(v_, old_v, ret, mask, 0.2)
    check_grads(loss, (jnp.asarray(v),), order=1, modes=("rev",), eps=1e-6, atol=1e-6,
                rtol=1e-6)


def test_logprob_and_entropy_gradients_match_finite_differences():
  # The max subtracted inside carries no gradient; the exact gradient must not need it.
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(T, V)))
    tokens, temperature = rng.integers(0, V, T), jnp.asarray(rng.uniform(0.5, 2.0, T))
    mask = jnp.asarray(np.array([1, 1, 0, 1, 0, 1], bool))
    for part in (0, 1):  # log-prob of the sampled token, entropy bonus
      check_grads(lambda l: ppo.masked_mean(
          ppo.logprobs_and_entropy(l, tokens, temperature)[part], mask), (logits,), order=1,
                  modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)

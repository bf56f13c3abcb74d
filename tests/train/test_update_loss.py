"""The update's loss settings: each key of `LossConfig` that picks a formula (behaviour
correction and its weight cap, dual clip, KL estimator) changes the loss exactly as a plain
NumPy transcription of the formula says, at both policy levels; bad values are refused by name.

References: NumPy loops over the learner's own log-probs (`token_logp_and_entropy`, tested
against the model's logits in test_token_logp.py), written from AReaL's decoupled PPO
(../shared/reference/marft-areal.md §6.2), the dual clip of Ye et al. 2020 and Schulman's
k1/k2/k3.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.train.batching import TrainBatch, act_positions, padding_fields
from marft_jax.train.update import (Extras, LossConfig, check_untruncated_sampling, losses,
                                    resolve_behaviour_correction, token_logp_and_entropy)
from tests.train.nonzero_adapters import nonzero_adapters

B, PROMPT, REPLY = 4, 5, 6
T = PROMPT + REPLY


@pytest.fixture(scope="module")
def setup():
  """Tiny model, nonzero adapters (two agents), a two-turn-per-row batch, and [B, T]
  log-probs: the learner's, a π_old off by up to ±0.5 nats, a sampler's off by up to ±1.5."""
  config = tiny_config()
  params = transformer.init_params(config, jax.random.key(0), std=0.2)
  policy = nonzero_adapters(config)
  rng = np.random.default_rng(0)
  f = padding_fields(B, T, 2, 0, pad_id=0)
  f["tokens"] = rng.integers(1, config.vocab_size, (B, T)).astype(np.int32)
  f["mask"][:] = np.arange(T) < np.array([T, T, T - 2, T])[:, None]
  f["adapter_ids"] = (np.arange(B) % 2).astype(np.int32)  # per row
  # Two turns a row: decisions PROMPT-1 .. PROMPT+1 (turn 0) and PROMPT+3 .. (turn 1).
  turn = np.full((B, T), -1, np.int32)
  turn[:, PROMPT - 1:PROMPT + 2] = 0
  turn[:, PROMPT + 3:T - 1] = 1
  turn[~np.roll(f["mask"], -1, axis=1) | ~f["mask"]] = -1  # row 2 ends early
  f["act_turn"], f["act_mask"] = turn, turn >= 0
  f["act_agent"] = np.where(turn >= 0, f["adapter_ids"][:, None], -1).astype(np.int32)
  f["act_temperature"][:] = 0.8
  f["act_positions"] = act_positions(f["act_mask"])
  f["turn_length"] = np.stack([(turn == k).sum(1) for k in (0, 1)], 1).astype(np.int32)
  f["turn_valid"] = f["turn_length"] > 0  # row 2's second turn is cut off: no token
  f["turn_agent"][:] = f["adapter_ids"][:, None]
  f["act_advantage"] = rng.normal(size=(B, T)).astype(np.float32)
  f["turn_advantage"] = rng.normal(size=(B, 2)).astype(np.float32)
  batch = TrainBatch(**f)
  logp = np.asarray(token_logp_and_entropy(params, policy, batch, config, False)[0])
  m = f["act_mask"]
  old = np.where(m, logp + rng.uniform(-0.5, 0.5, (B, T)), 0).astype(np.float32)
  # Row 0's sampler 1.5 nats below π_old: its weights are about e^1.5.
  off = rng.uniform(-1.5, 1.5, (B, T)) - 1.5 * (np.arange(B) == 0)[:, None]
  behav = np.where(m, old + off, 0).astype(np.float32)
  batch = batch.replace(act_behaviour_logp=behav)
  ref = np.where(m, logp + rng.uniform(-1, 1, (B, T)), 0).astype(np.float32)
  extras = Extras(old_logp=jnp.asarray(old), ref_logp=jnp.asarray(ref), critic_hidden=None)
  return dict(config=config, params=params, policy=policy, batch=batch, extras=extras,
              logp=logp.astype(np.float64))


def _loss(setup, jit, **keys):
  loss_config = LossConfig(**{"behaviour_correction": "off", "policy_level": "token", **keys})
  fn = lambda policy, batch, extras: losses(policy, None, setup["params"], batch, extras,
                                            model_config=setup["config"], config=loss_config,
                                            critic_values=None)
  fn = jax.jit(fn) if jit else fn
  total, aux = fn(setup["policy"], setup["batch"], setup["extras"])
  return float(total), {k: float(v) for k, v in aux.items()}


def _numpy_policy_loss(setup, level="token", action_logprob="sum", correct=False, cap=None,
                       dual=None, eps=0.2):
  """The decoupled / plain PPO loss, element by element."""
  b = setup["batch"]
  logp, old, behav = setup["logp"], np.asarray(setup["extras"].old_logp, np.float64), \
      np.asarray(b.act_behaviour_logp, np.float64)
  elements = []  # (log π_θ, log π_prox, log π_behav, A)
  for r in range(B):
    if level == "token":
      for t in np.flatnonzero(b.act_mask[r]):
        elements.append((logp[r, t], old[r, t], behav[r, t], b.act_advantage[r, t]))
    else:
      for k in np.flatnonzero(b.turn_valid[r]):
        at = b.act_turn[r] == k
        agg = (lambda x: x[r, at].mean()) if action_logprob == "mean" else \
            (lambda x: x[r, at].sum())
        elements.append((agg(logp), agg(old), agg(behav), b.turn_advantage[r, k]))
  total = 0.0
  for new, prox, beh, a in elements:
    ratio = np.exp(new - prox)
    loss = max(-a * ratio, -a * np.clip(ratio, 1 - eps, 1 + eps))
    if dual is not None and a < 0:
      loss = min(loss, -dual * a)
    if correct:
      w = np.exp(prox - beh)
      loss = 0.0 if cap is not None and w > cap else w * loss
    total += loss
  return total / len(elements)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("level, action_logprob", [("token", "sum"), ("action", "sum"),
                                                   ("action", "mean")])
def test_policy_loss_equals_numpy_with_and_without_the_behaviour_correction(
    setup, jit, level, action_logprob):
  keys = dict(policy_level=level, action_logprob=action_logprob)
  results = {}
  for correction, cap in (("off", 2.0), ("on", None), ("on", 2.0)):
    total, aux = _loss(setup, jit, behaviour_correction=correction, imp_weight_cap=cap, **keys)
    want = _numpy_policy_loss(setup, level, action_logprob, correction == "on", cap)
    np.testing.assert_allclose(aux["policy_loss"], want, rtol=2e-5, atol=1e-6)
    assert total == aux["policy_loss"]  # no entropy bonus, KL or critic here
    results[correction, cap] = total
  # Each key changes the loss: row 0's weights (about e^1.5) pass the cap of 2.
  assert len({round(v, 6) for v in results.values()}) == 3, results


def test_the_cap_drops_elements_rather_than_clipping_them(setup):
  """A cap below every weight drops every element: the loss is 0 (AReaL masks them out).
  The sampler's log-probs 10 nats below π_old: every weight is above e^8.5."""
  m = setup["batch"].act_mask
  far = setup["batch"].replace(act_behaviour_logp=np.where(
      m, np.asarray(setup["extras"].old_logp) - 10.0, 0.0).astype(np.float32))
  total, _ = _loss(dict(setup, batch=far), False, behaviour_correction="on",
                   imp_weight_cap=5.0)
  assert total == 0.0
  kept, _ = _loss(dict(setup, batch=far), False, behaviour_correction="on", imp_weight_cap=None)
  assert kept != 0.0


@pytest.mark.parametrize("level", ["token", "action"])
def test_dual_clip_bounds_negative_advantage_losses_as_numpy(setup, level):
  # π_old 3 nats below π_θ: ratios ≈ e^3, so −A·ρ ≫ −c·A where A < 0.
  batch, extras = setup["batch"], setup["extras"]
  shifted = dict(setup, extras=extras.replace(old_logp=jnp.asarray(
      np.where(batch.act_mask, setup["logp"] - 3.0, 0.0), jnp.float32)))
  plain, _ = _loss(shifted, False, policy_level=level)
  dual, _ = _loss(shifted, False, policy_level=level, dual_clip=3.0)
  np.testing.assert_allclose(plain, _numpy_policy_loss(shifted, level), rtol=2e-5)
  np.testing.assert_allclose(dual, _numpy_policy_loss(shifted, level, dual=3.0), rtol=2e-5)
  assert dual < plain - 0.1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_picks_the_penalty_as_numpy(setup, estimator):
  m = setup["batch"].act_mask
  d = setup["logp"] - np.asarray(setup["extras"].ref_logp, np.float64)  # log π − log π_ref
  k = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.expm1(-d) + d}[estimator]
  want = k[m].mean()
  total, aux = _loss(setup, False, kl_coef=0.5, kl_estimator=estimator)
  no_kl, _ = _loss(setup, False)
  np.testing.assert_allclose(aux["kl_to_base"], want, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(total, no_kl + 0.5 * want, rtol=2e-5, atol=1e-6)


def test_the_kl_estimators_give_different_penalties(setup):
  values = {e: _loss(setup, False, kl_coef=0.5, kl_estimator=e)[1]["kl_to_base"]
            for e in ("k1", "k2", "k3")}
  assert len({round(v, 6) for v in values.values()}) == 3, values


@pytest.mark.parametrize("key, value, words", [
    ("behaviour_correction", "yes", "behaviour_correction='yes'"),
    ("imp_weight_cap", 0.0, "imp_weight_cap=0.0"),
    ("imp_weight_cap", 0.5, "imp_weight_cap=0.5: must be >= 1"),  # drops on-policy tokens
    ("imp_weight_cap", float("nan"), "imp_weight_cap=nan"),
    ("value_clip", -0.1, "value_clip=-0.1: must be >= 0"),
    ("huber_delta", 0.0, "huber_delta=0.0: must be > 0"),
    ("kl_limit", 0.0, "kl_limit=0.0: must be > 0"),
    ("dual_clip", 1.0, "dual_clip=1.0"),
    ("dual_clip", 0.5, "dual_clip=0.5"),
    ("kl_estimator", "k4", "kl_estimator='k4'"),
])
def test_bad_values_are_refused_by_name(key, value, words):
  with pytest.raises(ValueError, match=words.replace("(", r"\(")):
    LossConfig(**{key: value})


@pytest.mark.parametrize("setting, dtype, want", [
    ("auto", "bfloat16", "on"), ("auto", "float32", "off"), ("on", "float32", "on"),
    ("off", "bfloat16", "off")])
def test_auto_correction_is_on_for_bfloat16_models(setting, dtype, want):
  config = LossConfig(behaviour_correction=setting)
  resolved = resolve_behaviour_correction(config, dtype, top_p=1.0, top_k=0)
  assert resolved == dataclasses.replace(config, behaviour_correction=want)


@pytest.mark.parametrize("top_p, top_k, words", [(0.9, 0, "team.top_p=0.9"),
                                                 (1.0, 40, "team.top_k=40")])
def test_truncated_sampling_is_refused_for_training(top_p, top_k, words):
  with pytest.raises(ValueError, match=words):
    check_untruncated_sampling(top_p, top_k)
  with pytest.raises(ValueError, match=words):
    resolve_behaviour_correction(LossConfig(), "float32", top_p=top_p, top_k=top_k)


def test_an_unresolved_auto_is_refused_by_the_loss(setup):
  with pytest.raises(ValueError, match="resolve_behaviour_correction"):
    _loss(setup, False, behaviour_correction="auto")

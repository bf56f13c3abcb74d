"""π_old from the rollout (`LossConfig.old_logp`): the sampler's recorded log-probs instead of
a second forward of the learner, where the two are the same numbers to rounding.

The batch is `test_update_behaviour`'s: the tiny model samples (decoding layout, float32,
temperature 0.7) and the update trains on those tokens. References: the learner's own
forward (`old_logp="recompute"`, what every update ran before the key existed) and the gap
measured here between it and the sampler's log-probs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.train import algorithms
from marft_jax.train.config import ModelSection, TrainConfig
from marft_jax.train.update import LossConfig, TrainState, prepare, resolve_old_logp
from tests.train.test_update_behaviour import OPTIMIZER, compiled_update, sampled

# The largest |sampler − learner| log-prob over the sampled batch's trained tokens, measured
# on CPU f32 (`test_the_sampler_and_learner_gap_is_rounding`): 5.3e-6 nats here; SmolLM2-135M
# in the default run records about 1e-4 (docs/default_run, logp/sampler_learner_max_gap).
GAP_BOUND = 2e-5


def _first_update(old_logp: str, level: str):
  """(extras, metrics) of one epoch of the update (2 minibatches) with π_old `old_logp`."""
  config, params, policy, batch = sampled("float32")
  loss = LossConfig(policy_level=level, behaviour_correction="off", old_logp=old_logp)
  extras = prepare(params, policy, batch, config, loss, minibatches=2)
  state = TrainState(policy=policy, critic=None, policy_opt=OPTIMIZER.init(policy),
                     critic_opt=None, step=jnp.zeros((), jnp.int32))
  # The update never reads old_logp (only `prepare` does): one compile serves both.
  update = compiled_update("float32", dataclasses.replace(loss, old_logp="auto"), 2)
  _, metrics = update(state, params, batch, extras, jnp.ones((2,), bool), jnp.asarray(True),
                      jax.random.key(3))
  return extras, {k: float(v) for k, v in metrics.items()}


def test_the_sampler_and_learner_gap_is_rounding():
  extras, _ = _first_update("recompute", "token")
  batch = sampled("float32")[3]
  m = np.asarray(batch.act_mask)
  gap = np.abs(np.asarray(extras.old_logp) - np.asarray(batch.act_behaviour_logp))[m]
  print(f"sampler_learner_max_gap={gap.max():.3g}")
  assert 0 < gap.max() < GAP_BOUND, gap.max()


@pytest.mark.parametrize("level", ["token", "action"])
def test_rollout_old_logp_is_the_samplers_and_the_first_update_agrees(level):
  batch = sampled("float32")[3]
  m = np.asarray(batch.act_mask)
  rollout, on = _first_update("rollout", level)
  recompute, off = _first_update("recompute", level)
  # No forward: π_old is the sampler's record at the trained decisions, 0 elsewhere (as the
  # learner's forward leaves it).
  np.testing.assert_array_equal(np.asarray(rollout.old_logp),
                                np.where(m, np.asarray(batch.act_behaviour_logp), 0.0))
  np.testing.assert_array_equal(np.asarray(recompute.old_logp)[~m], 0.0)
  # The same update to the gap: each ratio moves by at most exp(gap per element) − 1, where
  # an element is a token or a turn (at most T tokens); the losses weigh ratios by |A|.
  per_element = GAP_BOUND * (1 if level == "token" else batch.act_mask.shape[1])
  adv = np.abs(np.asarray(batch.act_advantage if level == "token" else batch.turn_advantage))
  # Metrics averaged over the update's steps scale with their own size (approx_kl reaches
  # 1e6 at the action level, at this test's learning rate): relative to it, and to |A|.
  for key in ("policy_loss", "loss", "approx_kl", "first_ratio_max_dev"):
    np.testing.assert_allclose(on[key], off[key], rtol=2 * per_element,
                               atol=2 * per_element * max(adv.max(), 1), err_msg=key)
  assert on["clip_fraction"] == off["clip_fraction"]
  # ... but not the same numbers: the key changes what the update computes.
  assert on["policy_loss"] != off["policy_loss"]
  # π_old from the sampler: its first ratio to the sampler is the clipped ratio.
  assert on["first_ratio_max_dev"] == on["behaviour/first_ratio_max_dev"]
  assert off["first_ratio_max_dev"] < on["first_ratio_max_dev"]


def _resolved(**changes) -> LossConfig:
  model = {k: changes.pop(k) for k in ("param_dtype", "matmul_precision") if k in changes}
  config = TrainConfig(model=ModelSection(**model), loss=LossConfig(**changes))
  return algorithms.resolve(config).loss


def test_auto_reads_the_rollout_only_where_sampler_and_learner_compute_the_same_numbers():
  assert _resolved().old_logp == "rollout"  # float32, exact f32 matmuls, no correction
  assert _resolved(matmul_precision="highest").old_logp == "rollout"
  for changes in (dict(param_dtype="bfloat16"), dict(matmul_precision="default"),
                  dict(matmul_precision="high"), dict(behaviour_correction="on")):
    assert _resolved(**changes).old_logp == "recompute", changes
  # An explicit choice is kept, ...
  assert _resolved(old_logp="recompute").old_logp == "recompute"
  assert _resolved(param_dtype="bfloat16", behaviour_correction="off",
                   old_logp="rollout").old_logp == "rollout"
  # ... except the one that would make the behaviour correction a no-op (every weight 1).
  for changes in (dict(behaviour_correction="on"), dict(param_dtype="bfloat16")):
    with pytest.raises(ValueError, match="old_logp='rollout' with loss.behaviour_correction"):
      _resolved(old_logp="rollout", **changes)
  with pytest.raises(ValueError, match="old_logp='both'"):
    LossConfig(old_logp="both")
  with pytest.raises(ValueError, match="behaviour_correction first"):
    resolve_old_logp(LossConfig(), "float32", "auto")

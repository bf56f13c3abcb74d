"""Asynchronous rollouts (`rollout.max_staleness`, train/async_rollout.py).

The schedule, without a model: whatever the timing of the sampler and the learner, iteration
k samples with exactly version max(k − η, 0), the sampler starts k at most η iterations
before the learner takes it,
and a checkpoint's cursor and versions are those of the last trained iteration (reference: the
definition, checked under seeded random delays). The trainer on the tiny model: the same bits
whichever side is slow, a kill -9 then resume that equals an uninterrupted run, η = 1 learning
the echo task, and the sampler on its own sub-mesh of the 8 virtual devices.
"""

import dataclasses
import random
import threading
import time

import jax
import numpy as np
import pytest

from marft_jax.train import algorithms
from marft_jax.train import async_rollout
from marft_jax.train import config as config_lib
from marft_jax.train.config import RolloutSection, TrainConfig

# --- the schedule, with a fake sampler and learner ------------------------------------------


class _Envs:
  """The environments' data cursor: how many rollouts were played."""

  def __init__(self, played=0):
    self.played = played

  def state_dict(self):
    return {"episodes": [self.played]}


def _drive(eta, start, end, delays, *, learner_check=None):
  """Runs the engine over iterations [start, end) with `delays[k]` = (sampler's, learner's)
  seconds at iteration k; the "adapters" of version j are the int j. Returns, per iteration,
  the version it sampled with, the rollouts produced but not yet taken when it was played, and
  the checkpoint's cursor and versions after it."""
  envs = _Envs(played=start)
  seen = {}
  ahead = []
  taken = [start]  # the next iteration the learner takes

  def play(k, policy, version):
    assert policy == version  # the adapters of the version it says
    ahead.append(k - taken[0])
    time.sleep(delays[k][0])
    envs.played += 1
    return ("episodes of", k), {"shaped": k}

  behind = tuple(async_rollout.rollout_version(start + i, eta) for i in range(eta))
  versions = async_rollout.initial_versions(start, start, eta, behind if start else None)
  with async_rollout.AsyncRollouts(play, envs, eta, start, end, versions) as rollouts:
    for k in range(start, end):
      result, shaped, metrics = rollouts.take(k)
      taken[0] = k + 1
      assert result == ("episodes of", k) and shaped == {"shaped": k}
      time.sleep(delays[k][1])
      rollouts.publish(k + 1, k + 1)  # the learner's update k: version k + 1
      seen[k] = (metrics["async/policy_version"], metrics["async/version_gap"],
                 rollouts.cursor(k + 1), rollouts.behind(k + 1))
  return seen, ahead


@pytest.mark.parametrize("seed", range(6))
def test_each_iteration_samples_exactly_version_k_minus_eta_whatever_the_timing(seed):
  """Seeded random η, start (a resume) and delays on both sides (either may be the slow one)."""
  rng = random.Random(seed)
  eta, start = rng.randint(1, 3), rng.choice([0, 0, 2, 5])
  end = start + 6
  slow = rng.choice(["sampler", "learner", "both"])
  delays = {k: (rng.uniform(0, 0.01) * (slow != "learner"),
                rng.uniform(0, 0.01) * (slow != "sampler")) for k in range(end)}
  seen, ahead = _drive(eta, start, end, delays)
  for k, (version, gap, cursor, behind) in seen.items():
    assert version == max(k - eta, 0) and gap == k - version <= eta
    assert cursor == {"episodes": [k + 1]}  # after iteration k's rollout, not the sampler's
    assert behind == tuple(max(k + 1 - eta + i, 0) for i in range(eta))
  assert max(ahead) <= eta, ahead  # k starts once the learner took k − η − 1


def test_a_fast_learner_does_not_make_the_samples_fresher():
  """The learner publishes versions faster than the sampler plays: the sampler still takes
  version k − η (a freshest-version sampler would take k − 1 here)."""
  delays = {k: (0.02, 0.0) for k in range(6)}
  seen, _ = _drive(2, 0, 6, delays)
  assert [v for v, *_ in seen.values()] == [0, 0, 0, 1, 2, 3]


def test_a_failing_rollout_is_raised_in_the_learner_and_stops_the_thread():
  def play(k, policy, version):
    if k == 1:
      raise ZeroDivisionError("the environment broke")
    return k, {}

  with pytest.raises(RuntimeError, match="iteration 1") as info:
    with async_rollout.AsyncRollouts(play, _Envs(), 1, 0, 4, {0: 0}) as rollouts:
      rollouts.take(0)
      rollouts.publish(1, 1)
      rollouts.take(1)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  assert not [t for t in threading.enumerate() if t.name == "marft-sampler"]


def test_leaving_early_stops_a_sampler_waiting_for_a_version():
  rollouts = async_rollout.AsyncRollouts(lambda k, p, v: (k, {}), _Envs(), 1, 0, 5, {0: 0})
  with rollouts:
    rollouts.take(0)  # iteration 2 waits for version 1, never published
  assert not rollouts._thread.is_alive()


# --- the config ---------------------------------------------------------------------------------


def _async(**loss):
  base = TrainConfig()
  return TrainConfig(rollout=RolloutSection(max_staleness=1),
                     loss=dataclasses.replace(base.loss, **loss))


def test_eta_turns_the_correction_on_and_refuses_what_contradicts_it():
  resolved = algorithms.resolve(_async())
  assert (resolved.loss.behaviour_correction, resolved.loss.old_logp) == ("on", "recompute")
  synchronous = algorithms.resolve(TrainConfig())  # f32 on CPU: unchanged by the key
  assert (synchronous.loss.behaviour_correction, synchronous.loss.old_logp) == ("off",
                                                                                "rollout")
  with pytest.raises(ValueError, match=r"loss\.behaviour_correction='off'.*"
                                       r"rollout\.max_staleness=1"):
    algorithms.resolve(_async(behaviour_correction="off"))
  with pytest.raises(ValueError, match=r"loss\.old_logp='rollout'.*rollout\.max_staleness=1"):
    algorithms.resolve(_async(old_logp="rollout"))
  with pytest.raises(ValueError, match=r"mesh\.sampler_devices=2 is read with "
                                       r"rollout\.max_staleness >= 1"):
    algorithms.resolve(TrainConfig(mesh=config_lib.MeshSection(sampler_devices=2)))
  with pytest.raises(ValueError, match=r"rollout\.max_staleness=1: asynchronous rollouts run "
                                       r"in a single process"):
    config_lib.check_processes(resolved, (2, 1, 1), 2)
  with pytest.raises(ValueError, match=r"max_staleness=-1"):
    RolloutSection(max_staleness=-1)


def test_the_sampler_devices_are_the_last_ones_and_the_learner_keeps_the_rest():
  assert jax.device_count() == 8
  config = TrainConfig(rollout=RolloutSection(max_staleness=1),
                       mesh=config_lib.MeshSection(data=-1, sampler_devices=2))
  learner, sampler = async_rollout.meshes(config)
  assert list(learner.devices.flat) == jax.devices()[:6] and learner.shape["data"] == 6
  assert list(sampler.devices.flat) == jax.devices()[6:] and sampler.shape["data"] == 2
  one, none = async_rollout.meshes(TrainConfig())
  assert none is None and list(one.devices.flat) == jax.devices()[:1]
  with pytest.raises(ValueError, match=r"mesh\.sampler_devices=8: leaves none"):
    async_rollout.meshes(dataclasses.replace(config, mesh=config_lib.MeshSection(
        sampler_devices=8)))

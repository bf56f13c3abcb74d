"""Asynchronous rollouts (`rollout.max_staleness`, train/async_rollout.py).

The schedule, without a model: whatever the timing of the sampler and the learner, iteration
k samples with exactly version max(k − η, 0), the sampler starts k at most η iterations
before the learner takes it,
and a checkpoint's cursor and versions are those of the last trained iteration (reference: the
definition, checked under seeded random delays). The trainer on the tiny model: the same bits
whichever side is slow, a kill -9 then resume that equals an uninterrupted run, η = 1 learning
the echo task, and the sampler on its own sub-mesh of the 8 virtual devices.
"""

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from marft_jax import rollout as rollout_lib
from marft_jax.train import algorithms
from marft_jax.train.build import preflight
from marft_jax.train import run as run_lib
from marft_jax.train import async_rollout
from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import config as config_lib
from marft_jax.train import loop
from marft_jax.train.config import RolloutSection, TrainConfig
from tests.train.echo_config import echo_config, tiny_trainer_model

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

  def play(k, policy, version, cancel):
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
  def play(k, policy, version, cancel):
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
  rollouts = async_rollout.AsyncRollouts(lambda k, p, v, c: (k, {}), _Envs(), 1, 0, 5, {0: 0})
  with rollouts:
    rollouts.take(0)  # iteration 2 waits for version 1, never published
  assert not rollouts._thread.is_alive()


def test_leaving_cancels_the_rollout_in_flight_without_an_error():
  """The rollout of iteration 1 plays until its `cancel` event is set (as `rollout` stops
  between sampler calls): leaving sets it, and the thread ends at once, with no error to
  raise; without the cancel, leaving would wait out the whole rollout (here 60 s)."""
  started, stopped = threading.Event(), []

  def play(k, policy, version, cancel):
    if k == 0:
      return k, {}
    started.set()
    for _ in range(6000):
      if cancel.is_set():
        stopped.append(k)
        raise rollout_lib.RolloutCancelled("cancelled")
      time.sleep(0.01)
    return k, {}

  rollouts = async_rollout.AsyncRollouts(play, _Envs(), 1, 0, 3, {0: 0})
  began = time.perf_counter()
  with rollouts:
    rollouts.take(0)
    assert started.wait(20)
  assert time.perf_counter() - began < 20 and stopped == [1]
  assert not rollouts._thread.is_alive() and rollouts._error is None


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
  with pytest.raises(ValueError, match=r"reward\.judge=True with mesh\.sampler_devices=2"):
    algorithms.resolve(dataclasses.replace(
        _async(), reward=config_lib.RewardSection(judge=True),
        mesh=config_lib.MeshSection(sampler_devices=2)))
  with pytest.raises(ValueError, match=r"rollout\.max_staleness=1: asynchronous rollouts run "
                                       r"in a single process"):
    preflight.check_processes(resolved, (2, 1, 1), 2)
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


# --- the trainer on the tiny model --------------------------------------------------------------

VARIED = "tests.train.echo_config:varied_reward"  # every reply rewarded: every update moves


def _model():
  return tiny_trainer_model()  # the synchronous trainer tests' (it learns the echo task)


@pytest.fixture(scope="module")
def model():
  return _model()


def _config(eta=2, iterations=4, num_envs=8, echo_high=10, **changes):
  """The echo team, 4 iterations of 8 episodes, checkpoints at 2 and 4; echo_high 10: each
  iteration's problems differ, so a wrong data cursor shows."""
  return echo_config("marft_a", num_envs=num_envs, iterations=iterations, checkpoint_every=2,
                     task=config_lib.TaskSection(name="echo", echo_high=echo_high),
                     rollout=RolloutSection(num_envs=num_envs, max_context=256,
                                            max_staleness=eta),
                     reward=config_lib.RewardSection(fn=VARIED), **changes)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _timeless(rows):
  """The metrics that do not depend on the timing (no times, waits or shares)."""
  timed = lambda k: k.startswith("time/") or k.endswith(("_s", "_share", "tok_s"))
  return [{k: v for k, v in row.items() if not timed(k)} for row in rows]


def _final_state(config, model, workdir):
  with checkpoint_lib.Checkpointer(workdir, read_only=True) as checkpointer:
    return checkpointer.restore(run_lib.new_state(config, model))[0]


def _assert_same_run(config, model, a, b):
  for x, y in zip(jax.tree.leaves(_final_state(config, model, a)),
                  jax.tree.leaves(_final_state(config, model, b))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert _timeless(_metrics(a)) == _timeless(_metrics(b))


@pytest.fixture(scope="module")
def straight(model, tmp_path_factory):
  """An uninterrupted η = 2 run, as the sampler and learner happened to run."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  loop.train(_config(), workdir, model=model, progress=False)
  return workdir


@pytest.mark.exactness
def test_a_slow_sampler_or_a_slow_learner_trains_the_same_bits(model, straight, tmp_path,
                                                               monkeypatch):
  """η = 2: with the sampler slow, version k − 1 is out before iteration k samples (a
  freshest-version sampler would take it); with the learner slow, the sampler waits. Either
  way every iteration samples version k − 2 with its own keys: the same run, bit for bit."""
  real_play, real_learn = run_lib._play, run_lib._learn_one
  slow = lambda real: lambda *args, **kwargs: time.sleep(0.15) or real(*args, **kwargs)
  monkeypatch.setattr(run_lib, "_play", slow(real_play))
  loop.train(_config(), str(tmp_path / "sampler"), model=model, progress=False)
  monkeypatch.setattr(run_lib, "_play", real_play)
  monkeypatch.setattr(run_lib, "_learn_one", slow(real_learn))
  loop.train(_config(), str(tmp_path / "learner"), model=model, progress=False)
  for workdir in (tmp_path / "sampler", tmp_path / "learner"):
    _assert_same_run(_config(), model, straight, str(workdir))
  rows = _metrics(straight)
  assert [r["async/version_gap"] for r in rows] == [0, 1, 2, 2]
  assert [r["async/policy_version"] for r in rows] == [0, 0, 0, 1]
  assert {r["policy_version"] for r in rollout_lib.read_transcripts(
      os.path.join(straight, "transcripts"), 3)} == {1}
  assert all(0 < r["behaviour/weight_mean"] for r in rows)
  assert rows[0]["behaviour/weight_max"] == pytest.approx(1.0, abs=1e-4)  # version 0 = π_old
  assert max(r["behaviour/weight_max"] for r in rows[2:]) > 1.01  # stale: the weights move


def _killed_run(workdir):
  """In a subprocess: the run of `straight`, killed (SIGKILL) in iteration 2, after the
  checkpoint of step 2 and while the sampler plays iteration 3."""
  def kill(iteration, metrics):
    if iteration == 2:
      os.kill(os.getpid(), signal.SIGKILL)

  loop.train(_config(), workdir, model=_model(), progress=False, on_iteration=kill)


@pytest.mark.exactness
def test_kill_9_then_resume_trains_every_iteration_once_as_an_uninterrupted_run(
    model, straight, tmp_path):
  workdir = str(tmp_path / "killed")
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  code = f"from tests.train.test_async_rollout import _killed_run; _killed_run({workdir!r})"
  out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
  assert checkpoint_lib.saved_steps(workdir) == [2]
  assert [r["step"] for r in _metrics(workdir)][:2] == [0, 1]
  loop.train(_config(), workdir, model=model, progress=False)  # the same command again
  assert [r["step"] for r in _metrics(workdir)] == [0, 1, 2, 3]  # none twice
  _assert_same_run(_config(), model, straight, workdir)


@pytest.mark.exactness
def test_ctrl_c_checkpoints_cancels_the_rollout_in_flight_and_resumes_as_uninterrupted(
    model, straight, tmp_path, monkeypatch):
  """Ctrl-C (SIGINT) after iteration 1 of the η = 2 run, while the sampler thread is inside
  iteration 3's first sampler call: the trainer checkpoints step 2 and returns; the rollout
  in flight stops before its next sampler call (none is made, no env is stepped), instead of
  playing out; the same command again trains iterations 2 and 3 once, equal to `straight`."""
  from marft_jax.envs.batch import EnvBatch
  from marft_jax.models import sampler
  in_flight, engine, late = threading.Event(), [], []
  real_generate, real_step_many = sampler.generate, EnvBatch.step_many
  real_play, real_start = run_lib._play, loop._start_async
  version = {}
  sampler_thread = lambda: threading.current_thread().name == "marft-sampler"

  def play(policy, rng, v, **kwargs):
    version["now"] = v
    return real_play(policy, rng, v, **kwargs)

  def generate(*args, **kwargs):
    if sampler_thread() and version["now"] == 1:  # iteration 3 samples version 1
      if engine[0]._cancel.is_set():
        late.append("sampler call")
      elif not in_flight.is_set():
        in_flight.set()  # the learner sends SIGINT now; hold the call until the cancel
        deadline = time.monotonic() + 120
        while not engine[0]._cancel.is_set() and time.monotonic() < deadline:
          time.sleep(0.01)
    return real_generate(*args, **kwargs)

  def step_many(self, *args, **kwargs):
    if sampler_thread() and version["now"] == 1:
      late.append("env step")
    return real_step_many(self, *args, **kwargs)

  def interrupt(iteration, metrics):
    if iteration == 1:
      assert in_flight.wait(60)
      os.kill(os.getpid(), signal.SIGINT)

  monkeypatch.setattr(run_lib, "_play", play)
  monkeypatch.setattr(loop, "_start_async",
                      lambda *a, **k: engine.append(real_start(*a, **k)) or engine[0])
  monkeypatch.setattr(sampler, "generate", generate)
  monkeypatch.setattr(EnvBatch, "step_many", step_many)
  workdir = str(tmp_path / "interrupted")
  began = time.monotonic()
  loop.train(_config(), workdir, model=model, progress=False, on_iteration=interrupt)
  assert time.monotonic() - began < 90  # not the held call's 120 s: the cancel released it
  assert late == [] and not engine[0]._thread.is_alive()
  assert checkpoint_lib.saved_steps(workdir) == [2]
  assert [r["step"] for r in _metrics(workdir)] == [0, 1]
  monkeypatch.undo()
  loop.train(_config(), workdir, model=model, progress=False)  # the same command again
  assert [r["step"] for r in _metrics(workdir)] == [0, 1, 2, 3]
  _assert_same_run(_config(), model, straight, workdir)


@pytest.mark.exactness
def test_a_signal_while_the_learner_waits_for_its_batch_stops_at_once_and_resumes_exactly(
    model, straight, tmp_path, monkeypatch):
  """SIGTERM arrives while the learner waits in `take(3)` for the sampler's iteration 3, held
  inside its first sampler call: the learner stops waiting, checkpoints step 3 (iterations
  0-2, between the periodic ones at 2 and 4) and returns, and the sampler's rollout is
  cancelled; the resume equals `straight`. Without the stop the learner would wait out the
  held call (120 s) and train iteration 3."""
  from marft_jax.models import sampler
  waiting, engine, version = threading.Event(), [], {}
  real_take = async_rollout.AsyncRollouts.take
  real_generate, real_play, real_start = sampler.generate, run_lib._play, loop._start_async

  def take(self, iteration, **kwargs):
    if iteration == 3:
      waiting.set()
    return real_take(self, iteration, **kwargs)

  def play(policy, rng, v, **kwargs):
    version["now"] = v
    return real_play(policy, rng, v, **kwargs)

  def generate(*args, **kwargs):
    if threading.current_thread().name == "marft-sampler" and version["now"] == 1 \
        and not version.get("held"):  # iteration 3 samples version 1
      version["held"] = True
      assert waiting.wait(120)
      time.sleep(0.3)  # the learner is inside take(3)'s wait
      os.kill(os.getpid(), signal.SIGTERM)
      deadline = time.monotonic() + 120
      while not engine[0]._cancel.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    return real_generate(*args, **kwargs)

  monkeypatch.setattr(async_rollout.AsyncRollouts, "take", take)
  monkeypatch.setattr(run_lib, "_play", play)
  monkeypatch.setattr(loop, "_start_async",
                      lambda *a, **k: engine.append(real_start(*a, **k)) or engine[0])
  monkeypatch.setattr(sampler, "generate", generate)
  workdir = str(tmp_path / "stopped")
  began = time.monotonic()
  loop.train(_config(), workdir, model=model, progress=False)
  assert time.monotonic() - began < 90 and version["held"]
  assert checkpoint_lib.saved_steps(workdir) == [2, 3]
  assert [r["step"] for r in _metrics(workdir)] == [0, 1, 2]
  assert not engine[0]._thread.is_alive()
  monkeypatch.undo()
  loop.train(_config(), workdir, model=model, progress=False)  # the same command again
  assert [r["step"] for r in _metrics(workdir)] == [0, 1, 2, 3]
  _assert_same_run(_config(), model, straight, workdir)


def test_eta_1_learns_the_echo_task(model, tmp_path):
  """As the synchronous trainer does (tests/train/test_trainer.py): from chance to a 3-iteration
  mean reward >= 0.8, on stale samples (gap 1 from the second iteration)."""
  seen = []

  def stop_once_learned(iteration, metrics):
    seen.append(metrics["reward"])
    if len(seen) >= 3 and np.mean(seen[-3:]) >= 0.8:
      raise _Learned()

  config = echo_config("marft_a", num_envs=64, iterations=14,
                       rollout=RolloutSection(num_envs=64, max_context=256, max_staleness=1))
  with contextlib.suppress(_Learned):
    loop.train(config, str(tmp_path), model=model, progress=False,
               on_iteration=stop_once_learned)
  rows = _metrics(tmp_path)
  rewards = [r["reward"] for r in rows]
  assert rewards[0] < 0.2, rewards
  assert max(np.mean(rewards[i:i + 3]) for i in range(len(rewards) - 2)) >= 0.8, rewards
  assert [r["async/version_gap"] for r in rows] == [0] + [1] * (len(rows) - 1)


class _Learned(Exception):
  pass


def test_the_sampler_on_its_own_devices_samples_each_version_copied_there(model, tmp_path,
                                                                         monkeypatch):
  """8 virtual devices: the learner on the first 6 (mesh.data=-1), the sampler on the last 2.
  Each rollout's adapters lie on the sampler's devices and are, bit for bit, the learner's
  version max(k − 1, 0): the initial adapters, then version 1 as saved behind checkpoint 2.
  The sampler's copy of the base lies there too, and on none of the learner's devices."""
  sampled = []
  real_rollout = run_lib.rollout

  def rollout(*args, lora, **kwargs):
    if not kwargs["config"].share_group_prompts:  # training's (held-out evaluations share)
      sampled.append(({d for leaf in jax.tree.leaves(lora) for d in leaf.devices()},
                      [np.asarray(leaf) for leaf in jax.tree.leaves(lora)]))
    return real_rollout(*args, lora=lora, **kwargs)

  trained, copies = [], []
  real_learn = run_lib._learn_one
  # The sampler's copy of the base (decoding layout on CPU: per-layer [out, in] kernels): an
  # [F, D] array is a gate or up kernel of it; the learner's are stacked, [L, D, F].
  copy_shape = (model.config.intermediate_size, model.config.hidden_size)

  def learn(*args, **kwargs):
    state, metrics = real_learn(*args, **kwargs)
    trained.append({d for leaf in jax.tree.leaves(state) for d in leaf.devices()})
    copies.append({d for a in jax.live_arrays() if a.shape == copy_shape for d in a.devices()})
    return state, metrics

  monkeypatch.setattr(run_lib, "rollout", rollout)
  monkeypatch.setattr(run_lib, "_learn_one", learn)
  # A held-out evaluation each iteration, on the learner's mesh: its copy is its own call's.
  config = _config(eta=1, iterations=3, mesh=config_lib.MeshSection(data=-1, sampler_devices=2),
                   eval_every=1, eval_episodes=2)
  workdir = str(tmp_path)
  loop.train(config, workdir, model=model, progress=False)
  assert all("heldout/accuracy" in row for row in _metrics(workdir))
  assert [devices for devices, _ in sampled] == [set(jax.devices()[6:])] * 3
  initial = run_lib.new_state(config, model).policy
  with checkpoint_lib.Checkpointer(async_rollout.versions_dir(workdir),
                                   read_only=True) as saved:
    version_1, = saved.restore((initial,), step=2)[0]
  assert trained == [set(jax.devices()[:6])] * 3
  # The sampler's copy lies on its devices alone: the learner's keep none for the whole run.
  assert copies == [set(jax.devices()[6:])] * 3
  for k, version in enumerate([initial, initial, version_1]):
    for x, y in zip(sampled[k][1], jax.tree.leaves(version)):
      np.testing.assert_array_equal(x, np.asarray(y))
  assert not np.array_equal(sampled[2][1][0], sampled[0][1][0])  # version 1 moved

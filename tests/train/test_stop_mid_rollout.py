"""SIGTERM (a scheduler's preemption notice) or Ctrl-C inside the synchronous trainer's rollout:
the rollout stops at its next sampler call, the state and data cursor from before that
iteration are checkpointed, and the same command again continues as the uninterrupted run
(reference: that run, bit for bit), so a short grace period need not cover a rollout and an
update. The asynchronous trainer's case: tests/train/test_async_rollout.py.
"""

import os
import signal
import threading

import pytest

from marft_jax.envs.batch import EnvBatch
from marft_jax.models import sampler
from marft_jax.train import checkpoint as checkpoint_lib
from marft_jax.train import loop
from marft_jax.train import run as run_lib
from tests.train.test_async_rollout import _assert_same_run, _config, _metrics, _model

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs


@pytest.fixture(scope="module")
def model():
  return _model()


@pytest.fixture(scope="module")
def straight(model, tmp_path_factory):
  """The synchronous run (4 iterations, checkpoints at 2 and 4), uninterrupted."""
  workdir = str(tmp_path_factory.mktemp("straight_sync"))
  loop.train(_config(eta=0), workdir, model=model, progress=False)
  return workdir


@pytest.mark.parametrize("stop_in,signum", [(0, signal.SIGINT), (3, signal.SIGTERM)])
def test_a_signal_inside_a_rollout_checkpoints_the_iteration_before_and_resumes_exactly(
    model, straight, tmp_path, monkeypatch, stop_in, signum):
  """The signal arrives during the reasoner's sampler call of iteration `stop_in`: the
  actor's call and the env step never happen; the checkpoint is step `stop_in` (none at 0:
  nothing was trained; at 3, beside the periodic one at 2, before the one at 4 that the
  uninterrupted run writes); the resume trains the rest once."""
  playing, late = {}, []
  real_play, real_generate, real_step_many = run_lib._play, sampler.generate, EnvBatch.step_many

  def play(policy, rng, version, **kwargs):
    playing["iteration"] = version  # synchronous: version k is iteration k
    return real_play(policy, rng, version, **kwargs)

  def generate(*args, **kwargs):
    if playing["iteration"] == stop_in:
      if playing.get("signalled"):
        late.append("sampler call")
      else:
        playing["signalled"] = True
        os.kill(os.getpid(), signum)  # handled in this (the main) thread, here
    return real_generate(*args, **kwargs)

  def step_many(self, *args, **kwargs):
    if playing["iteration"] == stop_in and playing.get("signalled"):
      late.append("env step")
    return real_step_many(self, *args, **kwargs)

  monkeypatch.setattr(run_lib, "_play", play)
  monkeypatch.setattr(sampler, "generate", generate)
  monkeypatch.setattr(EnvBatch, "step_many", step_many)
  workdir = str(tmp_path / "stopped")
  assert threading.current_thread() is threading.main_thread()
  loop.train(_config(eta=0), workdir, model=model, progress=False)
  assert playing["signalled"] and late == []
  expected = {0: [], 3: [2, 3]}[stop_in]
  assert checkpoint_lib.saved_steps(workdir) == expected
  assert [r["step"] for r in _metrics(workdir)] == list(range(stop_in))
  monkeypatch.undo()
  loop.train(_config(eta=0), workdir, model=model, progress=False)  # the same command again
  assert [r["step"] for r in _metrics(workdir)] == [0, 1, 2, 3]
  _assert_same_run(_config(eta=0), model, straight, workdir)

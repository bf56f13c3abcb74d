"""One training run per workdir: `workdir_lock.exclusive` against another process that holds
the lock (a child process, the reference), one killed with SIGKILL (its lock must not outlive
it), re-entry in one process, a multi-process job's agreement, and launch.train refusing a
workdir in use before it reads the model."""

import os
import signal
import subprocess
import sys

import pytest

from marft_jax.train import workdir_lock
from marft_jax.train.workdir_lock import WorkdirInUseError, exclusive
from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOLD = ("import sys, time\n"
         "from marft_jax.train.workdir_lock import exclusive\n"
         "with exclusive(sys.argv[1]):\n"
         "  print('held', flush=True)\n"
         "  time.sleep(120)\n")


@pytest.fixture
def holder(tmp_path):
  """A child process holding tmp_path's lock (killed at the end)."""
  child = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT,
                           stdout=subprocess.PIPE, text=True)
  try:
    assert child.stdout.readline().strip() == "held"
    yield child
  finally:
    child.kill()
    child.wait()


@pytest.mark.skipif(workdir_lock.fcntl is None, reason="no flock on this platform")
def test_a_workdir_held_by_another_process_is_refused_naming_it(tmp_path, holder):
  with pytest.raises(WorkdirInUseError, match=rf"in use by another training run \(process id "
                                             rf"{holder.pid}\)"):
    with exclusive(str(tmp_path)):
      pytest.fail("entered a workdir another process holds")
  # Killed without a chance to clean up: the kernel drops its lock, so a resume can start.
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  with exclusive(str(tmp_path)):
    with open(tmp_path / workdir_lock.LOCK_FILE) as f:
      assert f.read().strip() == str(os.getpid())


def test_this_process_may_enter_a_workdir_it_holds_and_releases_it_after(tmp_path):
  with exclusive(str(tmp_path)):
    with exclusive(str(tmp_path / ".." / tmp_path.name)):  # the same folder, another spelling
      pass
  # Released: another process takes it.
  out = subprocess.run([sys.executable, "-c", _HOLD.replace("time.sleep(120)", "pass"),
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0 and out.stdout.strip() == "held", out.stderr


def test_every_process_of_a_job_raises_when_the_primary_finds_the_workdir_in_use(tmp_path):
  """A process that does not lock still raises when the job's agreement says the primary
  could not (else it would wait for the primary in its next collective, for ever)."""
  with pytest.raises(WorkdirInUseError, match="the primary process found it in use"):
    with exclusive(str(tmp_path), primary=False, any_process=lambda flag: True):
      pytest.fail("entered")
  with exclusive(str(tmp_path), primary=False, any_process=lambda flag: flag):
    assert not (tmp_path / workdir_lock.LOCK_FILE).exists()  # only the primary locks


@pytest.mark.skipif(workdir_lock.fcntl is None, reason="no flock on this platform")
def test_launch_train_refuses_a_workdir_in_use_before_reading_the_model(tmp_path, holder):
  """The model source does not exist: an error about it would mean it was read first."""
  out = subprocess.run([sys.executable, "-m", "launch.train", f"--workdir={tmp_path}",
                        f"--config.model.source={tmp_path / 'missing'}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 1, out.stderr
  assert out.stderr.strip() == (f"error: {tmp_path}: in use by another training run (process "
                                f"id {holder.pid}); wait for it to end, or train into another "
                                "workdir"), out.stderr


@pytest.mark.skipif(workdir_lock.fcntl is None, reason="no flock on this platform")
def test_train_refuses_a_workdir_in_use_before_reading_the_model(tmp_path, holder):
  from marft_jax.train import loop  # noqa: PLC0415
  from marft_jax.train.config import ModelSection  # noqa: PLC0415
  from tests.train.echo_config import echo_config  # noqa: PLC0415
  config = echo_config(model=ModelSection(source=str(tmp_path / "missing")))
  with pytest.raises(WorkdirInUseError, match=f"process id {holder.pid}"):
    loop.train(config, str(tmp_path))

"""A full disk is one line: a failed checkpoint save or metrics write names the workdir, what
was being written, the space left and the step to resume from; nothing is lost, and once
space is freed the same command finishes as an uninterrupted run would have.

On a real full file system (a small tmpfs, mounted when the tests run as root) and with the
failure simulated (an OSError(ENOSPC) or tensorstore's ValueError raised where the file is
written) where one cannot be made. References: an uninterrupted run of the same config, and
the files as they were before the failed write.
"""

import contextlib
import dataclasses
import errno
import os
import shutil
import sys
import subprocess

import numpy as np
import pytest

from marft_jax.models import loading
from marft_jax.train.build import model as model_lib
from marft_jax.train.config import saved as saved_config
from marft_jax.train import loop
from marft_jax.train import metrics as metrics_lib
from marft_jax.train.checkpoint import Checkpointer, saved_steps
from marft_jax.train.metrics import MetricWriter
from marft_jax.train.write_failures import WorkdirWriteError
from tests.fixtures.old_checkpoints import make
from tests.fixtures.old_checkpoints.make import metrics_row, state_digests

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Orbax's write failure as tensorstore words it (seen on a full tmpfs).
TENSORSTORE_ENOSPC = ('RESOURCE_EXHAUSTED: Error writing "a/0.0" in OCDBT database at local file '
                      '"x": Failed to write 152760 bytes to file 7: No space left on device '
                      "[os_error_code='28']")


def _assert_one_line(error, workdir, what, resume_step):
  text = str(error)
  assert "\n" not in text and "Traceback" not in text, text
  assert text.startswith(f"{workdir}: could not write {what}"), text
  assert "No space left on device" in text and " free there" in text, text
  assert f"resume from step {resume_step}" in text, text
  assert error.errno == errno.ENOSPC


@contextlib.contextmanager
def _small_file_system(path, size="16m"):
  """A tmpfs of `size` mounted at `path` (root only; skipped otherwise)."""
  if not hasattr(os, "geteuid") or os.geteuid() != 0:
    pytest.skip("mounting a tmpfs needs root: the simulated tests cover the same paths")
  os.makedirs(path)
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"mount -t tmpfs failed ({mounted.stderr.strip()}): the simulated tests cover "
                "the same paths")
  try:
    yield path
  finally:
    subprocess.run(["umount", "-l", path], check=False)


def _fill(folder) -> str:
  """Fills the file system holding `folder` to its last page; returns the filler's path."""
  path = os.path.join(folder, "filler")
  fd = os.open(path, os.O_WRONLY | os.O_CREAT)
  try:
    for chunk in (1 << 20, 1 << 12):
      try:
        while True:
          os.write(fd, b"\1" * chunk)
      except OSError as e:
        assert e.errno == errno.ENOSPC, e
  finally:
    os.close(fd)
  return path


def test_a_disk_that_fills_mid_run_is_one_line_and_the_rerun_is_bit_identical(tmp_path):
  """The run of tests/fixtures/old_checkpoints/every_key_f32, resumed from its step 1 on a
  small file system that fills during the iteration; after space is freed, the same command
  finishes bit for bit as the same resume without the failure, made in this process (bit for
  bit holds within one process's codegen: tests/exactness.py)."""
  fixture = os.path.join(make.HERE, "every_key_f32")
  with _small_file_system(str(tmp_path / "fs")) as fs:
    workdir = os.path.join(fs, "run")
    shutil.copytree(os.path.join(fixture, "workdir"), workdir)
    with Checkpointer(workdir, read_only=True) as checkpointer:
      saved = checkpointer.read_meta(1)["config"]
    config = dataclasses.replace(saved_config.read_saved_config(saved, workdir), iterations=2)
    model = model_lib.Model(*loading.load_model(make.MODEL))
    straight = str(tmp_path / "straight")  # the uninterrupted resume, on a roomy disk
    shutil.copytree(os.path.join(fixture, "workdir"), straight)
    loop.train(config, straight, model=model, progress=False)
    filler = []

    def fill_after_the_update(iteration, metrics):
      filler.append(_fill(fs))

    # The disk fills during iteration 1: its checkpoint (step 2) cannot be written.
    with pytest.raises(WorkdirWriteError) as failed:
      loop.train(config, workdir, model=model, progress=False,
                 on_iteration=fill_after_the_update)
    _assert_one_line(failed.value, workdir, "the checkpoint of step 2", resume_step=1)
    assert saved_steps(workdir) == [1]
    # Still full: resuming cannot cut the metrics log back to step 1 (the traceback of the
    # issue, in metrics.py's write_atomically); the log is left as it was.
    before = open(os.path.join(workdir, "metrics.jsonl")).read()
    with pytest.raises(WorkdirWriteError) as full:
      MetricWriter(workdir, resume_step=1)
    _assert_one_line(full.value, workdir, "metrics.jsonl, cut back", resume_step=1)
    assert open(os.path.join(workdir, "metrics.jsonl")).read() == before

    os.remove(filler[0])  # space freed: the same command finishes
    loop.train(config, workdir, model=model, progress=False)
    assert state_digests(workdir, 2) == state_digests(straight, 2)
    assert metrics_row(workdir, 1) == metrics_row(straight, 1)


# --- simulated: the same failures raised where the files are written ---------------------------


def _no_space_to_write(path, mode="r", *args, **kwargs):
  if any(m in mode for m in "wax+"):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  return open(path, mode, *args, **kwargs)


def test_a_failed_metrics_write_is_one_line_and_leaves_the_log(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  with MetricWriter(workdir) as writer:
    writer.write(0, {"reward": 1.0})
    writer.write(1, {"reward": 2.0})
  before = open(os.path.join(workdir, "metrics.jsonl")).read()
  monkeypatch.setattr(metrics_lib, "open", _no_space_to_write, raising=False)  # the temporary file
  with pytest.raises(WorkdirWriteError) as failed:
    MetricWriter(workdir, resume_step=1)
  assert str(failed.value).startswith(f"{workdir}: could not write metrics.jsonl, cut back to "
                                      "the steps before 1 (No space left on device; ")
  assert "no checkpoint was written yet" in str(failed.value)
  assert open(os.path.join(workdir, "metrics.jsonl")).read() == before
  assert [n for n in os.listdir(workdir) if ".tmp-" in n] == []


def test_a_failed_checkpoint_save_is_one_line_and_keeps_the_last_step(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  state = {"w": np.arange(6, dtype=np.float32)}
  with Checkpointer(workdir) as checkpointer:
    checkpointer.save(1, state, {"iteration": 1}, force=True)
    for raised in (ValueError(TENSORSTORE_ENOSPC), OSError(errno.ENOSPC, "No space left")):
      def failing_save(*args, raised=raised, **kwargs):
        raise raised
      monkeypatch.setattr(checkpointer._manager, "save", failing_save)
      with pytest.raises(WorkdirWriteError) as failed:
        checkpointer.save(2, {"w": state["w"] + 1}, {"iteration": 2}, force=True)
      _assert_one_line(failed.value, workdir, "the checkpoint of step 2 (checkpoints/2)", 1)
    monkeypatch.undo()
  with Checkpointer(workdir) as checkpointer:
    assert checkpointer.all_steps() == [1]
    restored, meta = checkpointer.restore(state)
  np.testing.assert_array_equal(restored["w"], state["w"])
  # Another ValueError of the save (not a write failure) is not dressed as one.
  with Checkpointer(workdir) as checkpointer:
    with pytest.raises(TypeError, match="not JSON-serialisable"):
      checkpointer.save(3, state, {"iteration": object()}, force=True)


def test_the_launch_shows_a_full_disk_as_one_line(tmp_path):
  """`python -m launch.train` into a workdir on a full file system: the first write of the
  run (its lock file's process id, before the model loads) is one line and exit status 1."""
  from tests.compile_flags import FAST_COMPILE
  from tests.train.echo_config import echo_flags
  with _small_file_system(str(tmp_path / "fs"), size="1m") as fs:
    _fill(fs)
    workdir = os.path.join(fs, "run")
    flags = [f"--config.{k}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
             for k, v in echo_flags("marft_a", num_envs=2, iterations=1).items()]
    out = subprocess.run(
        [sys.executable, "-m", "launch.train", *flags, f"--config.model.source={make.MODEL}",
         f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, XLA_FLAGS=FAST_COMPILE))
  assert out.returncode == 1, out.stderr
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(f"error: {workdir}: could not write .run.lock "
                                                 "(this run's process id)"), out.stderr
  assert "No space left on device" in lines[0] and "no checkpoint was written yet" in lines[0]

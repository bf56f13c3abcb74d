"""A run's file that cannot be written (a full disk, a quota, a read-only mount) as one line.

Every file a training run writes into its workdir (checkpoints, PEFT exports, metrics,
transcripts, the config record, the learning-curve plot, TensorBoard) is written inside
`writing(workdir, what)`. A failure there becomes a `WorkdirWriteError` that names the
workdir, what was being written, the reason, the space left on its file system and the step
a rerun of the same command resumes from. Nothing is lost by such a failure: checkpoints
appear whole or not at all (`checkpoint.Checkpointer`), the metrics log is cut back to the
resumed step, and the other files are rewritten by the resumed run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Optional

from marft_jax.train.saved_steps import saved_steps

# Tensorstore (Orbax's writer) reports an OS error as a ValueError ending in this.
_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='?(\d+)'?\]")


class WorkdirWriteError(OSError):
  """A file of a run's workdir could not be written (the message says which, why, the space
  left and the step to resume from). `errno` is the underlying error's, when known."""


def free_space(path: str) -> Optional[int]:
  """Bytes free to this user on the file system holding `path` (or its nearest existing
  parent); None if even that cannot be asked."""
  path = os.path.abspath(path)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  try:
    return shutil.disk_usage(path).free
  except OSError:
    return None


def _size(count: Optional[int]) -> str:
  if count is None:
    return "unknown"
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if count < 1024 or unit == "TB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
    count /= 1024


def _resume_step(workdir: str) -> Optional[int]:
  try:
    steps = saved_steps(workdir)
  except OSError:
    return None
  return steps[-1] if steps else None


def os_error_code(error: BaseException) -> Optional[int]:
  """The errno of an OSError, or of a tensorstore write failure (a ValueError naming it);
  None for anything else."""
  if isinstance(error, OSError):
    return error.errno if error.errno is not None else 0
  match = _TENSORSTORE_OS_ERROR.search(str(error)) if isinstance(error, ValueError) else None
  return int(match.group(1)) if match else None


def write_error(workdir: str, what: str, error: BaseException) -> WorkdirWriteError:
  """The one-line `WorkdirWriteError` for `error`, raised while writing `what` into
  `workdir`."""
  code = os_error_code(error)
  reason = (os.strerror(code) if code else None) or str(error).strip().splitlines()[0][:200]
  step = _resume_step(workdir)
  then = (f"the checkpoint of step {step} is intact: free some space and run the same "
          f"command again to resume from step {step}" if step is not None else
          "no checkpoint was written yet: free some space and run the same command again "
          "to start the run over")
  failure = WorkdirWriteError(f"{workdir}: could not write {what} ({reason}; "
                              f"{_size(free_space(workdir))} free there); {then}")
  failure.errno = code or None
  return failure


@contextlib.contextmanager
def writing(workdir: str, what: str):
  """Turns an OSError (or a tensorstore write failure) raised inside into `write_error`'s
  `WorkdirWriteError`; a `WorkdirWriteError` from a nested block passes as it is."""
  try:
    yield
  except WorkdirWriteError:
    raise
  except (OSError, ValueError) as e:
    if os_error_code(e) is None:
      raise
    raise write_error(os.fspath(workdir), what, e) from e

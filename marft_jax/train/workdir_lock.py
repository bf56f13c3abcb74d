"""One training run per workdir at a time.

A second launch into a workdir whose run is still going (the same job submitted twice, a
resume typed while the first run lives) would interleave its metrics with the first's and
race it for the same checkpoint steps. Instead it fails at once, naming the process that
holds the workdir:

    with workdir_lock.exclusive(workdir):
      ...  # train

The lock is `fcntl.flock` on `<workdir>/.run.lock`, taken by the primary process (the one
that writes the shared files) and held until the block ends. The kernel drops it when the
process ends however it ends (a crash, `kill -9`, a lost host), so a stale lock never blocks
the resume that follows. A process re-entering a workdir it holds (the launch script locks
before it loads the model, then calls `train`, which locks again) goes on. Where `flock` does
not exist (Windows) or does not lock across hosts (some network file systems), nothing is
enforced.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

from marft_jax.train.write_failures import writing

try:
  import fcntl
except ImportError:  # Windows
  fcntl = None

LOCK_FILE = ".run.lock"

_held: set[str] = set()  # workdirs this process holds (real paths)


class WorkdirInUseError(RuntimeError):
  """Another live process holds the workdir's lock."""


@contextlib.contextmanager
def exclusive(workdir: str, primary: bool = True,
              any_process: Callable[[bool], bool] = bool) -> Iterator[None]:
  """Holds `workdir`'s run lock for the block; WorkdirInUseError if another process has it.

  Args:
    workdir: an existing folder.
    primary: whether this process takes the lock (a multi-process job: process 0 only).
    any_process: agrees on the outcome across a job's processes (`multihost.any_process`),
      so that every process raises, not only the one that found the lock taken.
  """
  key = os.path.realpath(workdir)
  if fcntl is None or not primary or key in _held:
    if any_process(False):
      raise WorkdirInUseError(f"{workdir}: the primary process found it in use by another run")
    yield
    return
  fd = os.open(os.path.join(workdir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      busy = False
    except BlockingIOError:
      busy = True
    if any_process(busy):  # only this process locks: busy is True here
      holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
      raise WorkdirInUseError(f"{workdir}: in use by another training run (process id "
                              f"{holder}); wait for it to end, or train into another workdir")
    with writing(workdir, f"{LOCK_FILE} (this run's process id)"):  # a full disk: one line
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.add(key)
    try:
      yield
    finally:
      _held.discard(key)
  finally:
    os.close(fd)  # drops the lock

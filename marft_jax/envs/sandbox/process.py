"""Supervising one sandboxed process: reading its pipes, stopping and reaping it, and the
verdict (`Result`) on how it ended."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import time
from typing import Optional

from marft_jax.envs.sandbox.boot import MARK
from marft_jax.envs.sandbox.isolation import Plan
from marft_jax.envs.sandbox.job import Limits, Result, Status

log = logging.getLogger("marft_jax.envs.sandbox")

KILL_GRACE_S = 5.0  # how long a killed process group may take to be reaped


class Reader:
  """Reads stdout (up to a cap) and stderr (its tail) from raw non-blocking pipes, so that
  neither a silent program nor a flood can block or fill the caller."""

  def __init__(self, proc, limits: Limits):
    self._pipes = (proc.stdout, proc.stderr)
    self.limits, self.out, self.err = limits, bytearray(), bytearray()
    self.started, self.overflow = False, False
    self._out_fd, self._head = proc.stdout.fileno(), bytearray()
    self._sel = selectors.DefaultSelector()
    for pipe in (proc.stdout, proc.stderr):
      os.set_blocking(pipe.fileno(), False)
      self._sel.register(pipe.fileno(), selectors.EVENT_READ)

  @property
  def open(self) -> bool:
    return bool(self._sel.get_map())

  def pump(self, timeout: float) -> int:
    """Reads what becomes ready within `timeout`; returns the number of bytes read."""
    if not self.open:  # both closed: the caller is waiting for the exit
      time.sleep(min(max(timeout, 0.0), 0.005))
      return 0
    n = 0
    for key, _ in self._sel.select(max(timeout, 0.0)):
      try:
        chunk = os.read(key.fd, 65536)
      except BlockingIOError:
        continue
      n += len(chunk)
      if not chunk:
        self._sel.unregister(key.fd)
      elif key.fd == self._out_fd:
        self.out += chunk[:self.limits.stdout_bytes + 1 - len(self.out)]
        self.overflow = len(self.out) > self.limits.stdout_bytes
      else:
        self._stderr(chunk)
    return n

  def drain(self, seconds: float):
    """Reads until both pipes close, the cap is hit, or `seconds` pass (a writer that
    escaped the kill could otherwise keep stderr busy forever)."""
    until = time.monotonic() + seconds
    while self.open and not self.overflow and time.monotonic() < until:
      self.pump(until - time.monotonic())

  def _stderr(self, chunk: bytes):
    """Keeps the tail; until the start mark shows up, holds what came (a wrapper's own
    messages) so that the mark can be found across chunks and cut out."""
    if self._head is not None:
      self._head += chunk
      at = self._head.find(MARK)
      if at < 0 and len(self._head) < 65536:
        return
      self.started = at >= 0
      chunk = bytes(self._head[:at] + self._head[at + len(MARK):] if at >= 0 else self._head)
      self._head = None
    self.err = (self.err + chunk)[-self.limits.stderr_bytes:]

  def stderr_text(self) -> str:
    return bytes(self.err + (self._head or b"")).decode("utf-8", "replace")

  def close(self):
    self._sel.close()
    for pipe in self._pipes:
      pipe.close()



def exited(pid: int) -> bool:
  """Whether the child has exited, leaving it a zombie so its process group id stays taken
  until `kill_group` has run."""
  try:
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  except ChildProcessError:
    return True
  return info is not None


def reap(proc) -> tuple[Optional[int], Optional[float]]:
  """(exit status, CPU seconds of the process and the descendants it reaped: the wrapper's
  count includes the program's), or (None, None) if the killed process is not gone within the
  grace period (left to subprocess's own reaping of abandoned children)."""
  deadline = time.monotonic() + KILL_GRACE_S
  while True:
    try:
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere
      return proc.returncode, None
    if pid:
      proc.returncode = os.waitstatus_to_exitcode(status)
      return proc.returncode, usage.ru_utime + usage.ru_stime
    if time.monotonic() > deadline:
      log.warning("sandbox: pid %d not reaped %gs after SIGKILL", proc.pid, KILL_GRACE_S)
      return None, None
    time.sleep(0.01)


def kill_namespace(wrapper: int):
  """Stops the init of the run's PID namespace (the wrapper's child), then waits for the
  wrapper to exit. The init's end kills every process of the namespace, each reaped by its
  own parent up to the wrapper, which the caller reaps. Killing the wrapper first would
  orphan the init to the host's init, whose reaping can lag (about a second on a Firecracker
  VM), while the uid's processes still count against RLIMIT_NPROC and the next run of that
  uid cannot start. SIGTERM first: the boot code's init exits on it with a status the
  wrapper passes on, whereas a SIGKILLed child makes util-linux `unshare` print an error."""
  for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, KILL_GRACE_S)):
    if not signal_children(wrapper, sig):
      return  # none (the wrapper is gone or has not forked yet): the group kill follows
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
      if exited(wrapper):
        return
      time.sleep(0.002)


def signal_children(parent: int, sig: int) -> bool:
  """Sends `sig` to the children of `parent`; whether there were any."""
  try:
    with open(f"/proc/{parent}/task/{parent}/children", encoding="ascii") as f:
      children = [int(pid) for pid in f.read().split()]
  except OSError:
    return False  # the parent is gone, or no such file (CONFIG_PROC_CHILDREN)
  for pid in children:
    try:  # a pidfd, so that a pid reused since the listing is never signalled
      fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
      continue  # gone, or no pidfds here (Python < 3.9, Linux < 5.3)
    try:
      if parent_of(pid) == parent:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
      pass  # exited meanwhile
    finally:
      os.close(fd)
  return bool(children)


def parent_of(pid: int) -> Optional[int]:
  """The parent pid from /proc/<pid>/stat (its fourth field, after the command name)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
      return int(f.read().rsplit(")", 1)[1].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # the group is already gone (PermissionError: macOS reports a zombie group so)


def signal_of(code: Optional[int], plan: Plan) -> Optional[int]:
  """The signal that ended the program; in a PID namespace the boot code's init reports it
  as exit status 128 + n."""
  if code is None:
    return None
  if code < 0:
    return -code
  wrapped = plan.mode == "bwrap" or plan.namespaces
  return code - 128 if wrapped and 128 < code < 128 + 65 else None


def verdict(reader: Reader, code, timed_out, limits: Limits, plan: Plan, wall,
             cpu_s: Optional[float] = None) -> Result:
  out = bytes(reader.out[:limits.stdout_bytes]).decode("utf-8", "replace")
  err = reader.stderr_text()
  record = dict(stdout=out, stderr=err, exit_code=code, wall_s=wall)
  if reader.overflow:
    return Result(Status.OUTPUT_LIMIT, detail=f"stdout over {limits.stdout_bytes} bytes",
                  **record)
  if timed_out:
    return Result(Status.TIMEOUT, detail=f"wall-clock limit {limits.wall_s:g}s", **record)
  if not reader.started:
    return Result(Status.SANDBOX_ERROR, detail=f"the program never started (exit {code})",
                  **record)
  if code is None:
    return Result(Status.SANDBOX_ERROR, detail="the program could not be reaped", **record)
  sig = signal_of(code, plan)
  # SIGXCPU at the soft CPU limit; SIGKILL at the hard one, a second later, if the program
  # ignored SIGXCPU: told apart from another SIGKILL by the CPU time it had used.
  hard_cpu_kill = sig == signal.SIGKILL and cpu_s is not None and cpu_s >= limits.cpu_seconds
  if sig == signal.SIGXCPU or hard_cpu_kill:
    return Result(Status.TIMEOUT, detail=f"CPU limit {limits.cpu_seconds}s", **record)
  if code == 0:
    return Result(Status.OK, **record)
  why = f"killed by signal {sig}" if sig else f"exit status {code}"
  return Result(Status.RUNTIME_ERROR, detail=why, **record)


def remove_workdir(workdir: str):
  """Removes a work directory, also one where the program took its own permissions away
  (links are never followed; a failure is logged, never raised over the run's result)."""
  shutil.rmtree(workdir, ignore_errors=True)
  if not os.path.exists(workdir):
    return
  for top, dirs, _ in os.walk(workdir):
    for name in dirs:
      path = os.path.join(top, name)
      try:
        if not os.path.islink(path):
          os.chmod(path, 0o700)
      except OSError:
        pass  # gone meanwhile; the check below reports what is left
  shutil.rmtree(workdir, ignore_errors=True)
  if os.path.exists(workdir):
    log.warning("sandbox: could not remove %s", workdir)

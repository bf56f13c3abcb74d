"""Runs untrusted Python (a model's code answer) under limits and says how it ended.

A reward that runs model-written code must survive `while True: pass`, a fork bomb, a 10 GB
allocation, a socket call and a write to the trainer's files, and must tell those apart from
a wrong answer (verl's lesson: an infrastructure failure is not a score). `Sandbox.run` runs a
program on a stdin; `Sandbox.call` imports a program and calls one of its functions on JSON
arguments; `Sandbox.run_many` runs a batch in parallel within a time budget. Each returns a
`Result` whose `status` is one of `Status`; comparing the output with an expected one is the
caller's job (`code_env.py`).

Every run, in every mode:
- a fresh session and process group (`start_new_session=True`), killed with SIGKILL at the
  wall-clock deadline, when the output cap is hit, and after a normal exit (in a PID
  namespace its init first, so that every process is reaped by its own parent at once);
- rlimits set by the sandboxed interpreter itself before the program's first line (`_BOOT`):
  address space, CPU seconds, processes, file size, open files, core size 0. So the
  trainer (multithreaded: JAX) never forks with a `preexec_fn`, and the bwrap/unshare
  wrapper runs unlimited. RLIMIT_NPROC counts the processes of the program's uid: with an
  own uid (root) or in a user namespace (no root) those are the program's alone;
- a throwaway working directory, removed afterwards; an environment holding only PATH, HOME
  and TMPDIR (both the work directory) and LANG; the interpreter in isolated mode without
  `site` (`-I -S -B`: no PYTHONPATH, no site-packages, no user directory, no .pyc writes);
- stdout read up to a cap (the run stops there), the tail of stderr kept, never more;
- an audit hook installed before the program runs, refusing sockets, subprocesses, exec,
  signals to other processes, ctypes, and writes, renames or deletes outside the work
  directory. It turns casual mistakes into clear errors; a determined program can get past
  it (Python audit hooks are not a security boundary), so the modes below add kernel limits.

Modes, picked once by probing what works here (strongest first; `Sandbox.guarantees` says
which one was chosen and what holds):
- "bwrap" (hardened, when Debian's `bubblewrap` is installed): bwrap with new IPC, PID,
  network and UTS namespaces (and a user namespace unless root switches the uid), /usr and
  the interpreter's prefix bound read-only, a new /proc and /dev, and the work directory as
  the only writable path. No network (a new, empty network namespace), nothing of the
  host's files but the bound ones, and a PID namespace whose end kills every process the
  program started.
- "plain": when `unshare` (util-linux) can make namespaces here (as root, or with
  unprivileged user namespaces), the program runs in new network and PID namespaces: no
  network, and every descendant dies with the run. Files are not hidden: the program reads
  what its uid may read. Without `unshare`, no namespaces: only the process group is killed.
Run as root, both modes also switch the program to an unprivileged uid of its own
(`uid_base + slot`, checked to belong to no account): RLIMIT_NPROC does not apply to root,
so without this a fork bomb is bounded only by time; with it, file permissions refuse writes
to the trainer's files (bwrap: the read-only mounts do too), and without a PID namespace
every leftover process of that uid is killed after a run. The interpreter's standard library
must be readable by that uid: `sys.executable` is tried first, then the system's `python3`
(e.g. when the trainer's Python lives under a private /root, outside bwrap).

What no mode bounds: memory summed over a program's processes (each has the address-space
limit; at most `processes` of them), and disk writes inside the work directory beyond
RLIMIT_FSIZE per file (no quota). Without root, user namespaces and bwrap, "plain" leaves
the audit hook as the only guard of the network and of files, and RLIMIT_NPROC counts all
of the user's processes (the program may be unable to start threads at all).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import fcntl
import json
import logging
import math
import os
import pwd
import queue
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

_MARK = b"\x00marft-sandbox-started\x00"
_WORKDIR_IN_BWRAP = "/sandbox"
_KILL_GRACE_S = 5.0  # how long a killed process group may take to be reaped


class Status(str, enum.Enum):
  """How a run ended. Only OK runs have an output worth comparing."""

  OK = "ok"  # exited with status 0
  RUNTIME_ERROR = "runtime_error"  # non-zero exit or a signal (MemoryError, an exception, ...)
  TIMEOUT = "timeout"  # wall-clock deadline, CPU-time limit, or no budget left to start
  OUTPUT_LIMIT = "output_limit"  # stdout exceeded `Limits.stdout_bytes`
  SANDBOX_ERROR = "sandbox_error"  # the sandbox failed before the program started


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one run may use.

  wall_s: wall-clock seconds before the whole process group is killed.
  cpu_s: CPU seconds per process (RLIMIT_CPU); None: ceil(wall_s) + 1, a backstop only.
  memory_mb: address space per process (RLIMIT_AS), in MiB.
  processes: processes or threads the program may add to itself (RLIMIT_NPROC, see the
    module docstring for what it counts).
  file_mb: largest file the program may write (RLIMIT_FSIZE), in MiB.
  open_files: open file descriptors (RLIMIT_NOFILE).
  stdout_bytes: stdout beyond this ends the run with OUTPUT_LIMIT.
  stderr_bytes: how much of the end of stderr is kept.
  """

  wall_s: float = 5.0
  cpu_s: Optional[int] = None
  memory_mb: int = 1024
  processes: int = 4
  file_mb: int = 16
  open_files: int = 64
  stdout_bytes: int = 1 << 20
  stderr_bytes: int = 4096

  def __post_init__(self):
    if not (isinstance(self.wall_s, (int, float)) and 0 < self.wall_s < math.inf):
      raise ValueError(f"Limits.wall_s={self.wall_s!r}: must be a positive number of seconds")
    for key in ("memory_mb", "processes", "file_mb", "open_files", "stdout_bytes",
                "stderr_bytes") + (("cpu_s",) if self.cpu_s is not None else ()):
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Limits.{key}={value!r}: must be a positive int")
    if self.open_files < 16:
      raise ValueError(f"Limits.open_files={self.open_files}: the interpreter needs >= 16")

  @property
  def cpu_seconds(self) -> int:
    return self.cpu_s if self.cpu_s is not None else math.ceil(self.wall_s) + 1


@dataclasses.dataclass(frozen=True)
class Job:
  """One program to run: on `stdin`, or (`function` set) calling `function(*args)`."""

  source: str
  stdin: str = ""
  function: Optional[str] = None
  args: Sequence[Any] = ()


@dataclasses.dataclass(frozen=True)
class Result:
  """How one run ended.

  stdout: the program's stdout (for `call`: the function's return value as JSON), at most
    `Limits.stdout_bytes`; stderr: the last `Limits.stderr_bytes` of stderr.
  exit_code: the exit status; negative: killed by that signal; None: not started or not
    reaped. detail: why, for anything but OK (e.g. "wall-clock limit 2s").
  """

  status: Status
  stdout: str = ""
  stderr: str = ""
  exit_code: Optional[int] = None
  wall_s: float = 0.0
  detail: str = ""


# The program's first code, trusted, run by the sandboxed interpreter itself (so the trainer
# never forks with a preexec_fn, which is unsafe in a multithreaded process such as JAX's, and
# the limits and the uid switch hold only for the program, not for the bwrap/unshare wrapper):
# 1. the rlimits (argv[1] is the JSON that `_command` writes), lowered to this process's
#    hard limits where those are lower;
# 2. the switch to the program's own uid (as root), then a check that the interpreter's
#    standard library is readable by it (else the plan does not work: no start mark);
# 3. as PID 1 of a new PID namespace (`unshare --pid --fork`, `bwrap --as-pid-1`), an init:
#    the kernel drops default-action signals sent to a PID 1, so the CPU limit's SIGXCPU
#    would be lost and only the hard limit's SIGKILL would end the program, which util-linux
#    2.38 `unshare` then reports as exit 1 ("sigprocmask unblock failed": it cannot re-raise
#    SIGKILL on itself). The init forks the program, reaps every orphan, and exits with the
#    program's status, 128 + n for signal n; its exit ends the namespace. SIGTERM, the
#    sandbox's stop request (`_kill_namespace`), makes it exit (a PID 1 ignores it unless
#    it has a handler). Being reaped by its parent, it hands the program's CPU time up to
#    the wrapper's wait4 (bwrap's own init is not reaped by the outer bwrap: that time
#    would be lost);
# 4. a 4 MiB allocation: limits too tight for any program are the sandbox's failure;
# 5. the audit guard, the start mark on stderr (what came before it was the sandbox's), then
#    the program, run as __main__ ("run") or imported and called ("call", the result as JSON
#    on the real stdout while the program's own prints go to stderr).
_BOOT = r"""
import json, os, resource, sys
_cfg = json.loads(sys.argv[1])
for _name, _soft, _hard in _cfg["rlimits"]:
  _which = getattr(resource, _name)
  _ceiling = resource.getrlimit(_which)[1]
  if _ceiling != resource.RLIM_INFINITY:
    _soft, _hard = min(_soft, _ceiling), min(_hard, _ceiling)
  resource.setrlimit(_which, (_soft, _hard))
if _cfg["uid"] is not None:
  os.setgroups([])
  os.setgid(_cfg["uid"])
  os.setuid(_cfg["uid"])
  if not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
    sys.exit(f"{sys.executable}: standard library not readable by uid {_cfg['uid']}")
if _cfg["init"] and os.getpid() == 1:
  import signal
  signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
  _child = os.fork()
  if not _child:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
  else:
    while True:
      _pid, _status = os.wait()
      if _pid == _child:
        _code = os.waitstatus_to_exitcode(_status)
        os._exit(_code if _code >= 0 else 128 - _code)
_room = bytearray(4 << 20)  # limits that leave no room to work fail here, before the mark
del _room
_root = os.getcwd()
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_BANNED = frozenset(["subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
  "os.spawn", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
  "ctypes.dlsym/handle", "os.killpg"])
_PATHS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
  "os.symlink": (1,), "os.link": (0, 1), "os.truncate": (0,), "os.chmod": (0,),
  "os.chown": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,),
  "os.mknod": (0,)}
def _inside(path):
  if isinstance(path, int):
    return True
  try:
    path = os.path.realpath(os.fsdecode(path))
  except Exception:
    return False
  return path == _root or path.startswith(_root + os.sep) or path == os.devnull
def _guard(event, args):
  if event.startswith("socket."):
    raise PermissionError(f"{event}: the sandbox has no network")
  if event in _BANNED:
    raise PermissionError(f"{event}: not allowed in the sandbox")
  if event == "os.kill" and args[0] not in (0, os.getpid()):
    raise PermissionError("os.kill: only the program's own process may be signalled")
  if event == "open":
    path, mode, flags = args
    writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
        isinstance(flags, int) and flags > 0 and flags & _WRITE)
    if writes and not _inside(path):
      raise PermissionError(f"open({path!r}) for writing: outside the sandbox directory")
  elif event in _PATHS:
    for i in _PATHS[event]:
      if not _inside(args[i]):
        raise PermissionError(f"{event}({args[i]!r}): outside the sandbox directory")
if _cfg["guard"]:
  sys.addaudithook(_guard)
sys.stderr.buffer.write(__MARK__); sys.stderr.flush()
with open("main.py", encoding="utf-8") as _f:
  _code = compile(_f.read(), "main.py", "exec")
if _cfg["function"] is None:
  sys.argv = ["main.py"]
  exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
else:
  _args = json.loads(sys.stdin.read())
  sys.stdout.flush()
  _out = os.dup(1)
  os.dup2(2, 1)
  _g = {"__name__": "solution", "__builtins__": __builtins__}
  exec(_code, _g)
  _fn = _g.get(_cfg["function"])
  if _fn is None and isinstance(_g.get("Solution"), type):
    _fn = getattr(_g["Solution"](), _cfg["function"], None)
  if not callable(_fn):
    raise NameError(f"the program defines no function {_cfg['function']!r}")
  _value = _fn(*_args)
  sys.stdout.flush()
  with os.fdopen(_out, "w", encoding="utf-8") as _f:
    _f.write(json.dumps(_value, default=repr))
""".replace("__MARK__", repr(_MARK))


@dataclasses.dataclass(frozen=True)
class Plan:
  """How runs are wrapped here (`Sandbox.plan`, chosen by probing)."""

  mode: str  # "bwrap" or "plain"
  python: str  # interpreter, resolved to its real path
  drop_uid: bool  # run as an unprivileged uid of its own (only as root)
  namespaces: bool  # new network and PID namespaces (always true for bwrap)


def _has_init(plan: Plan) -> bool:
  """Whether the boot code becomes the init of a PID namespace (see `_BOOT`)."""
  return plan.namespaces


def _rlimits(limits: Limits, plan: Plan) -> list:
  """(name, soft, hard) for the boot code. RLIMIT_NPROC counts the program, the processes
  it may add, the init, and, without root, `unshare` (it joins the user namespace it makes,
  and there the limit counts that namespace's processes). The CPU hard limit is a second
  above the soft one: SIGXCPU at the soft limit ends the program (a TIMEOUT), SIGKILL at the
  hard one if it ignores that."""
  joins = plan.mode == "plain" and plan.namespaces and os.geteuid() != 0
  nproc = limits.processes + 1 + int(_has_init(plan)) + int(joins)
  cpu = limits.cpu_seconds
  return [("RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20),
          ("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_NPROC", nproc, nproc),
          ("RLIMIT_FSIZE", limits.file_mb << 20, limits.file_mb << 20),
          ("RLIMIT_NOFILE", limits.open_files, limits.open_files), ("RLIMIT_CORE", 0, 0)]


def _bwrap_binds(python: str) -> list[str]:
  """Read-only binds: /usr, the merged-/usr links (or directories), the interpreter's prefix."""
  args = ["--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
    if os.path.islink(top):
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  prefix = os.path.dirname(os.path.dirname(python))
  if prefix != "/usr" and not prefix.startswith("/usr/"):
    # bwrap would make the prefix's missing parents (e.g. /root) 0700, closed to the uid
    parents = []
    parent = os.path.dirname(prefix)
    while parent != os.path.dirname(parent):
      parents.insert(0, parent)
      parent = os.path.dirname(parent)
    for parent in parents:
      args += ["--perms", "0755", "--dir", parent]
    args += ["--ro-bind", prefix, prefix]
  return args


def _command(plan: Plan, uid: int, workdir: str, guard: bool, job: Job,
             limits: Limits) -> list[str]:
  """The argv of one run: the wrapper (bwrap, unshare or none), then the interpreter with
  the boot code and its configuration."""
  config = dict(rlimits=_rlimits(limits, plan), uid=uid if plan.drop_uid else None,
                init=_has_init(plan), guard=guard, function=job.function)
  inner = [plan.python, "-I", "-S", "-B", "-c", _BOOT, json.dumps(config)]
  if plan.mode == "bwrap":
    # Namespaces named one by one: bwrap run by root must not add a user namespace when the
    # boot code switches uid (it needs root's capabilities for that); in every other case a
    # user namespace keeps the program from holding capabilities of the host.
    unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try"] + ([] if plan.drop_uid else ["--unshare-user"])
    return ["bwrap", *unshare, "--as-pid-1", "--die-with-parent", "--new-session",
            *_bwrap_binds(plan.python), "--proc", "/proc", "--dev", "/dev",
            "--bind", workdir, _WORKDIR_IN_BWRAP, "--remount-ro", "/",
            "--chdir", _WORKDIR_IN_BWRAP, "--", *inner]
  if plan.namespaces:
    # Without root, a user namespace (mapped to the caller) lets unshare make the others.
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", *user, "--", *inner]
  return inner


class _Reader:
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
      at = self._head.find(_MARK)
      if at < 0 and len(self._head) < 65536:
        return
      self.started = at >= 0
      chunk = bytes(self._head[:at] + self._head[at + len(_MARK):] if at >= 0 else self._head)
      self._head = None
    self.err = (self.err + chunk)[-self.limits.stderr_bytes:]

  def stderr_text(self) -> str:
    return bytes(self.err + (self._head or b"")).decode("utf-8", "replace")

  def close(self):
    self._sel.close()
    for pipe in self._pipes:
      pipe.close()


class Sandbox:
  """Runs programs under `limits`, at most `max_parallel` at a time.

  mode: "auto" (bwrap where it works, else plain), "bwrap" (a ValueError where bwrap is
    missing), or "plain". python: the interpreter (None: `sys.executable`, then the
    system's `python3`). uid_base: as root, runs use unused uids from here on (no account
    has them; a lock file under the temp dir keeps other sandboxes off them; without a PID
    namespace, every process of such a uid is killed after a run). guard: the audit hook
    (tests turn it off to check what the kernel alone enforces). The mode is probed on
    first use; thread-safe; `close()` frees the worker threads and uids.
  """

  def __init__(self, limits: Limits = Limits(), *, mode: str = "auto", max_parallel: int = 2,
               python: Optional[str] = None, uid_base: int = 62000, guard: bool = True):
    if mode not in ("auto", "bwrap", "plain"):
      raise ValueError(f"Sandbox mode={mode!r}: must be 'auto', 'bwrap' or 'plain'")
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
      raise ValueError(f"Sandbox max_parallel={max_parallel!r}: must be a positive int")
    self.limits, self.mode, self.python, self.guard = limits, mode, python, guard
    self.uid_base, self.max_parallel = uid_base, max_parallel
    self._lock = threading.Lock()
    self._chosen: Optional[Plan] = None
    self._uids: queue.Queue = queue.Queue()
    self._leases: list = []
    self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

  # --- public API ---

  def run(self, source: str, stdin: str = "", *, timeout_s: Optional[float] = None) -> Result:
    """Runs `source` as a program reading `stdin`, within `timeout_s` (default
    `limits.wall_s`)."""
    return self._run(Job(source, stdin), timeout_s)

  def call(self, source: str, function: str, args: Sequence[Any] = (), *,
           timeout_s: Optional[float] = None) -> Result:
    """Runs `source` as a module, then `function(*args)` (or `Solution().function`); the
    return value comes back as JSON in `Result.stdout`, the program's prints in stderr."""
    return self._run(Job(source, function=function, args=tuple(args)), timeout_s)

  def run_many(self, jobs: Sequence[Job], *, timeout_s: Optional[float] = None,
               budget_s: Optional[float] = None) -> list[Result]:
    """Runs `jobs` in parallel (at most `max_parallel` at once), each within `timeout_s`;
    a job that cannot start before `budget_s` (from this call) is over is a TIMEOUT, and
    each job's wall limit is cut to what is left of the budget."""
    deadline = None if budget_s is None else time.monotonic() + budget_s

    def one(job):
      if deadline is None:
        return self._run(job, timeout_s)
      left = deadline - time.monotonic()
      if left <= 0.05:
        return Result(Status.TIMEOUT, detail=f"the {budget_s:g}s budget was spent")
      return self._run(job, left if timeout_s is None else min(left, timeout_s))

    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.max_parallel, "sandbox")
      pool = self._pool
    return list(pool.map(one, jobs))

  @property
  def plan(self) -> Plan:
    """The plan runs use here (probed on first use)."""
    return self._plan()

  @property
  def guarantees(self) -> tuple[str, ...]:
    """What holds for runs here, in words (probes the modes on first use)."""
    plan, out = self._plan(), []
    out += [f"mode={plan.mode}", f"python={plan.python}",
            "process group killed at the deadline; rlimits AS/CPU/NPROC/FSIZE/NOFILE/CORE"]
    if plan.mode == "bwrap":
      out.append("no network; only /usr, the interpreter's prefix and the work directory "
                 "visible; the work directory is the only writable path")
    elif plan.namespaces:
      out.append("no network (empty network namespace); host files readable by the uid")
    else:
      out.append("network and files guarded only by the audit hook" if self.guard else
                 "network and files NOT guarded")
    if plan.namespaces:
      out.append("PID namespace: every descendant dies with the program")
    if plan.drop_uid:
      out.append("own unprivileged uid: process count enforced, the trainer's files "
                 "protected by their permissions" + (
                     "" if plan.namespaces else ", the uid's leftover processes killed"))
    elif os.geteuid() == 0:
      out.append("runs as root: RLIMIT_NPROC is NOT enforced (a fork bomb is bounded by time)")
    return tuple(out)

  def close(self) -> None:
    """Stops the worker threads and frees the uids; a later run probes again."""
    with self._lock:
      if self._pool is not None:
        self._pool.shutdown(wait=True)
      for lease in self._leases:
        lease.close()
      self._pool, self._chosen, self._leases = None, None, []

  # --- choosing a plan ---

  def _plan(self) -> Plan:
    with self._lock:
      if self._chosen is None:
        uids = self._lease_uids() if os.geteuid() == 0 else []
        self._chosen = self._probe(uids[0] if uids else None)
        self._uids = queue.Queue()
        for uid in uids if self._chosen.drop_uid else [-1] * self.max_parallel:
          self._uids.put(uid)
        log.info("sandbox: %s", self._chosen)
      return self._chosen

  def _probe(self, uid: Optional[int]) -> Plan:
    """The strongest plan whose probe program runs and prints the right answer."""
    tried = []
    for plan in self._candidates(can_drop=uid is not None):
      result = self._execute(plan, uid if plan.drop_uid else -1, Job("print(6 * 7)"),
                             Limits(wall_s=20.0))
      if result.status == Status.OK and result.stdout.strip() == "42":
        return plan
      tried.append(f"{plan}: {result.status.value} {result.detail} {result.stderr[-300:]}")
    raise RuntimeError("no sandbox plan works here; tried:\n" + "\n".join(tried))

  def _candidates(self, can_drop: bool) -> list[Plan]:
    """Plans from strongest to weakest: an own uid first (without it a root fork bomb is
    unbounded), then bwrap, then namespaces; `sys.executable` before the system python."""
    pythons = [self.python] if self.python else [sys.executable, shutil.which(
        "python3", path="/usr/bin:/bin")]
    pythons = list(dict.fromkeys(os.path.realpath(p) for p in pythons if p))
    have_bwrap = shutil.which("bwrap") is not None
    if self.mode == "bwrap" and not have_bwrap:
      raise ValueError("Sandbox mode='bwrap': no bwrap on PATH (apt-get install bubblewrap)")
    layers = [("bwrap", True)] if have_bwrap and self.mode != "plain" else []
    if self.mode != "bwrap":
      layers += [("plain", True)] if shutil.which("unshare") else []
      layers += [("plain", False)]
    return [Plan(mode, python, drop, ns) for drop in ([True, False] if can_drop else [False])
            for mode, ns in layers for python in pythons]

  def _lease_uids(self) -> list[int]:
    """Claims `max_parallel` uids >= uid_base that no account has, each held by an flock on
    a file in a root-only directory for this sandbox's lifetime (other sandboxes, in this
    process or another, skip them). [] if the directory is not safely ours."""
    where = os.path.join(tempfile.gettempdir(), "marft-sandbox-uids")
    os.makedirs(where, mode=0o700, exist_ok=True)
    st = os.lstat(where)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
      log.warning("sandbox: %s is not a root-only directory; not switching uids", where)
      return []
    uids = []
    for uid in range(self.uid_base, self.uid_base + 4096):
      if len(uids) == self.max_parallel:
        break
      try:
        pwd.getpwuid(uid)
        continue  # an account's uid: its processes must never be swept
      except KeyError:
        pass
      lease = open(os.path.join(where, str(uid)), "a")
      try:
        fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        lease.close()
        continue
      uids.append(uid)
      self._leases.append(lease)
    return uids

  # --- one run ---

  def _run(self, job: Job, timeout_s: Optional[float]) -> Result:
    limits = self.limits
    if timeout_s is not None:
      limits = dataclasses.replace(limits, wall_s=max(timeout_s, 0.05))
    plan = self._plan()
    uid = self._uids.get()
    try:
      return self._execute(plan, uid, job, limits)
    except OSError as e:  # the host side failed (temp dir, disk full, ...), not the program
      return Result(Status.SANDBOX_ERROR, detail=f"{type(e).__name__}: {e}")
    finally:
      self._uids.put(uid)

  def _execute(self, plan: Plan, uid: int, job: Job, limits: Limits) -> Result:
    """Runs `job` in a fresh work directory (owned by `uid` when the plan switches to it)."""
    workdir = tempfile.mkdtemp(prefix="marft-sandbox-")
    try:
      with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
        f.write(job.source)
      if plan.drop_uid:
        os.chown(workdir, uid, uid)
        os.chown(os.path.join(workdir, "main.py"), uid, uid)
      stdin = job.stdin if job.function is None else json.dumps(list(job.args))
      return self._spawn(plan, uid, workdir, job, limits, stdin.encode("utf-8"))
    finally:
      _remove(workdir)

  def _spawn(self, plan, uid, workdir, job, limits, stdin: bytes) -> Result:
    argv = _command(plan, uid, workdir, self.guard, job, limits)
    home = _WORKDIR_IN_BWRAP if plan.mode == "bwrap" else workdir
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    start = time.monotonic()
    with tempfile.TemporaryFile() as stdin_file:  # a file, so no pipe to feed or deadlock
      stdin_file.write(stdin)
      stdin_file.seek(0)
      try:  # no preexec_fn and no uid switch here: the boot code does both (see _BOOT)
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=stdin_file,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
      except (OSError, subprocess.SubprocessError) as e:
        return Result(Status.SANDBOX_ERROR, detail=f"could not start {argv[0]}: {e}")
    return self._supervise(proc, plan, uid, limits, start)

  def _supervise(self, proc, plan, uid, limits, start) -> Result:
    """Reads until exit, the deadline or the output cap; then kills the namespace and the
    group (and, with an own uid but no namespace, every leftover of that uid) and reaps."""
    reader, timed_out, exited = _Reader(proc, limits), False, False
    deadline = start + limits.wall_s
    try:
      while not reader.overflow:
        left = deadline - time.monotonic()
        if left <= 0:
          timed_out = True
          break
        reader.pump(min(left, 0.05))
        if _exited(proc.pid):
          exited = True
          break
    finally:
      if plan.namespaces and not exited:
        _kill_namespace(proc.pid)
      _kill_group(proc.pid)
      code, cpu_s = _reap(proc)
      if plan.drop_uid and (not plan.namespaces or code is None):
        # Descendants that left the group (they may hold the pipes open), or a stuck
        # wrapper whose namespace may not be empty. After the reap: the sweep waits until
        # no process of the uid is left, and our zombie child would be one.
        self._kill_uid(uid)
      reader.drain(0.5)
      reader.close()
    return _verdict(reader, code, timed_out, limits, plan, time.monotonic() - start, cpu_s)

  def _kill_uid(self, uid: int):
    """Kills every process of `uid` (descendants that left the group, a namespace still being
    torn down) and waits until none is left, zombies included, so that the next run of this
    uid starts with its whole RLIMIT_NPROC allowance. kill(-1) from a process of that uid
    reaches exactly those; the helper starts as root (the plan's interpreter may not be
    executable by the uid outside bwrap) and switches uid itself."""
    try:
      done = subprocess.run([sys.executable, "-I", "-S", "-c", _KILL_ALL, str(uid)], env={},
                            timeout=_KILL_GRACE_S, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
      if done.returncode != 0:
        log.warning("sandbox: leftover processes of uid %d: %s", uid,
                    done.stderr.decode("utf-8", "replace")[-300:])
    except (OSError, subprocess.SubprocessError) as e:
      log.warning("sandbox: could not kill leftover processes of uid %d: %s", uid, e)


# SIGKILL to every process of the uid until /proc shows none of it, zombies included (they
# count against RLIMIT_NPROC until reaped: by the host's init, for orphans, which can lag).
# kill(-1) cannot say when none is left: it succeeds while any other process exists.
_KILL_ALL = r"""
import os, sys, time
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
def any_left():
  for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
      continue
    try:
      with open(f"/proc/{pid}/status") as f:
        real = next(line for line in f if line.startswith("Uid:")).split()[1]
    except (OSError, StopIteration):
      continue  # exited meanwhile
    if int(real) == uid:
      return True
  return False
until = time.monotonic() + 2.0
while time.monotonic() < until:
  os.kill(-1, 9)
  if not any_left():
    sys.exit(0)
  time.sleep(0.005)
sys.exit("processes still there after 2 s of SIGKILL")
"""


def _exited(pid: int) -> bool:
  """Whether the child has exited, leaving it a zombie so its process group id stays taken
  until `_kill_group` has run."""
  try:
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
  except ChildProcessError:
    return True
  return info is not None


def _reap(proc) -> tuple[Optional[int], Optional[float]]:
  """(exit status, CPU seconds of the process and the descendants it reaped: the wrapper's
  count includes the program's), or (None, None) if the killed process is not gone within the
  grace period (left to subprocess's own reaping of abandoned children)."""
  deadline = time.monotonic() + _KILL_GRACE_S
  while True:
    try:
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere
      return proc.returncode, None
    if pid:
      proc.returncode = os.waitstatus_to_exitcode(status)
      return proc.returncode, usage.ru_utime + usage.ru_stime
    if time.monotonic() > deadline:
      log.warning("sandbox: pid %d not reaped %gs after SIGKILL", proc.pid, _KILL_GRACE_S)
      return None, None
    time.sleep(0.01)


def _kill_namespace(wrapper: int):
  """Stops the init of the run's PID namespace (the wrapper's child), then waits for the
  wrapper to exit. The init's end kills every process of the namespace, each reaped by its
  own parent up to the wrapper, which the caller reaps. Killing the wrapper first would
  orphan the init to the host's init, whose reaping can lag (about a second on a Firecracker
  VM), while the uid's processes still count against RLIMIT_NPROC and the next run of that
  uid cannot start. SIGTERM first: the boot code's init exits on it with a status the
  wrapper passes on, whereas a SIGKILLed child makes util-linux `unshare` print an error."""
  for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, _KILL_GRACE_S)):
    if not _signal_children(wrapper, sig):
      return  # none (the wrapper is gone or has not forked yet): the group kill follows
    until = time.monotonic() + wait_s
    while time.monotonic() < until:
      if _exited(wrapper):
        return
      time.sleep(0.002)


def _signal_children(parent: int, sig: int) -> bool:
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
      if _parent_of(pid) == parent:
        signal.pidfd_send_signal(fd, sig)
    except OSError:
      pass  # exited meanwhile
    finally:
      os.close(fd)
  return bool(children)


def _parent_of(pid: int) -> Optional[int]:
  """The parent pid from /proc/<pid>/stat (its fourth field, after the command name)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
      return int(f.read().rsplit(")", 1)[1].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def _kill_group(pgid: int):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # the group is already gone (PermissionError: macOS reports a zombie group so)


def _signal_of(code: Optional[int], plan: Plan) -> Optional[int]:
  """The signal that ended the program; in a PID namespace the boot code's init reports it
  as exit status 128 + n."""
  if code is None:
    return None
  if code < 0:
    return -code
  wrapped = plan.mode == "bwrap" or plan.namespaces
  return code - 128 if wrapped and 128 < code < 128 + 65 else None


def _verdict(reader: _Reader, code, timed_out, limits: Limits, plan: Plan, wall,
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
  sig = _signal_of(code, plan)
  # SIGXCPU at the soft CPU limit; SIGKILL at the hard one, a second later, if the program
  # ignored SIGXCPU: told apart from another SIGKILL by the CPU time it had used.
  hard_cpu_kill = sig == signal.SIGKILL and cpu_s is not None and cpu_s >= limits.cpu_seconds
  if sig == signal.SIGXCPU or hard_cpu_kill:
    return Result(Status.TIMEOUT, detail=f"CPU limit {limits.cpu_seconds}s", **record)
  if code == 0:
    return Result(Status.OK, **record)
  why = f"killed by signal {sig}" if sig else f"exit status {code}"
  return Result(Status.RUNTIME_ERROR, detail=why, **record)


def _remove(workdir: str):
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

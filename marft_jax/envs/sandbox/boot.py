"""The boot program: the first code of every sandboxed interpreter, run before the program's.

The runner starts `python -I -S -B -c <this file's source> <config JSON>` (`isolation.command`)
in the run's work directory, which holds the program as `main.py`. The source travels on the
command line rather than as a path: inside bwrap, or as the program's own uid, this package's
folder may be invisible or unreadable. So this file imports the standard library only, and
nothing happens on import (tests import it to check its parts).

Why the sandboxed interpreter does this itself: the trainer never forks with a `preexec_fn`
(unsafe in a multithreaded process such as JAX's), and the limits and the uid switch hold for
the program only, not for the bwrap/unshare wrapper. In order (`main`):

1. the rlimits of the config, lowered to this process's hard limits where those are lower
   (`set_limits`);
2. as root, the switch to the program's own uid, then a check that the interpreter's standard
   library is readable by it (else the plan does not work here: no start mark, `switch_uid`);
3. as PID 1 of a new PID namespace (`unshare --pid --fork`, `bwrap --as-pid-1`), an init
   (`become_init`): the kernel drops default-action signals sent to a PID 1, so the CPU
   limit's SIGXCPU would be lost and only the hard limit's SIGKILL would end the program,
   which util-linux 2.38 `unshare` then reports as exit 1 ("sigprocmask unblock failed": it
   cannot re-raise SIGKILL on itself). The init forks the program, reaps every orphan, and
   exits with the program's status, 128 + n for signal n; its exit ends the namespace.
   SIGTERM, the runner's stop request (`process.kill_namespace`), makes it exit (a PID 1
   ignores it unless it has a handler). Being reaped by its parent, it hands the program's
   CPU time up to the wrapper's wait4 (bwrap's own init is not reaped by the outer bwrap:
   that time would be lost);
4. a 4 MiB allocation: limits too tight for any program are the sandbox's failure;
5. the audit guard (`Guard`), then `MARK` on stderr (what came before it was the sandbox's
   own output), then the program: run as `__main__` ("run"), or imported and its function
   called on the JSON arguments read from stdin ("call"; the return value goes as JSON to the
   real stdout while the program's own prints go to stderr), or run with its assert test by
   the harness of `asserts.py` ("test": the job is read from stdin, which is then replaced by
   /dev/null, before the program starts).

The config (JSON, `sys.argv[1]`): `rlimits` [[name, soft, hard], ...] (names of the
`resource` module), `uid` (int or null), `init` (bool), `guard` (bool), `function` (str or
null), `harness` (the source of `asserts.py` for a test job, else null).
"""

import builtins
import json
import os
import resource
import signal
import sys

# Written to stderr just before the program's first line: the runner tells the sandbox's own
# failures (no mark) from the program's. Being in this source, it is also on the command line
# of every sandboxed interpreter, which is how tests find leftover processes.
MARK = b"\x00marft-sandbox-started\x00"

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Audit events refused outright.
BANNED = frozenset(["subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                    "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
                    "ctypes.dlsym/handle", "os.killpg"])
# Audit events that change the file system: the positions of their path arguments.
PATH_ARGS = {"os.remove": (0,), "os.rename": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
             "os.symlink": (1,), "os.link": (0, 1), "os.truncate": (0,), "os.chmod": (0,),
             "os.chown": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,),
             "os.mknod": (0,)}


def set_limits(rlimits):
  """Sets each (name, soft, hard) rlimit, both lowered to the current hard limit if that is
  lower (an unprivileged process cannot raise it)."""
  for name, soft, hard in rlimits:
    which = getattr(resource, name)
    ceiling = resource.getrlimit(which)[1]
    if ceiling != resource.RLIM_INFINITY:
      soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(which, (soft, hard))


def switch_uid(uid):
  """Becomes `uid` (group too, no supplementary groups); exits with a message if the
  interpreter's standard library is then unreadable."""
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)
  if not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
    sys.exit(f"{sys.executable}: standard library not readable by uid {uid}")


def become_init():
  """As PID 1: forks; the child returns and runs the program, the parent reaps every process
  and exits with the child's status (128 + n for signal n), or on SIGTERM."""
  signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
  child = os.fork()
  if not child:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return
  while True:
    pid, status = os.wait()
    if pid == child:
      code = os.waitstatus_to_exitcode(status)
      os._exit(code if code >= 0 else 128 - code)


def inside(path, root):
  """Whether `path` (a str, bytes or a file descriptor) resolves into `root` or is the null
  device; a descriptor counts as inside (it was opened under the guard already)."""
  if isinstance(path, int):
    return True
  try:
    path = os.path.realpath(os.fsdecode(path))
  except Exception:  # pylint: disable=broad-except  # anything odd counts as outside
    return False
  return path == root or path.startswith(root + os.sep) or path == os.devnull


def opens_for_writing(mode, flags):
  """Whether an `open` audit event's mode string or os.open flags ask to write."""
  if isinstance(mode, str) and any(c in mode for c in "wax+"):
    return True
  return isinstance(flags, int) and flags > 0 and bool(flags & _WRITE_FLAGS)


class Guard:
  """The audit hook: refuses sockets, subprocesses, exec, signals to other processes, ctypes,
  and writes, renames or deletes outside `root`, each with a PermissionError naming it. It
  turns casual mistakes into clear errors; Python audit hooks are not a security boundary."""

  def __init__(self, root):
    self.root = root

  def __call__(self, event, args):
    if event.startswith("socket."):
      raise PermissionError(f"{event}: the sandbox has no network")
    if event in BANNED:
      raise PermissionError(f"{event}: not allowed in the sandbox")
    if event == "os.kill" and args[0] not in (0, os.getpid()):
      raise PermissionError("os.kill: only the program's own process may be signalled")
    if event == "open":
      path, mode, flags = args
      if opens_for_writing(mode, flags) and not inside(path, self.root):
        raise PermissionError(f"open({path!r}) for writing: outside the sandbox directory")
    elif event in PATH_ARGS:
      for i in PATH_ARGS[event]:
        if not inside(args[i], self.root):
          raise PermissionError(f"{event}({args[i]!r}): outside the sandbox directory")


def run_program(function):
  """Runs ./main.py as `__main__`, or (`function` set) imports it and writes
  `function(*args)` (or `Solution().function`), args from stdin, as JSON to stdout."""
  with open("main.py", encoding="utf-8") as f:
    code = compile(f.read(), "main.py", "exec")
  if function is None:
    sys.argv = ["main.py"]
    exec(code, {"__name__": "__main__", "__builtins__": builtins})  # pylint: disable=exec-used
    return
  args = json.loads(sys.stdin.read())
  sys.stdout.flush()
  real_stdout = os.dup(1)
  os.dup2(2, 1)  # the program's prints go to stderr
  scope = {"__name__": "solution", "__builtins__": builtins}
  exec(code, scope)  # pylint: disable=exec-used
  fn = scope.get(function)
  if fn is None and isinstance(scope.get("Solution"), type):
    fn = getattr(scope["Solution"](), function, None)
  if not callable(fn):
    raise NameError(f"the program defines no function {function!r}")
  value = fn(*args)
  sys.stdout.flush()
  with os.fdopen(real_stdout, "w", encoding="utf-8") as f:
    f.write(json.dumps(value, default=repr))


def read_stdin():
  """All of stdin, read raw; fd 0 is then /dev/null, so the program cannot read it again
  (stdin is a file the program could otherwise seek back in)."""
  chunks = []
  while True:
    chunk = os.read(0, 1 << 16)
    if not chunk:
      break
    chunks.append(chunk)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  return b"".join(chunks)


def main(argv):
  config = json.loads(argv[1])
  set_limits(config["rlimits"])
  if config["uid"] is not None:
    switch_uid(config["uid"])
  if config["init"] and os.getpid() == 1:
    become_init()
  room = bytearray(4 << 20)  # limits that leave no room to work fail here, before the mark
  del room
  if config["guard"]:
    sys.addaudithook(Guard(os.getcwd()))
  harness = None
  if config.get("harness"):
    job = read_stdin()
    harness = {"__name__": "marft_harness", "__builtins__": dict(vars(builtins))}
    exec(compile(config["harness"], "asserts.py", "exec"), harness)  # pylint: disable=exec-used
  sys.stderr.buffer.write(MARK)
  sys.stderr.flush()
  if harness is not None:
    harness["run"](job)  # never returns
  run_program(config["function"])


if __name__ == "__main__":
  main(sys.argv)

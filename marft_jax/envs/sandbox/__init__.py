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
- rlimits set by the sandboxed interpreter itself before the program's first line (`boot.py`):
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
which one was chosen and what holds; a plan weaker than the mode's best, e.g. "plain" in
"auto" mode because bwrap is missing, is logged as a warning and named by
`Sandbox.fallback`, which the code environment reports as the metric
`code_sandbox_fallback`):
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

The package, one concern a file:

  job        Job, Limits (what a run is given), Result, Status (how it ended)
  boot       the boot program, the sandboxed interpreter's first code (standard library only)
  kill_uid   the helper program that sweeps a uid's leftover processes
  isolation  Plan, the modes from strongest to weakest, fallbacks, one run's command line
  process    supervising one run: pipes, deadline, kill, reap, the verdict
  runner     Sandbox: probing, uids, parallel runs within a budget
"""

from marft_jax.envs.sandbox.isolation import Plan
from marft_jax.envs.sandbox.job import Job, Limits, Result, Status
from marft_jax.envs.sandbox.runner import MODES, Sandbox

__all__ = ["Job", "Limits", "MODES", "Plan", "Result", "Sandbox", "Status"]

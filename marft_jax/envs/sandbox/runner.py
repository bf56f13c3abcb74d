"""`Sandbox`: runs jobs under limits in the plan probed here, in parallel, within budgets."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import json
import logging
import os
import pwd
import queue
import secrets
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

from marft_jax.envs.sandbox import isolation, process
from marft_jax.envs.sandbox.isolation import Plan
from marft_jax.envs.sandbox.job import Job, Limits, Result, Status

log = logging.getLogger("marft_jax.envs.sandbox")

MODES = ("auto", "bwrap", "plain")


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
    if mode not in MODES:
      raise ValueError(f"Sandbox mode={mode!r}: must be one of {MODES}")
    if isinstance(max_parallel, bool) or not isinstance(max_parallel, int) or max_parallel < 1:
      raise ValueError(f"Sandbox max_parallel={max_parallel!r}: must be a positive int")
    self.limits, self.mode, self.python, self.guard = limits, mode, python, guard
    self.uid_base, self.max_parallel = uid_base, max_parallel
    self._lock = threading.Lock()
    self._chosen: Optional[Plan] = None
    self._fallback: Optional[str] = None
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
               budget_s: Optional[float] = None, parallel: Optional[int] = None
               ) -> list[Result]:
    """Runs `jobs` in parallel, each within `timeout_s`; a job that cannot start before
    `budget_s` (from this call) is over is a TIMEOUT, and each job's wall limit is cut to
    what is left of the budget. `parallel`: this call's jobs at once (default and at most
    `max_parallel`, the sandbox's own bound over all calls): calls from several threads, each
    with `parallel` ≤ max_parallel / threads, run as each would alone."""
    if parallel is not None and (isinstance(parallel, bool) or not isinstance(parallel, int)
                                 or parallel < 1):
      raise ValueError(f"run_many parallel={parallel!r}: must be a positive int")
    deadline = None if budget_s is None else time.monotonic() + budget_s

    def one(job):
      if deadline is None:
        return self._run(job, timeout_s)
      left = deadline - time.monotonic()
      if left <= 0.05:
        return Result(Status.TIMEOUT, detail=f"the {budget_s:g}s budget was spent")
      return self._run(job, left if timeout_s is None else min(left, timeout_s))

    if parallel is not None and parallel < min(self.max_parallel, len(jobs)):
      with concurrent.futures.ThreadPoolExecutor(parallel, "sandbox-call") as own:
        return list(own.map(one, jobs))
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
  def fallback(self) -> Optional[str]:
    """Why the plan here is weaker than `mode`'s best (`isolation.fallback`), or None;
    probes on first use. A fallback is logged as a warning when the plan is chosen."""
    self._plan()
    return self._fallback

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
        self._chosen, failures = self._probe(uids[0] if uids else None)
        self._uids = queue.Queue()
        for uid in uids if self._chosen.drop_uid else [-1] * self.max_parallel:
          self._uids.put(uid)
        self._fallback = isolation.fallback(self.mode, self._chosen, failures)
        if self._fallback:
          log.warning("sandbox: weaker isolation than mode=%r can give: %s", self.mode,
                      self._fallback)
        else:
          log.info("sandbox: %s", self._chosen)
      return self._chosen

  def _probe(self, uid: Optional[int]) -> tuple[Plan, list[tuple[Plan, str]]]:
    """The strongest plan whose probe program runs and prints the right answer, and the
    plans tried before it with how their probes failed."""
    tried = []
    for plan in isolation.candidates(self.mode, self.python, can_drop=uid is not None):
      result = self._execute(plan, uid if plan.drop_uid else -1, Job("print(6 * 7)"),
                             Limits(wall_s=20.0))
      if result.status == Status.OK and result.stdout.strip() == "42":
        return plan, tried
      tried.append((plan, f"{result.status.value} {result.detail} {result.stderr[-300:]}"))
    raise RuntimeError("no sandbox plan works here; tried:\n" + "\n".join(
        f"{plan}: {why}" for plan, why in tried))

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
      if job.test is not None:  # the nonce that authenticates the harness's verdict
        nonce = secrets.token_hex(16)
        stdin = json.dumps({"nonce": nonce, "test": job.test, "setup": job.setup,
                            "entry_point": job.function})
        return test_verdict(self._spawn(plan, uid, workdir, job, limits,
                                        stdin.encode("utf-8")), nonce)
      stdin = job.stdin if job.function is None else json.dumps(list(job.args))
      return self._spawn(plan, uid, workdir, job, limits, stdin.encode("utf-8"))
    finally:
      process.remove_workdir(workdir)

  def _spawn(self, plan, uid, workdir, job, limits, stdin: bytes) -> Result:
    argv = isolation.command(plan, uid, workdir, self.guard, job, limits)
    home = isolation.WORKDIR_IN_BWRAP if plan.mode == "bwrap" else workdir
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
    start = time.monotonic()
    with tempfile.TemporaryFile() as stdin_file:  # a file, so no pipe to feed or deadlock
      stdin_file.write(stdin)
      stdin_file.seek(0)
      try:  # no preexec_fn and no uid switch here: the boot program does both
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=stdin_file,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, close_fds=True)
      except (OSError, subprocess.SubprocessError) as e:
        return Result(Status.SANDBOX_ERROR, detail=f"could not start {argv[0]}: {e}")
    return self._supervise(proc, plan, uid, limits, start)

  def _supervise(self, proc, plan, uid, limits, start) -> Result:
    """Reads until exit, the deadline or the output cap; then kills the namespace and the
    group (and, with an own uid but no namespace, every leftover of that uid) and reaps."""
    reader, timed_out, exited = process.Reader(proc, limits), False, False
    deadline = start + limits.wall_s
    try:
      while not reader.overflow:
        left = deadline - time.monotonic()
        if left <= 0:
          timed_out = True
          break
        reader.pump(min(left, 0.05))
        if process.exited(proc.pid):
          exited = True
          break
    finally:
      if plan.namespaces and not exited:
        process.kill_namespace(proc.pid)
      process.kill_group(proc.pid)
      code, cpu_s = process.reap(proc)
      if plan.drop_uid and (not plan.namespaces or code is None):
        # Descendants that left the group (they may hold the pipes open), or a stuck
        # wrapper whose namespace may not be empty. After the reap: the sweep waits until
        # no process of the uid is left, and our zombie child would be one.
        self._kill_uid(uid)
      reader.drain(0.5)
      reader.close()
    return process.verdict(reader, code, timed_out, limits, plan, time.monotonic() - start, cpu_s)

  def _kill_uid(self, uid: int):
    """Kills every process of `uid` (descendants that left the group, a namespace still being
    torn down) and waits until none is left, zombies included, so that the next run of this
    uid starts with its whole RLIMIT_NPROC allowance. kill(-1) from a process of that uid
    reaches exactly those; the helper starts as root (the plan's interpreter may not be
    executable by the uid outside bwrap) and switches uid itself."""
    try:
      argv = [sys.executable, "-I", "-S", "-c", isolation.program_source("kill_uid"),
              str(uid)]
      done = subprocess.run(argv, env={}, timeout=process.KILL_GRACE_S, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
      if done.returncode != 0:
        log.warning("sandbox: leftover processes of uid %d: %s", uid,
                    done.stderr.decode("utf-8", "replace")[-300:])
    except (OSError, subprocess.SubprocessError) as e:
      log.warning("sandbox: could not kill leftover processes of uid %d: %s", uid, e)



TEST_VERDICTS = ("passed", "wrong", "runtime_error")


def test_verdict(result: Result, nonce: str) -> Result:
  """`result` with the harness's verdict (`Result.test`) and its detail, taken from the first
  stdout line that starts with the run's `nonce` (only a run that exited normally); that line
  is removed from stdout. Anything else the program wrote there stays and counts for nothing."""
  if result.status != Status.OK:
    return result
  lines = result.stdout.splitlines()
  for i, line in enumerate(lines):
    if line.startswith(nonce + " "):
      verdict, _, detail = line[len(nonce) + 1:].partition(" ")
      if verdict not in TEST_VERDICTS:
        break
      return dataclasses.replace(result, test=verdict, detail=detail.strip(),
                                 stdout="\n".join(lines[:i] + lines[i + 1:]))
  return result

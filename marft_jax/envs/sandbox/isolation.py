"""Isolation modes: how a run is wrapped (bwrap, unshare or nothing), strongest first.

A `Plan` is one way to run here; `candidates` lists the plans a `Sandbox` mode may use, from
the strongest to the weakest, and the runner takes the first whose probe program works.
`fallback` says when that plan is weaker than the mode's best (bwrap missing, namespaces or
the uid switch refused here): the runner logs it as a warning and the code environment
reports it as a metric. `command` builds one run's argv: the wrapper, then the interpreter
running the boot program (`boot.py`) with its configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
import shutil
import sys
from typing import Optional, Sequence

from marft_jax.envs.sandbox.job import Job, Limits

WORKDIR_IN_BWRAP = "/sandbox"


@functools.lru_cache(maxsize=None)
def program_source(name: str) -> str:
  """The source of this package's helper program `name` ("boot" or "kill_uid"): run with
  `python -c`, since the program's uid or bwrap may not see this package's folder."""
  return importlib.resources.files(__package__).joinpath(f"{name}.py").read_text("utf-8")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How runs are wrapped here (`Sandbox.plan`, chosen by probing `candidates`)."""

  mode: str  # "bwrap" or "plain"
  python: str  # interpreter, resolved to its real path
  drop_uid: bool  # run as an unprivileged uid of its own (only as root)
  namespaces: bool  # new network and PID namespaces (always true for bwrap)


def has_init(plan: Plan) -> bool:
  """Whether the boot code becomes the init of a PID namespace (`boot.become_init`)."""
  return plan.namespaces


def rlimits(limits: Limits, plan: Plan) -> list:
  """(name, soft, hard) for the boot program. RLIMIT_NPROC counts the program, the processes
  it may add, the init, and, without root, `unshare` (it joins the user namespace it makes,
  and there the limit counts that namespace's processes). The CPU hard limit is a second
  above the soft one: SIGXCPU at the soft limit ends the program (a TIMEOUT), SIGKILL at the
  hard one if it ignores that."""
  joins = plan.mode == "plain" and plan.namespaces and os.geteuid() != 0
  nproc = limits.processes + 1 + int(has_init(plan)) + int(joins)
  cpu = limits.cpu_seconds
  return [("RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20),
          ("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_NPROC", nproc, nproc),
          ("RLIMIT_FSIZE", limits.file_mb << 20, limits.file_mb << 20),
          ("RLIMIT_NOFILE", limits.open_files, limits.open_files), ("RLIMIT_CORE", 0, 0)]


def bwrap_binds(python: str) -> list[str]:
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


def command(plan: Plan, uid: int, workdir: str, guard: bool, job: Job,
             limits: Limits) -> list[str]:
  """The argv of one run: the wrapper (bwrap, unshare or none), then the interpreter with
  the boot code and its configuration."""
  config = dict(rlimits=rlimits(limits, plan), uid=uid if plan.drop_uid else None,
                init=has_init(plan), guard=guard, function=job.function,
                harness=program_source("asserts") if job.test is not None else None)
  inner = [plan.python, "-I", "-S", "-B", "-c", program_source("boot"), json.dumps(config)]
  if plan.mode == "bwrap":
    # Namespaces named one by one: bwrap run by root must not add a user namespace when the
    # boot code switches uid (it needs root's capabilities for that); in every other case a
    # user namespace keeps the program from holding capabilities of the host.
    unshare = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
               "--unshare-cgroup-try"] + ([] if plan.drop_uid else ["--unshare-user"])
    return ["bwrap", *unshare, "--as-pid-1", "--die-with-parent", "--new-session",
            *bwrap_binds(plan.python), "--proc", "/proc", "--dev", "/dev",
            "--bind", workdir, WORKDIR_IN_BWRAP, "--remount-ro", "/",
            "--chdir", WORKDIR_IN_BWRAP, "--", *inner]
  if plan.namespaces:
    # Without root, a user namespace (mapped to the caller) lets unshare make the others.
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", *user, "--", *inner]
  return inner


def candidates(mode: str, python: Optional[str], can_drop: bool) -> list[Plan]:
  """Plans from strongest to weakest for Sandbox mode `mode`: an own uid first (without it a
  root fork bomb is unbounded), then bwrap, then namespaces; `sys.executable` before the
  system python (unless `python` names the interpreter)."""
  pythons = [python] if python else [sys.executable, shutil.which("python3",
                                                                   path="/usr/bin:/bin")]
  pythons = list(dict.fromkeys(os.path.realpath(p) for p in pythons if p))
  have_bwrap = shutil.which("bwrap") is not None
  if mode == "bwrap" and not have_bwrap:
    raise ValueError("Sandbox mode='bwrap': no bwrap on PATH (apt-get install bubblewrap)")
  layers = [("bwrap", True)] if have_bwrap and mode != "plain" else []
  if mode != "bwrap":
    layers += [("plain", True)] if shutil.which("unshare") else []
    layers += [("plain", False)]
  return [Plan(mode_, python_, drop, ns) for drop in ([True, False] if can_drop else [False])
          for mode_, ns in layers for python_ in pythons]


def strength(plan: Plan) -> tuple[bool, bool, bool]:
  """Orders plans by isolation (the interpreter does not count): an own uid, then bwrap,
  then namespaces."""
  return plan.drop_uid, plan.mode == "bwrap", plan.namespaces


def fallback(mode: str, chosen: Plan,
             failures: Sequence[tuple[Plan, str]] = ()) -> Optional[str]:
  """Why `chosen` is weaker than the best plan of Sandbox mode `mode` ("auto" and "bwrap":
  bwrap; "plain": namespaces; as root, both with an own uid), in words; None if it is the
  best. `failures`: (plan, why its probe failed) of the plans tried before `chosen`; the
  stronger ones are named in the message."""
  best = (os.geteuid() == 0, mode != "plain", True)
  if strength(chosen) >= best:
    return None
  missing = []
  if best[0] and not chosen.drop_uid:
    missing.append("no own uid (RLIMIT_NPROC not enforced for root: a fork bomb is bounded "
                   "by time only)")
  if best[1] and chosen.mode != "bwrap":
    missing.append("no bwrap (host files visible to the program)" if shutil.which("bwrap")
                   else "bwrap is not installed (apt-get install bubblewrap; host files "
                   "visible to the program)")
  if not chosen.namespaces:
    missing.append("no network or PID namespace (unshare " + (
        "failed here)" if shutil.which("unshare") else "is not installed)"))
  tried = "; ".join(f"{plan.mode} namespaces={plan.namespaces} own uid={plan.drop_uid}: "
                    f"{why.strip()[:200]}" for plan, why in failures
                    if strength(plan) > strength(chosen))
  return (f"mode={chosen.mode}, namespaces={chosen.namespaces}, own uid={chosen.drop_uid}: "
          + "; ".join(missing) + (f" (failed probes: {tried})" if tried else ""))

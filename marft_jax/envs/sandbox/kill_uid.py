"""A helper program: SIGKILL every process of a uid until /proc shows none of it.

Run by the runner as root (`python -I -S -c <this file's source> <uid>`) after a run with an
own uid but no PID namespace; it switches to the uid itself, so that `kill(-1)` reaches that
uid's processes only. Zombies are waited for too: they count against RLIMIT_NPROC until
reaped (by the host's init, for orphans, which can lag), and `kill(-1)` cannot say when none
is left (it succeeds while any other process exists). Exits 0 when none is left, else with a
message after 2 s. Standard library only; nothing happens on import.
"""

import os
import signal
import sys
import time


def uid_of(pid):
  """The real uid of process `pid`, or None if it is gone."""
  try:
    # Bytes: decoding would import a codec as the uid, which may not read the library.
    with open(f"/proc/{pid}/status", "rb") as f:
      return int(next(line for line in f if line.startswith(b"Uid:")).split()[1])
  except (OSError, StopIteration, ValueError):
    return None  # exited meanwhile


def any_left(uid):
  """Whether a process of `uid` other than this one is in /proc."""
  own = os.getpid()
  return any(name.isdigit() and int(name) != own and uid_of(name) == uid
             for name in os.listdir("/proc"))


def main(argv):
  uid = int(argv[1])
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)
  until = time.monotonic() + 2.0
  while time.monotonic() < until:
    os.kill(-1, signal.SIGKILL)
    if not any_left(uid):
      sys.exit(0)
    time.sleep(0.005)
  sys.exit("processes still there after 2 s of SIGKILL")


if __name__ == "__main__":
  main(sys.argv)

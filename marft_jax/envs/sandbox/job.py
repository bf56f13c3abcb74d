"""What one sandboxed run is given (`Job`, `Limits`) and how it ended (`Result`, `Status`)."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Optional, Sequence


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
  """One program to run: on `stdin`, or (`function` set) calling `function(*args)`, or
  (`test` set) with its assert test: `test` (Python source: asserts, or a `check(candidate)`
  that is called with `function`) runs after `setup` (trusted code run in the test's
  namespace, e.g. HumanEval's prompt with its helpers), by the harness of `asserts.py`."""

  source: str
  stdin: str = ""
  function: Optional[str] = None
  args: Sequence[Any] = ()
  test: Optional[str] = None
  setup: str = ""


@dataclasses.dataclass(frozen=True)
class Result:
  """How one run ended.

  stdout: the program's stdout (for `call`: the function's return value as JSON), at most
    `Limits.stdout_bytes`; stderr: the last `Limits.stderr_bytes` of stderr.
  exit_code: the exit status; negative: killed by that signal; None: not started or not
    reaped. detail: why, for anything but OK (e.g. "wall-clock limit 2s"), or the test's.
  test: for a test job that ran to its end, the harness's verdict ("passed", "wrong",
    "runtime_error"), authenticated by the run's nonce; "" if it gave none (the program
    ended the process first, or the run failed).
  """

  status: Status
  stdout: str = ""
  stderr: str = ""
  exit_code: Optional[int] = None
  wall_s: float = 0.0
  detail: str = ""
  test: str = ""


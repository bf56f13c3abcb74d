"""How many XLA compilations ran, and for how long: the "no recompiles in steady state" check.

JAX reports every backend compilation (a persistent-cache hit included, then at the cost of
reading it) to `jax.monitoring` as the duration event `BACKEND_COMPILE_EVENT`, with the jitted
function's name. One listener, registered on first use, adds them up for the whole process;
`CompileCounter` reads the totals before and after a stretch of work::

    counter = CompileCounter()
    ...  # one training iteration
    stats = counter.delta()  # CompileStats(count=0, seconds=0.0, names=()) in steady state

The trainer reports each iteration's as time/compiles and time/compile_s.

Tracing alone (a cached executable reused for a new Python call) is not counted: only the
programs XLA builds, which is where a recompile's seconds go.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

import jax

# The event `jax._src.dispatch` records around each XLA compilation (jax 0.4.36 to 0.10).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class CompileStats:
  """Compilations in a stretch of time: how many, their seconds, the functions' names."""

  count: int = 0
  seconds: float = 0.0
  names: tuple = ()

  def metrics(self) -> dict:
    """As the trainer's per-iteration metrics: with the times (they vary from host to host
    and with what this process compiled before, so a resumed run's differ too)."""
    return {"time/compiles": self.count, "time/compile_s": self.seconds}


class _Totals:
  """The process-wide running totals (appended to by JAX's compiling thread)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.count, self.seconds, self.names = 0, 0.0, []
    self.registered = False

  def listener(self, event: str, duration: float, **kwargs) -> None:
    if event != BACKEND_COMPILE_EVENT:
      return
    with self.lock:
      self.count += 1
      self.seconds += float(duration)
      self.names.append(str(kwargs.get("fun_name", "?")))

  def snapshot(self) -> tuple[int, float]:
    with self.lock:
      return self.count, self.seconds

  def ensure_registered(self) -> None:
    with self.lock:
      if self.registered:
        return
      self.registered = True
    jax.monitoring.register_event_duration_secs_listener(self.listener)


_TOTALS = _Totals()


def totals() -> CompileStats:
  """Every compilation since the listener was registered (on the first `CompileCounter`)."""
  _TOTALS.ensure_registered()
  with _TOTALS.lock:
    return CompileStats(_TOTALS.count, _TOTALS.seconds, tuple(_TOTALS.names))


class CompileCounter:
  """Counts the compilations after its creation (or its last `delta(reset=True)`)."""

  def __init__(self):
    _TOTALS.ensure_registered()
    self._count, self._seconds = _TOTALS.snapshot()

  def delta(self, reset: bool = True) -> CompileStats:
    """The compilations since the start (or last reset); `reset` starts a new stretch."""
    with _TOTALS.lock:
      count, seconds = _TOTALS.count, _TOTALS.seconds
      names = tuple(_TOTALS.names[self._count:count])
    stats = CompileStats(count - self._count, seconds - self._seconds, names)
    if reset:
      self._count, self._seconds = count, seconds
    return stats


def clear_compiled() -> None:
  """`jax.clear_caches()`, and the sampler's record of which widths have compiled, which went
  with the programs (`sampler_plan.forget_compiled_shapes`; found through sys.modules: this
  bottom layer imports nothing of the models). Use it in place of `jax.clear_caches()` in a
  process that samples."""
  jax.clear_caches()
  sampler_plan = sys.modules.get("marft_jax.models.sampler_plan")
  if sampler_plan is not None:
    sampler_plan.forget_compiled_shapes()

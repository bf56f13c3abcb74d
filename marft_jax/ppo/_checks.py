"""Argument checks for the ppo functions: refuse bad input by name, never return a wrong number.

Each check has two regimes:
- Concrete values (Python numbers, NumPy arrays, JAX arrays outside a trace) are checked
  on the host when the function is called, or traced, and a bad one raises
  `ValueError("gamma=1.5: must be in [0, 1]")`. A concrete value closed over inside `jit`
  fails at trace time.
- Traced values (the function runs inside `jit`, `vmap` or `grad` on that argument) cannot
  be read. The check becomes `checkify.debug_check`, which does nothing (XLA drops the
  unused predicate) unless the caller wraps the computation in
  `checkify.checkify(f, errors=checkify.user_checks)`; then `err.throw()` raises with the
  same message.

NaN fails every range check. `None` (an optional argument left unset) passes.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def is_traced(*values: Any) -> bool:
  """True if any leaf of `values` is a tracer, i.e. unknown until the computation runs."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))


def _interval(low, high, low_open, high_open) -> str:
  if high == math.inf and high_open:
    if low == -math.inf:
      return "finite"
    return f"finite and {_interval(low, None, low_open, False)}"
  low, high = (None if b is None else f"{b:g}" for b in (low, high))
  if high is None:
    return f"{'>' if low_open else '>='} {low}"
  if low is None:
    return f"{'<' if high_open else '<='} {high}"
  return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_range(name: str, value: Any, low: float | None = None, high: float | None = None,
                *, low_open: bool = False, high_open: bool = False) -> None:
  """Refuses `value` (a scalar or an array, checked elementwise) outside the range or NaN.

  Bounds may be ±inf; `high=math.inf, high_open=True` asks for a finite value.
  """
  if value is None:
    return
  allowed = _interval(low, high, low_open, high_open)
  if is_traced(value):
    x = jnp.asarray(value)
    ok = ~jnp.isnan(x)
    if low is not None:
      ok &= (x > low) if low_open else (x >= low)
    if high is not None:
      ok &= (x < high) if high_open else (x <= high)
    checkify.debug_check(jnp.all(ok), f"{name}={{}}: must be {allowed}", x)
    return
  try:
    x = None if isinstance(value, (str, bytes)) else np.asarray(value, np.float64)
  except (TypeError, ValueError):
    x = None
  if x is None:
    raise ValueError(f"{name}={value!r}: expected a number")
  bad = np.isnan(x)
  if low is not None:
    bad |= (x <= low) if low_open else (x < low)
  if high is not None:
    bad |= (x >= high) if high_open else (x > high)
  if not np.any(bad):
    return
  if x.size == 1:
    shown = value if isinstance(value, (int, float)) else x.item()
    raise ValueError(f"{name}={shown!r}: must be {allowed}")
  raise ValueError(f"{name}: entry {x[bad].flat[0].item()!r} must be {allowed} "
                   f"({int(bad.sum())} such entries)")


def check_unit_interval(name: str, value: Any) -> None:
  """Discounts, trace decays, credit discounts: in [0, 1], not NaN."""
  check_range(name, value, 0.0, 1.0)


def check_positive(name: str, value: Any) -> None:
  """Temperatures, Huber δ, normalisation eps: finite and > 0."""
  check_range(name, value, 0.0, math.inf, low_open=True, high_open=True)


def check_ids(name: str, ids: Any, upper: Any, where: Any = None, *,
              skip_negative: bool = False) -> None:
  """Refuses an id outside [0, upper) among the entries selected by `where` (all if None).

  Args:
    ids: int array, any shape.
    upper: exclusive bound (a Python int, or an array such as a traced step count).
    where: optional mask of ids' shape; only its non-zero entries are checked (valid
      elements), so padding may hold −1.
    skip_negative: negative ids mean "none" (no decision) and are not checked.
  """
  if is_traced(ids, upper, where):
    ids = jnp.asarray(ids)
    ok = (ids < upper) if skip_negative else (ids >= 0) & (ids < upper)
    if where is not None:
      ok |= jnp.asarray(where) == 0
    checkify.debug_check(jnp.all(ok), f"{name}: an id is outside [0, {{}})", jnp.asarray(upper))
    return
  ids, upper = np.asarray(ids), np.asarray(upper)
  checked = ids if where is None else ids[np.asarray(where) != 0]
  bad = (checked >= upper) if skip_negative else (checked < 0) | (checked >= upper)
  if np.any(bad):
    raise ValueError(f"{name}: id {checked[bad].flat[0].item()!r} is outside [0, {upper}) "
                     f"({int(bad.sum())} such entries)")


def check_size(name: str, value: Any) -> int:
  """A static count (number of groups, agents) as a Python int ≥ 1."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name}={value!r}: must be a Python int >= 1 (a static size)")
  return int(value)

"""Argument checks at the host boundary: refuse bad input by name, never return a wrong number.

Every public entry point checks its arguments with these helpers. Each check has two regimes:

- Concrete values (Python numbers, NumPy arrays, JAX arrays outside a trace) are checked on
  the host when the function is called (or traced), and a bad one raises
  `ValueError("gamma=1.5: must be in [0, 1]")`. A concrete value closed over inside `jit`
  fails at trace time.
- Traced values (inside `jit`, `vmap` or `grad`) cannot be read. Each entry point documents
  what a bad traced value does. To have them checked, trace the computation inside
  `traced_checks()` and wrap it in `checkify.checkify(f, errors=checkify.user_checks)`:
  each check is then a `checkify.debug_check`, and `err.throw()` raises with the same message.

      with validation.traced_checks():
        err, out = checkify.checkify(jax.jit(f), errors=checkify.user_checks)(*args)
      err.throw()

Why traced checks are off by default: checkify numbers every check it traces with a
process-wide counter, and that number is a constant of the lowered program even where nothing
reads it. Every trace of the same function then lowered to a different program, so JAX's
persistent compilation cache never hit on a retrace. Measured on the tiny model's 2-iteration
echo run: a second identical run in the same process took 6.2 s, 3.0 s of it recompiling its
update (2.9 s and 0.5 s with the checks off); after `jax.clear_caches()`, 15.8 s (8.6 s).

NaN fails every range check. `None` (an optional argument left unset) passes.

Shapes are static, so `check_rank` and `check_same_shape` raise at call (or trace) time in
both regimes, naming the argument: `ValueError("v_t: shape (2,) differs from r_t's (3,)")`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from typing import Any, Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from marft_jax.compile_stats import clear_compiled


_TRACED_CHECKS = contextvars.ContextVar("marft_jax_traced_checks", default=False)


@contextlib.contextmanager
def traced_checks() -> Iterator[None]:
  """Inside, the checks of traced values become `checkify.debug_check`s (see the module).

  JAX's caches are cleared on entry and on exit: a function jitted before is traced again
  with the checks inside, and without them after."""
  token = _TRACED_CHECKS.set(True)
  clear_compiled()
  try:
    yield
  finally:
    _TRACED_CHECKS.reset(token)
    clear_compiled()


def checking_traced_values() -> bool:
  """True inside `traced_checks()`: a traced value's check is then emitted."""
  return _TRACED_CHECKS.get()


def is_traced(*values: Any) -> bool:
  """True if any leaf of `values` is a tracer, i.e. unknown until the computation runs."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(values))


def _interval(low, high, low_open, high_open) -> str:
  if high == math.inf and high_open:
    if low is None or low == -math.inf:
      return "finite"
    return f"finite and {_interval(low, None, low_open, False)}"
  # An int bound prints in full (2147483647, not 2.14748e+09).
  low, high = (None if b is None else str(b) if isinstance(b, (int, np.integer)) else f"{b:g}"
               for b in (low, high))
  if high is None:
    return f"{'>' if low_open else '>='} {low}"
  if low is None:
    return f"{'<' if high_open else '<='} {high}"
  return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_range(name: str, value: Any, low: Optional[float] = None,
                high: Optional[float] = None, *, low_open: bool = False,
                high_open: bool = False) -> None:
  """Refuses `value` (a scalar or an array, checked elementwise) outside the range, or NaN.

  Bounds may be ±inf; `high=math.inf, high_open=True` asks for a finite value. Booleans and
  strings are not numbers.
  """
  if value is None:
    return
  allowed = _interval(low, high, low_open, high_open)
  if is_traced(value):
    if not checking_traced_values():
      return
    x = jnp.asarray(value)
    ok = ~jnp.isnan(x)
    if low is not None:
      ok &= (x > low) if low_open else (x >= low)
    if high is not None:
      ok &= (x < high) if high_open else (x <= high)
    checkify.debug_check(jnp.all(ok), f"{name}={{}}: must be {allowed}", x)
    return
  x = None
  if not isinstance(value, (str, bytes, bool, np.bool_)):
    try:
      x = np.asarray(value, np.float64)
    except (TypeError, ValueError):
      pass
  if x is None or np.asarray(value).dtype == bool:
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
  entry = np.asarray(value)[bad].flat[0].item()  # as given: an int stays an int
  raise ValueError(f"{name}: entry {entry!r} must be {allowed} "
                   f"({_such_entries(bad)})")


def _such_entries(bad: np.ndarray) -> str:
  count = int(bad.sum())
  return f"{count} such entr{'y' if count == 1 else 'ies'}"


def check_unit_interval(name: str, value: Any) -> None:
  """Discounts, trace decays, credit discounts: in [0, 1], not NaN."""
  check_range(name, value, 0.0, 1.0)


def check_positive(name: str, value: Any) -> None:
  """Temperatures, Huber δ, normalisation eps: finite and > 0."""
  check_range(name, value, 0.0, math.inf, low_open=True, high_open=True)


def check_int(name: str, value: Any, low: Optional[int] = None,
              high: Optional[int] = None) -> int:
  """A static integer (a size, a count, top-k) as a Python int in [low, high], or ValueError."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral,
                                                                   np.integer)):
    raise ValueError(f"{name}={value!r}: expected an int")
  if (low is not None and value < low) or (high is not None and value > high):
    raise ValueError(f"{name}={value!r}: must be {_interval(low, high, False, False)}")
  return int(value)


# Config scalars (Python values read from a config file or JSON): strict types, no coercion.


def check_positive_int(name: str, value: Any) -> None:
  """Raises ValueError(`name=value: must be a positive int`); bools and `"64"` are refused."""
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{name}={value!r}: must be a positive int")


def check_positive_number(name: str, value: Any) -> None:
  """Raises ValueError naming `name` unless `value` is a finite int or float above zero."""
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or not math.isfinite(value) or value <= 0):
    raise ValueError(f"{name}={value!r}: must be a finite positive number")


def check_bool(name: str, value: Any) -> None:
  """Raises ValueError naming `name` unless `value` is `True` or `False` (not `"false"`)."""
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r}: must be true or false")


def check_size(name: str, value: Any) -> int:
  """A static count (number of groups, agents) as a Python int ≥ 1."""
  return check_int(name, value, low=1)


def check_ids(name: str, ids: Any, upper: Any, where: Any = None, *, low: int = 0,
              skip_negative: bool = False) -> None:
  """Refuses an id outside [low, upper) among the entries selected by `where` (all if None).

  Args:
    ids: int array, any shape.
    upper: exclusive bound (a Python int, or an array such as a traced step count).
    where: optional mask broadcastable to ids' shape; only its non-zero entries are checked
      (valid elements), so padding may hold anything.
    low: inclusive lower bound (e.g. -1 for adapter ids, where -1 is the base model).
    skip_negative: negative ids mean "none" (no decision) and are not checked.
  """
  span = f"[{low}, {{}})"
  if is_traced(ids, upper, where):
    if not checking_traced_values():
      return
    ids = jnp.asarray(ids)
    ok = (ids < upper) if skip_negative else (ids >= low) & (ids < upper)
    if where is not None:
      ok |= jnp.asarray(where) == 0
    checkify.debug_check(jnp.all(ok), f"{name}: an id is outside {span}", jnp.asarray(upper))
    return
  ids, upper = np.asarray(ids), np.asarray(upper)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name}: expected integer ids, got dtype {ids.dtype}")
  checked = ids if where is None else ids[np.broadcast_to(np.asarray(where) != 0, ids.shape)]
  bad = (checked >= upper) if skip_negative else (checked < low) | (checked >= upper)
  if np.any(bad):
    raise ValueError(f"{name}: id {checked[bad].flat[0].item()!r} is outside "
                     f"{span.format(upper)} ({_such_entries(bad)})")


def check_rank(rank: Union[int, Sequence[int]], **arrays: Any) -> None:
  """Refuses an array whose rank is not `rank` (one for all, or one per array in order),
  naming it: `ValueError("r_t: shape (1, 3) has rank 2, expected 1")`."""
  ranks = list(rank) if isinstance(rank, (list, tuple)) else [rank] * len(arrays)
  for (name, x), want in zip(arrays.items(), ranks, strict=True):
    if np.ndim(x) != want:
      raise ValueError(f"{name}: shape {tuple(np.shape(x))} has rank {np.ndim(x)}, "
                       f"expected {want}")


def check_same_shape(*, leading: Optional[int] = None, **arrays: Any) -> None:
  """Refuses arrays whose shapes (their first `leading` axes, if given) differ from the first
  array's, naming both: `ValueError("v_t: shape (2,) differs from r_t's (3,)")`."""
  shapes = {name: tuple(np.shape(x)) for name, x in arrays.items()}
  first, want = next(iter(shapes.items()))
  for name, shape in shapes.items():
    if shape[:leading] != want[:leading]:
      axes = ("" if leading is None else " in its first axis" if leading == 1
              else f" in its first {leading} axes")
      owner = f"{first}'" if first.endswith("s") else f"{first}'s"
      raise ValueError(f"{name}: shape {shape} differs from {owner} {want}{axes}")


def check_forward_pointers(name: str, pointers: Any, end: int) -> None:
  """Refuses a successor pointer that does not lead forward: entry i must be in (i, end],
  `end` meaning "none". One pointing back reads an entry not yet computed, and one past
  `end` (or -1, "none" elsewhere in the library) is clamped or wrapped by JAX's indexing:
  either gives wrong numbers silently."""
  if is_traced(pointers):
    if not checking_traced_values():
      return
    x = jnp.asarray(pointers)
    ok = (x > jnp.arange(x.shape[0])) & (x <= end)
    checkify.debug_check(jnp.all(ok), f"{name}: an entry i is outside (i, {end}]")
    return
  x = np.asarray(pointers)
  if x.size and not np.issubdtype(x.dtype, np.integer):
    raise ValueError(f"{name}: expected integer indices, got dtype {x.dtype}")
  bad = (x <= np.arange(x.shape[0])) | (x > end)
  if np.any(bad):
    i = int(np.argmax(bad))
    raise ValueError(f"{name}[{i}]={x[i].item()}: must be in ({i}, {end}], a later entry or "
                     f"{end} for none ({_such_entries(bad)})")

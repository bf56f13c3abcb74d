"""Argument checks at the host boundary, before `jit`, with errors that name the argument.

Public entry points check what they are given while values are still concrete (Python
numbers, NumPy arrays, committed JAX arrays). Inside a trace the same values are abstract and
cannot be inspected: these helpers then do nothing, and each entry point documents what a bad
traced value does. `jax.experimental.checkify` covers that case where a caller wants it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import jax
import numpy as np


def is_concrete(x: Any) -> bool:
  """True unless `x` (or a leaf of it) is a tracer, i.e. its value is unknown until run time."""
  return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def check_number(name: str, value: Any, *, low: Optional[float] = None,
                 high: Optional[float] = None, low_open: bool = False,
                 high_open: bool = False) -> None:
  """Raises ValueError naming `name` unless `value` is a finite number in the given range.

  Arrays (a scalar or one value per row) are checked elementwise when concrete; traced values
  pass unchecked. Booleans are not numbers here.
  """
  if not is_concrete(value):
    return
  if isinstance(value, bool) or (not isinstance(value, numbers.Real)
                                 and not _is_real_array(value)):
    raise ValueError(f"{name}={value!r}: expected a number")
  values = np.asarray(value, np.float64).reshape(-1)
  for v in values:
    bad = (not math.isfinite(v) or (low is not None and (v <= low if low_open else v < low))
           or (high is not None and (v >= high if high_open else v > high)))
    if bad:
      shown = value if values.size == 1 else f"{v!r} (in {np.asarray(value).tolist()})"
      raise ValueError(f"{name}={shown!r}: must be {_describe(low, high, low_open, high_open)}")


def check_int(name: str, value: Any, *, low: Optional[int] = None,
              high: Optional[int] = None) -> int:
  """`value` as a Python int, or ValueError naming `name` (not an integer, or out of range)."""
  if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
    raise ValueError(f"{name}={value!r}: expected an int")
  if (low is not None and value < low) or (high is not None and value > high):
    raise ValueError(f"{name}={value!r}: must be {_describe(low, high, False, False)}")
  return int(value)


def check_ids(name: str, ids: Any, low: int, high: int, where: Any = None) -> None:
  """Raises ValueError naming `name` unless the concrete integers `ids` lie in [low, high).

  Args:
    ids: any shape (concrete; traced ids pass unchecked).
    where: optional bool array of ids' shape: only these entries are checked (e.g. real
      tokens, not padding).
  """
  if not is_concrete((ids, where)):
    return
  ids = np.asarray(ids)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name}: expected integer ids, got dtype {ids.dtype}")
  checked = ids if where is None else ids[np.broadcast_to(np.asarray(where, bool), ids.shape)]
  bad = (checked < low) | (checked >= high)
  if np.any(bad):
    raise ValueError(f"{name}: {int(checked[bad][0])} is outside [{low}, {high}) "
                     f"({int(bad.sum())} such entries)")


def _is_real_array(value: Any) -> bool:
  dtype = getattr(value, "dtype", None)
  return dtype is not None and (np.issubdtype(dtype, np.floating)
                                or np.issubdtype(dtype, np.integer)) and dtype != np.bool_


def _describe(low, high, low_open, high_open) -> str:
  if low is not None and high is not None:
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
  if low is not None:
    return f"{'>' if low_open else '≥'} {low}"
  if high is not None:
    return f"{'<' if high_open else '≤'} {high}"
  return "finite"

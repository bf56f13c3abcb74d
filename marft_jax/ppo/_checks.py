"""The range checks of `marft_jax.validation`, with a NaN refused as NaN.

`validation.check_range` refuses NaN in every range, but with the range's words alone:
`epsilon=nan: must be >= 0` reads as if NaN were negative. Here a concrete NaN (a scalar,
or any entry of an array) is named first, `epsilon=nan: must be >= 0, not NaN`, and
everything else (traced values, other bad values) goes to `validation` unchanged, so the
messages of the other ranges and the checkify checks stay the ones documented there.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from marft_jax import validation


def _nan_count(value: Any) -> int:
  """NaN entries of a concrete number or array; 0 for anything else (None, a string, a
  tracer: those are `validation`'s to refuse or to pass)."""
  if (value is None or validation.is_traced(value)
      or isinstance(value, (str, bytes, bool, np.bool_))):
    return 0
  try:
    return int(np.isnan(np.asarray(value, np.float64)).sum())
  except (TypeError, ValueError):
    return 0


def check_range(name: str, value: Any, low: Optional[float] = None,
                high: Optional[float] = None, *, low_open: bool = False,
                high_open: bool = False) -> None:
  """`validation.check_range`, a concrete NaN refused by name:
  `ValueError("gamma=nan: must be in [0, 1], not NaN")`."""
  count = _nan_count(value)
  if count:
    # The range in `validation`'s own words, so that both messages agree.
    allowed = validation._interval(low, high, low_open, high_open)  # noqa: SLF001
    if np.ndim(value) == 0:
      raise ValueError(f"{name}=nan: must be {allowed}, not NaN")
    entries = f"{count} entr{'y is' if count == 1 else 'ies are'}"
    raise ValueError(f"{name}: {entries} NaN; each must be {allowed}")
  validation.check_range(name, value, low, high, low_open=low_open, high_open=high_open)


def check_unit_interval(name: str, value: Any) -> None:
  """Discounts, trace decays, credit discounts: in [0, 1] (`validation.check_unit_interval`)."""
  check_range(name, value, 0.0, 1.0)


def check_positive(name: str, value: Any) -> None:
  """Temperatures, Huber δ, normalisation eps: finite and > 0 (`validation.check_positive`)."""
  check_range(name, value, 0.0, math.inf, low_open=True, high_open=True)

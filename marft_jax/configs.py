"""Turning an ml_collections `ConfigDict` into frozen, typed dataclasses, once, at the edge.

Launch scripts read a `ConfigDict` (overridable from the command line) and call
`from_config_dict(TrainConfig, config)`; library code only ever sees the dataclasses. Unknown
keys, missing keys and wrong types fail here with the dotted key named, before anything is
compiled or loaded.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def from_config_dict(cls: type[T], config: Mapping[str, Any], prefix: str = "config") -> T:
  """Builds dataclass `cls` from a (nested) mapping, recursing into dataclass-typed fields.

  Raises:
    ValueError: naming e.g. `config.sampling.top_k` for an unknown key or a value of the
      wrong type, and re-raising the dataclass's own `__post_init__` errors with the prefix.
  """
  data = dict(config.items()) if hasattr(config, "items") else dict(config)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(f"{prefix}: unknown key(s) {', '.join(prefix + '.' + k for k in unknown)}; "
                     f"allowed: {', '.join(sorted(fields))}")
  hints = typing.get_type_hints(cls)
  kwargs = {}
  for name, value in data.items():
    kwargs[name] = _coerce(hints[name], value, f"{prefix}.{name}")
  try:
    return cls(**kwargs)
  except ValueError as e:
    raise ValueError(f"{prefix}: {e}") from None


def _coerce(hint: Any, value: Any, key: str) -> Any:
  if dataclasses.is_dataclass(hint):
    if not hasattr(value, "items"):
      raise ValueError(f"{key}: expected a nested config, got {value!r}")
    return from_config_dict(hint, value, key)
  origin = typing.get_origin(hint)
  if origin is typing.Union:  # Optional[X]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return None if value is None else _coerce(args[0], value, key)
  if origin in (tuple, list):
    if not isinstance(value, (tuple, list)):
      raise ValueError(f"{key}: expected a sequence, got {value!r}")
    return tuple(value)
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint in (int, float, str, bool) and not isinstance(value, hint):
    raise ValueError(f"{key}: expected {hint.__name__}, got {value!r}")
  if hint is int and isinstance(value, bool):
    raise ValueError(f"{key}: expected int, got {value!r}")
  return value

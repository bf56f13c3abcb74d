"""Typed configs: frozen dataclasses, built from an ml_collections `ConfigDict` once, at the edge.

A launch config file is a dataclass's defaults turned into a `ConfigDict` (`to_config_dict`),
plus any changes the file makes; the command line overrides it (`--config.key=value`); the
launch script turns it back into the dataclass (`from_config_dict`). The dataclass is the one
source of defaults, types and allowed values; library code only ever sees dataclasses.
Unknown keys, missing keys and wrong types fail here with the dotted key named, before
anything is compiled or loaded.

Named sections: a field typed `tuple[Section, ...]` whose dataclass has a `name` field (a
team's roles) is, in the `ConfigDict`, a mapping from each name to the rest of its section, so
that the command line reaches one by name: `--config.team.roles.solver.temperature=0.5`. A
`ConfigDict` keeps its keys sorted, so the tuple comes back in name order: keep any order that
matters in a field of its own (a team's `order`).

A free-form mapping (a field typed `Mapping[str, Any]`: `task.options`) is a nested mapping
in the `ConfigDict`; it comes back as plain dicts and lists.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Mapping, TypeVar

import ml_collections
from ml_collections import config_dict

T = TypeVar("T")


def from_config_dict(cls: type[T], config: Mapping[str, Any], prefix: str = "config") -> T:
  """Builds dataclass `cls` from a (nested) mapping, recursing into dataclass-typed fields.

  Raises:
    ValueError: naming e.g. `config.sampling.top_k` for an unknown key, a missing required
      key or a value of the wrong type, and re-raising the dataclass's own `__post_init__`
      errors with the prefix.
  """
  data = dict(config.items()) if hasattr(config, "items") else dict(config)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - set(fields))
  if unknown:
    raise ValueError(f"{prefix}: unknown key(s) {', '.join(prefix + '.' + k for k in unknown)}; "
                     f"allowed: {', '.join(sorted(fields))}")
  missing = sorted(name for name, f in fields.items() if name not in data and _required(f))
  if missing:
    raise ValueError(f"{prefix}: missing required key(s) "
                     f"{', '.join(prefix + '.' + k for k in missing)}")
  hints = typing.get_type_hints(cls)
  kwargs = {name: _coerce(hints[name], value, f"{prefix}.{name}") for name, value in data.items()}
  try:
    return cls(**kwargs)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{prefix}: {e}") from None


def to_config_dict(instance: Any) -> ml_collections.ConfigDict:
  """A dataclass instance as a `ConfigDict` (nested dataclasses become nested dicts).

  Fields that default to None become typed placeholders (`Optional[int]` -> an int
  placeholder), so that `--config.seed=3` parses as an int.
  """
  hints = typing.get_type_hints(type(instance))
  out = ml_collections.ConfigDict()
  for field in dataclasses.fields(instance):
    value = getattr(instance, field.name)
    if dataclasses.is_dataclass(value):
      value = to_config_dict(value)
    elif _named_sections(hints[field.name]) is not None:
      value = ml_collections.ConfigDict(
          {v.name: {k: x for k, x in to_config_dict(v).items() if k != "name"} for v in value})
    elif value is None:
      value = config_dict.placeholder(_placeholder_type(hints[field.name]))
    out[field.name] = value
  return out


def _named_sections(hint: Any):
  """The section dataclass of a `tuple[Section, ...]` hint whose Section has a `name` field,
  else None (see the module docstring)."""
  args = typing.get_args(hint)
  if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and \
      dataclasses.is_dataclass(args[0]) and "name" in {f.name for f in dataclasses.fields(args[0])}:
    return args[0]
  return None


def _required(field: dataclasses.Field) -> bool:
  return (field.default is dataclasses.MISSING
          and field.default_factory is dataclasses.MISSING)  # type: ignore[misc]


def _placeholder_type(hint: Any) -> Any:
  args = [a for a in typing.get_args(hint) if a is not type(None)]
  return args[0] if len(args) == 1 and isinstance(args[0], type) else object


def _coerce(hint: Any, value: Any, key: str) -> Any:
  """`value` as type `hint` (dataclasses, Optional / Union, tuples, scalars), or ValueError."""
  if dataclasses.is_dataclass(hint):
    if not hasattr(value, "items"):
      raise ValueError(f"{key}: expected a nested config, got {value!r}")
    return from_config_dict(hint, value, key)
  section = _named_sections(hint)
  if section is not None and hasattr(value, "items"):
    return tuple(from_config_dict(section, {**dict(v.items()), "name": name}, f"{key}.{name}")
                 for name, v in sorted(value.items()))
  origin = typing.get_origin(hint)
  if origin in (dict, Mapping, collections.abc.Mapping):  # a free-form mapping (task.options)
    if not hasattr(value, "items"):
      raise ValueError(f"{key}: expected a mapping, got {value!r}")
    return _plain(value)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(hint)
    if value is None and type(None) in args:
      return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
      try:
        return _coerce(arg, value, key)
      except ValueError as e:
        errors.append(str(e))
    raise ValueError(f"{key}: {value!r} matches none of {_type_name(hint)} "
                     f"({'; '.join(errors)})")
  if origin in (tuple, list):
    if not isinstance(value, (tuple, list)):
      raise ValueError(f"{key}: expected a sequence, got {value!r}")
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    return tuple(value)
  if hint is typing.Any:
    return value
  if hint is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if hint is int and isinstance(value, bool):
    raise ValueError(f"{key}: expected int, got {value!r}")
  if hint in (int, float, str, bool) and not isinstance(value, hint):
    raise ValueError(f"{key}: expected {hint.__name__}, got {value!r}")
  return value


def _plain(value: Any) -> Any:
  """A free-form mapping's value with every nested `ConfigDict` a dict, every tuple a list
  (as JSON gives it back), so that a config and its record compare equal."""
  if hasattr(value, "items"):
    return {str(k): _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  return value


def _type_name(hint: Any) -> str:
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    return " | ".join(_type_name(a) for a in typing.get_args(hint))
  return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")

"""Teams from the original MARFT's profile files (`--config.team.profiles=path.json`).

The original (jwliao-ai/MARFT, `marft/scripts/profiles/math_*.json`) declares a team as a JSON
list of agent profiles, one object per agent in speaking order::

    [{"role": "reasoner", "prompt": "<|im_start|>system: ...", "with_answer": false,
      "device": "cuda:1"},
     {"role": "actor", "prompt": "...", "with_answer": true, "device": "cuda:2"}]

Each entry becomes one `RoleSection` of `team.roles`, and the list's order `team.order`:

  role         -> RoleSection.name (letters, digits, "-" or "_"; unique)
  prompt       -> RoleSection.system_prompt (as written: a prompt holding the original's
                  hand-made "<|im_start|>system: ...<|im_end|>" framing keeps it, inside this
                  library's chat template)
  with_answer  -> RoleSection.graded (every with_answer role is graded: the environment's
                  score is their mean, as the original's MathEnv scores them)
  device       -> ignored, with one warning per file: `mesh.*` places the models here

The keys a profile has no field for (description, adapter, per-role sampling, backbone) take
RoleSection's defaults; the team-wide keys (team.max_new_tokens, team.temperature,
team.graph, ...) apply as to any team. The file is the team: `team.roles` and `team.order`
of the config file are replaced, so `--config.team.roles.<name>.<key>` overrides are not read
alongside it.

An entry's field that is missing, of the wrong type, or not one of these four is refused,
naming the file, the entry and the field: an unknown field is most likely a misspelt one
("with_answers"), and a misspelt `with_answer` read as absent would silently leave a role
ungraded.

`expand(config)` reads the file once, when the config is resolved (`config.resolve`, which
every launch and `loop.train` call first), and returns the config with the roles written out
and `team.profiles` cleared: the checkpoint records the roles, not the path, so the run
resumes, evaluates and restores without the file, and records the same config as a config
file that declares the same roles.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from absl import logging

from marft_jax.train.config.sections import RoleSection

FIELDS = {"role": str, "prompt": str, "with_answer": bool}  # each required, of this type
IGNORED = ("device",)  # read by the original (the agent's GPU); warned of, not used


def read_profiles(path: str) -> tuple[RoleSection, ...]:
  """The roles of the profile file at `path`, in its order (see the module docstring).

  Raises:
    ValueError: naming `path` (and the entry's index and field) for a missing or unreadable
      file, invalid JSON, a top level that is not a non-empty list of objects, a missing,
      mistyped or unknown field, a repeated role, or no role with with_answer true.
  """
  where = f"team.profiles={path!r}"
  try:
    with open(path, encoding="utf-8") as f:
      entries = json.load(f)
  except OSError as e:
    raise ValueError(f"{where}: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{where}: not a JSON file ({e})") from None
  if not isinstance(entries, list) or not entries:
    raise ValueError(f"{where}: a profile file is a non-empty JSON list of agent profiles "
                     f"({', '.join(FIELDS)}), got {_kind(entries)}")
  roles = tuple(_role(entry, f"{where}: entry {i}") for i, entry in enumerate(entries))
  names = [r.name for r in roles]
  for i, name in enumerate(names):
    if name in names[:i]:
      raise ValueError(f"{where}: entry {i}: field 'role': {name!r} is also entry "
                       f"{names.index(name)}'s (role names are unique in a team)")
  if not any(r.graded for r in roles):
    raise ValueError(f"{where}: no entry has with_answer true (mark the role(s) whose answer "
                     "the environment scores)")
  placed = [i for i, entry in enumerate(entries) if any(k in entry for k in IGNORED)]
  if placed:
    logging.warning("%s: 'device' is ignored (entries %s): mesh.* places the models",
                    where, ", ".join(map(str, placed)))
  return roles


def _role(entry: Any, where: str) -> RoleSection:
  """One entry as a `RoleSection`, or a ValueError naming `where` and the field."""
  if not isinstance(entry, dict):
    raise ValueError(f"{where}: an agent profile is a JSON object, got {_kind(entry)}")
  for field in entry:
    if field not in FIELDS and field not in IGNORED:
      raise ValueError(f"{where}: field {field!r} is not a profile field (one of "
                       f"{', '.join(FIELDS)}, {', '.join(IGNORED)})")
  for field, kind in FIELDS.items():
    if field not in entry:
      raise ValueError(f"{where}: field {field!r} is missing")
    if not isinstance(entry[field], kind):
      raise ValueError(f"{where}: field {field!r} must be a JSON "
                       f"{'boolean' if kind is bool else 'string'}, got {json.dumps(entry[field])}")
  try:
    return RoleSection(entry["role"], system_prompt=entry["prompt"],
                       graded=entry["with_answer"])
  except ValueError as e:
    raise ValueError(f"{where}: field 'role': {e}") from None


def _kind(value: Any) -> str:
  if isinstance(value, list):
    return "a list" if value else "an empty list"
  return "an object" if isinstance(value, dict) else json.dumps(value)


def expand(config):
  """`config` (a `TrainConfig`) with `team.profiles`' roles as `team.roles` and `team.order` and the key
  cleared ("": `config` itself). A relative path is read from the working directory."""
  path = config.team.profiles
  if not path:
    return config
  roles = read_profiles(os.path.expanduser(path))
  try:
    team = dataclasses.replace(config.team, roles=roles, order=",".join(r.name for r in roles),
                               profiles="")
  except ValueError as e:  # the team's other keys against these roles (num_roles, edges, ...)
    raise ValueError(f"team.profiles={path!r}: {e}") from None
  return dataclasses.replace(config, team=team)

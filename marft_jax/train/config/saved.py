"""The config as a run records it, and a recorded config read back.

A run records its config resolved, with its team written out (`as_recorded`), in every
checkpoint's meta and in `config.json`. Reading one back (`read_saved_config`) fills the keys
added since it was written with the values that reproduce the code that wrote it (the
compatibility history, `config/history.py`). Which saved keys a checkpoint must share with
the config that reads it is decided here too: a resumed run every key but
`RESUME_MAY_DIFFER`; an evaluation only `EVAL_MUST_MATCH` (the adapters' shape and the team
that runs them), so a trained team can be scored on any task.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any, Mapping, Optional

from marft_jax.architecture import precision
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.train.checkpoint import CheckpointMismatchError
from marft_jax.train.config import history, teams
from marft_jax.train.config.resolve import resolve
from marft_jax.train.config.schema import TrainConfig


def as_recorded(config: TrainConfig) -> TrainConfig:
  """The config as a run records it (checkpoint meta, config.json): resolved
  (`resolve`: the algorithm's "auto" keys filled in), and an empty `team.roles`
  written out as the task's shipped team, so the record names every role's prompt, adapter
  and sampling, and a config file that spells the same team out records the same config."""
  config = resolve(config)
  if config.team.roles:
    return config
  team = dataclasses.replace(config.team, **teams.shipped(config.task.name,
                                                          config.team.num_roles))
  return dataclasses.replace(config, team=team)


def read_saved_config(saved: Mapping[str, Any], where: str,
                      written_at: Optional[datetime.datetime] = None) -> TrainConfig:
  """A checkpoint's saved config (meta["config"]) as this version of the library reads it:
  keys added since it was written take the values that reproduce the code that wrote it
  (`history.fill_missing`: e.g. loss.behaviour_correction "off", not "auto"; its
  write time `written_at`, `Checkpointer.written_at`, decides where keys cannot), then
  `as_recorded`, so that it compares equal to the config that trains today as it did.
  `where` (e.g. "runs/x: step 8") prefixes a `CheckpointMismatchError`."""
  try:
    return as_recorded(from_config_dict(TrainConfig,
                                        history.fill_missing(saved, written_at)))
  except ValueError as e:
    raise CheckpointMismatchError(f"{where}: its saved config does not load: {e}") from None


def read_for_resume(saved: Mapping[str, Any], where: str,
                    changes_known: Optional[int] = None,
                    written_at: Optional[datetime.datetime] = None) -> dict:
  """A checkpoint's saved config as a resumed run compares it with its own (`resume_view` of
  `read_saved_config`). A behaviour of the run that wrote it that no value of today's keys
  reproduces (`history.unreproducible`, and the changes without a key after
  `changes_known`, its meta's record: `history.changed_since`) is a
  `CheckpointMismatchError` naming the key."""
  refused = history.unreproducible(saved)
  if not refused:
    config = read_saved_config(saved, where, written_at)
    refused = history.changed_since(changes_known, config)
  if refused:
    reasons = "; ".join(f"{key}: {why}" for key, why in refused)
    raise CheckpointMismatchError(
        f"{where} was written by an earlier version that this one cannot continue as it "
        f"trained ({reasons}). Resume it with that version, or start again in a fresh workdir")
  return resume_view(to_config_dict(config).to_dict(), config.run_dtype)


def resume_view(config: Mapping[str, Any], run_dtype: str) -> dict:
  """A recorded config with its settings that mean the same behaviour written one way:
  `model.matmul_precision` "auto" as the precision it resolves to for the model's dtype;
  `model.lora_update_f32` True where the run loads no bf16 backbone (`run_dtype`,
  `TrainConfig.run_dtype`: the key changes bf16 models only)."""
  config = copy.deepcopy(dict(config))
  model = config["model"] = dict(config["model"])
  model["matmul_precision"] = precision.resolve(model["matmul_precision"],
                                                model["param_dtype"])
  if run_dtype == "float32":
    model["lora_update_f32"] = True
  return config


# Keys a resumed run may change (extend the run, re-shard it, evaluate more or less often);
# any other difference from the checkpoint's saved config is refused, naming the key.
RESUME_MAY_DIFFER = ("iterations", "checkpoint_every", "mesh", "eval_every", "eval_episodes")
# Keys an evaluation of a checkpoint must share with the run that wrote it: the base model and
# the adapters' shape, and the team running them (`evaluate.restore_policy` also compares the
# roles and adapters `build_team` makes). Everything else, the task and data above all, may
# differ.
EVAL_MUST_MATCH = ("model.source", "lora.rank", "lora.alpha", "lora.use_rslora", "lora.targets",
                   "team.num_roles", "team.shared_adapter", "team.graph")
# Keys (or sections) that shape the episodes an evaluation plays: an evaluation under other
# values than the run trained with says which (`evaluate.restore_policy`), since the launch
# takes its settings from the config file and flags, not from the checkpoint.
EVAL_SHOWS_IF_CHANGED = ("task", "team", "rollout.context_mode", "rollout.max_context",
                         "model.param_dtype", "model.matmul_precision", "model.lora_update_f32")

"""Transcripts: one JSONL file per iteration, one line per episode, readable by a person.

Each line holds the task, every turn in order (env step, role, what the agent was shown, what
it replied, how many tokens, whether it stopped by itself), the environment's rewards and
infos per env step, and why the episode was dropped if it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from marft_jax.rollout.episode import Episode


def episode_record(episode: Episode) -> dict:
  return {"env_index": episode.env_index, "seed": episode.seed, "task": episode.task,
          "policy_version": episode.policy_version, "dropped": episode.dropped,
          "return": episode.episodic_return,
          "turns": [_turn_record(turn) for turn in episode.turns],
          "rewards": episode.rewards, "dones": episode.dones,
          "infos": [_jsonable(info) for info in episode.infos]}


def _turn_record(turn) -> dict:
  """A turn's fields but its messages (`prompt` shows them as the agent read them)."""
  record = dataclasses.asdict(turn)
  del record["messages"]
  return record


def write_transcripts(path: str, episodes: Sequence[Episode]) -> str:
  """Writes `path` (a .jsonl file; its folder is created), replacing it atomically."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    for episode in episodes:
      f.write(json.dumps(episode_record(episode), ensure_ascii=False) + "\n")
  os.replace(tmp, path)
  return path


def _jsonable(value):
  """Info dicts may hold NumPy numbers or tuples: make them plain JSON."""
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
    return value.item()
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  return repr(value)

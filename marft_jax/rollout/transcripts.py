"""Transcripts: one JSONL line per episode, readable by a person.

Each line holds the task, every turn in order (env step, role, what the agent was shown, what
it replied, how many tokens, whether it stopped by itself), the environment's rewards and
infos per env step, and why the episode was dropped if it was.

An evaluation writes its episodes to one file (`write_transcripts`). A training run appends
each iteration's to a rolling pair in its `transcripts/` folder (`append_transcripts`), each
line led by `"iteration"`: `transcripts.jsonl` takes the appends; once it holds
`MAX_FILE_BYTES` it becomes `transcripts.1.jsonl` (replacing the one before) and a new one
starts. So the folder never holds more than two files and 2 × `MAX_FILE_BYTES` plus one
iteration's episodes, however long the run, and it holds the latest iterations: at least
the last 32 MB of them, every iteration of a run short enough (bench/soak.py's tiny-model
run writes 7.8 KB an iteration, 8 episodes of 3-token replies: 4,000 iterations a file;
longer prompts and replies write more, in proportion). A fixed size rather than a config
key: what is kept changes nothing a run trains or resumes, and a person reads the latest
iterations.
`read_transcripts` reads the pair back, oldest first. A resumed run first drops what the
interrupted run wrote at or after the iteration it resumes from (`cut_transcripts`), so each
iteration appears once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional, Sequence

from marft_jax.jsonl import iter_records
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


# The rolling pair's size: big enough that a person finds every iteration of a usual run,
# small enough that a soak's transcripts stay a few tens of MB.
MAX_FILE_BYTES = 32 << 20
CURRENT, PREVIOUS = "transcripts.jsonl", "transcripts.1.jsonl"
_LEGACY_PREFIX = "iteration_"  # the one-file-per-iteration folders of runs before the pair


def append_transcripts(folder: str, iteration: int, episodes: Sequence[Episode],
                       max_bytes: Optional[int] = None) -> str:
  """Appends `iteration`'s episodes to `folder`'s current file (created with its folder),
  rolling it over to the previous file first once it holds `max_bytes` (None:
  `MAX_FILE_BYTES`, read at each call); returns its path."""
  os.makedirs(folder, exist_ok=True)
  current = os.path.join(folder, CURRENT)
  cap = MAX_FILE_BYTES if max_bytes is None else max_bytes
  if os.path.exists(current) and os.path.getsize(current) >= cap:
    os.replace(current, os.path.join(folder, PREVIOUS))
  lines = "".join(json.dumps({"iteration": int(iteration), **episode_record(e)},
                             ensure_ascii=False) + "\n" for e in episodes)
  with open(current, "a", encoding="utf-8") as f:  # one write: a kill tears one line at most
    f.write(lines)
  return current


def read_transcripts(folder: str, iteration: Optional[int] = None) -> list[dict]:
  """The episode records of a run's `transcripts/` folder, oldest first (only `iteration`'s
  if given); a torn line (a killed run's last) is skipped."""
  records = []
  for name in (PREVIOUS, CURRENT):
    for record in _records(os.path.join(folder, name)):
      if iteration is None or record.get("iteration") == iteration:
        records.append(record)
  return records


def cut_transcripts(folder: str, step: int) -> None:
  """Drops the records of iterations >= `step` (a resumed run plays them again) and a torn
  last line (the next append would be glued to it), and the one-file-per-iteration files of
  those iterations that older runs wrote."""
  if not os.path.isdir(folder):
    return
  for name in os.listdir(folder):
    if name.startswith(_LEGACY_PREFIX) and _legacy_iteration(name) >= step:
      os.remove(os.path.join(folder, name))
  for name in (PREVIOUS, CURRENT):
    path = os.path.join(folder, name)
    if _torn(path) or any(r.get("iteration", -1) >= step for r in _records(path)):
      _keep_before(path, step)


def _torn(path: str) -> bool:
  """Whether a file exists and its last byte is not a newline."""
  if not os.path.exists(path) or not os.path.getsize(path):
    return False
  with open(path, "rb") as f:
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"


def _records(path: str):
  """The JSON objects of a JSONL file, one at a time (nothing if it does not exist)."""
  if os.path.exists(path):
    yield from iter_records(path)


def _keep_before(path: str, step: int) -> None:
  """Rewrites `path` with its whole lines of iterations < `step`, atomically, streaming (a
  file of `MAX_FILE_BYTES` is never held in memory)."""
  tmp = f"{path}.tmp"
  with open(path, encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as dst:
    for line in src:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and record.get("iteration", -1) < step:
        dst.write(line if line.endswith("\n") else line + "\n")
  os.replace(tmp, path)


def _legacy_iteration(name: str) -> int:
  """The iteration of an `iteration_00042.jsonl` name (-1 for another name)."""
  stem = name[len(_LEGACY_PREFIX):].split(".")[0]
  return int(stem) if stem.isdigit() else -1


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

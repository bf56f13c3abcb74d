"""An evaluation's finished sampler calls, kept on disk so that a stopped one resumes.

A sampled HumanEval evaluation (164 problems × 20 samples) is hours of calls on a CPU host;
killed in its last call (Ctrl-C, the OOM killer, a preempted VM), it would start again from
nothing. `CallLog(folder, settings)` writes each finished call as one file,

    <folder>/settings.json     what the calls depend on (the caller's `settings`)
    <folder>/call_00007.pkl    call 7's episodes (token sequences left out: the scores,
                               turns and transcripts need none) and the environments' data
                               cursor after it

each written to a temporary name and renamed (`metrics.write_atomically`), so a file is
whole or absent. A second run with the same settings reads the calls back (`played`) and
goes on from the next; its episodes are those the uninterrupted run plays, because every
call's key is a function of the episodes before it and the environments resume at the saved
cursor. A folder of other
settings is refused with the keys that differ (mixing calls of two settings would be a
silent wrong score); the caller removes the folder once its results are written (`clear`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pickle
import shutil
from typing import Any

from marft_jax.train.metrics import write_atomically

_SETTINGS = "settings.json"


class UnusableCalls(ValueError):
  """The folder holds another evaluation's calls, or a call that cannot be read."""


class CallLog:
  """The finished calls of one evaluation in `folder` (made on the first `record`)."""

  def __init__(self, folder: str, settings: dict[str, Any]):
    self.folder = folder
    self.settings = json.loads(json.dumps(settings, sort_keys=True))  # as it reads back

  def played(self) -> list[tuple[list, dict]]:
    """[(episodes, cursor after the call)] of calls 0, 1, ... found in the folder (none if
    it is absent); `UnusableCalls` naming the folder (or file) if it holds another
    evaluation's calls or an unreadable one."""
    path = os.path.join(self.folder, _SETTINGS)
    if not os.path.exists(path):
      return []
    with open(path) as f:
      saved = json.load(f)
    differ = sorted(k for k in set(saved) | set(self.settings)
                    if saved.get(k) != self.settings.get(k))
    if differ:
      raise UnusableCalls(
          f"{self.folder}: the finished calls of an evaluation with other settings "
          f"({', '.join(differ)} differ); rerun with those settings to finish it, or remove "
          "the folder to start this one afresh")
    calls = []
    for index, name in enumerate(sorted(glob.glob(os.path.join(self.folder, "call_*.pkl")))):
      if os.path.basename(name) != _name(index):
        raise UnusableCalls(f"{name}: expected {_name(index)} (a call is missing before it); "
                            f"remove {self.folder} to start afresh")
      try:
        with open(name, "rb") as f:
          record = pickle.load(f)
        calls.append((record["episodes"], record["cursor"]))
      except Exception as e:  # written by another version of the library, or damaged
        raise UnusableCalls(f"{name}: unreadable ({type(e).__name__}: {e}); remove "
                            f"{self.folder} to start afresh") from e
    return calls

  def record(self, index: int, episodes: list, cursor: dict) -> None:
    """Saves call `index` (the next after those `played` returned)."""
    os.makedirs(self.folder, exist_ok=True)
    settings = os.path.join(self.folder, _SETTINGS)
    if not os.path.exists(settings):
      text = json.dumps(self.settings, indent=2, sort_keys=True)
      write_atomically(settings, lambda f: f.write(text), mode="w")
    light = [dataclasses.replace(e, sequences=[]) for e in episodes]
    write_atomically(os.path.join(self.folder, _name(index)),
                     lambda f: pickle.dump({"episodes": light, "cursor": cursor}, f), mode="wb")

  def clear(self) -> None:
    shutil.rmtree(self.folder, ignore_errors=True)


def _name(index: int) -> str:
  return f"call_{index:05d}.pkl"


"""Held-out problems kept apart from training ones: a problem's fingerprint, a problem file's
held-out part less what a checkpoint trained on, and generated arithmetic less it. The task
table's builders use these (`tasks.py`); what a checkpoint records of its training problems,
and reading it back, is `trained_problems.py`.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Collection

from marft_jax.envs import arithmetic, splits

EVAL_SEED_OFFSET = 1_000_003  # held-out episodes never share a seed with training's


def fingerprint(problem: Any) -> str:
  """The hash of a problem's statement (16 hex digits): equal for the same problem anywhere."""
  return hashlib.sha256(splits.statement(problem).encode("utf-8")).hexdigest()[:16]


def heldout_problems(kind: str, path: str, test_path: str = "",
                     trained: Collection[str] = ()) -> tuple[tuple, int]:
  """(the held-out problems of a problem file task, `splits.task_problems`, less those whose
  fingerprint is in `trained`; how many were dropped). A ValueError naming the file when
  none is left."""
  test = splits.task_problems(kind, path, test_path)[1]
  kept = tuple(p for p in test if fingerprint(p) not in trained)
  if not kept:
    where = f"task.test_path={test_path!r}" if test_path else f"task.path={path!r}"
    raise ValueError(f"{where}: each of its {len(test)} held-out problems is one the "
                     "checkpoint trained on")
  return kept, len(test) - len(kept)


class Unseen:
  """Generated arithmetic (`source`, an `arithmetic.ArithmeticProblems`) less the problems in
  `trained`: seed s gives the first problem of seed s's stream (`generate_problems(k, level,
  s, split)[-1]`, k = 1, 2, ...) that is not one of them, so `source`'s own problem unless a
  checkpoint trained on it. A `problems.ProblemSource`."""

  def __init__(self, source, trained: Collection[str]):
    self.source, self.trained = source, trained

  def problem_for_seed(self, seed: int):
    level = self.source.levels[seed % len(self.source.levels)]
    for k in itertools.count(1):
      problem = arithmetic.generate_problems(k, level, seed, self.source.split)[-1]
      if fingerprint(problem) not in self.trained:
        return problem
      if k == 1000:
        raise ValueError(f"seed {seed}: its first 1000 held-out problems were all trained on")

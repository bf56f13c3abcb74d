"""A toy environment whose best answer is known: repeat the number shown.

Small enough for a tiny random model to learn in a few dozen updates, so tests can show that
training raises the reward, and a template for writing environments.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np

from marft_jax.envs.base import Environment, Observation, Step

_NUMBER = re.compile(r"-?\d+")


class EchoEnv(Environment):
  """Task: "Repeat: 7". A graded reply scores 1 if the first number in it is the one shown.
  Numbers are drawn from [0, `high`); one env step per episode.

  The wording is short on purpose: with the echo team's prompts, the last agent's row
  (byte-level tiny tokenizer, an earlier 3-token reply re-encoded to up to 9 bytes) stays
  within 64 tokens, a row length of `batching.row_length` at every step up to 64, which
  halves the cost of every trainer test's update against 128 (step 64's next length)."""

  def __init__(self, graded: Sequence[str], high: int = 10):
    self.graded, self.high = tuple(graded), int(high)
    self.number = None

  def reset(self, seed: int) -> Observation:
    self.number = int(np.random.default_rng(seed).integers(self.high))
    return Observation(task=f"Repeat: {self.number}")

  def step(self, actions: Mapping[str, str]) -> Step:
    hits = {}
    for role in self.graded:
      found = _NUMBER.search(actions.get(role, ""))
      hits[role] = float(found is not None and int(found.group()) == self.number)
    score = float(np.mean(list(hits.values())))
    return Step(observation=None, rewards={role: score for role in actions}, done=True,
                info={"correct": hits, "metrics": {"accuracy": score}})

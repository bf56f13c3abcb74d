"""A multi-step task of your own: guess a hidden number, told "higher" or "lower" after each
wrong guess, for up to `task.horizon` env steps (the rollout shows the feedback so far to
each later step's agents)::

  python -m launch.train --config=examples/guess_number_config.py --workdir=runs/guess
"""

import re

import numpy as np

from marft_jax import envs


class GuessNumber(envs.Environment):
  """The hidden number is in [0, high); the graded role's first integer is its guess. A right
  guess scores 1 and ends the episode; a wrong one scores 0 and, before the last step, is
  answered with "Guess k was too low." (or high) as feedback."""

  def __init__(self, high: int, horizon: int, graded: str = "guesser"):
    self.high, self.horizon, self.graded = high, horizon, graded

  def problem_id(self, seed: int) -> str:
    return str(int(np.random.default_rng(seed).integers(self.high)))

  def reset(self, seed: int) -> envs.Observation:
    self.number, self.feedback = int(self.problem_id(seed)), ()
    return envs.Observation(task=self._task())

  def _task(self) -> str:
    return f"Guess the hidden number between 0 and {self.high - 1}. Reply with one number."

  def step(self, actions):
    found = re.search(r"-?\d+", actions[self.graded])
    guess = int(found.group()) if found else None
    score = float(guess == self.number)
    if guess is None:
      hint = "No number was given."
    else:
      hint = f"Guess {guess} was too {'low' if guess < self.number else 'high'}."
    self.feedback += (hint,)
    done = score > 0 or len(self.feedback) >= self.horizon
    observation = None if done else envs.Observation(self._task(), self.feedback)
    return envs.Step(observation=observation, rewards={r: score for r in actions}, done=done,
                     info={"metrics": {"accuracy": score, "guesses": float(len(self.feedback))}})


def make_env(task, split: str, seed: int) -> GuessNumber:
  """The factory (`task.name="examples.guess_number:make_env"`). `task.options`: "high"
  (default 16); `task.horizon`: the guesses an episode allows."""
  return GuessNumber(high=int(task.options.get("high", 16)), horizon=task.horizon)

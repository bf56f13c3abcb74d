"""A task of your own in one file: say whether the number shown is even or odd.

Train it (from the repository's root, so that `examples` imports) with its config file, which
names the factory below as `task.name` and declares the team that plays it::

  python -m launch.train --config=examples/parity_config.py --workdir=runs/parity
  python -m launch.eval --config=examples/parity_config.py --workdir=runs/parity

or from Python: `marft_jax.train.train(config, "runs/parity", task=make_env)`.
"""

import numpy as np

from marft_jax import envs


class Parity(envs.Environment):
  """Say whether the number shown is even or odd; the graded role's reply is checked."""

  def __init__(self, high: int = 100, graded: str = "answerer"):
    self.high, self.graded = high, graded

  def problem_id(self, seed: int) -> str:
    """The problem `reset(seed)` plays: its number (so an evaluation leaves out the numbers
    a checkpoint trained on)."""
    return str(int(np.random.default_rng(seed).integers(self.high)))

  def reset(self, seed: int) -> envs.Observation:
    self.number = int(self.problem_id(seed))
    return envs.Observation(task=f"Is {self.number} even or odd?")

  def step(self, actions):
    right = "even" if self.number % 2 == 0 else "odd"
    score = float(right in actions[self.graded].lower())
    return envs.Step(observation=None, rewards={r: score for r in actions}, done=True,
                     info={"metrics": {"accuracy": score}})


def make_env(task, split: str, seed: int) -> Parity:
  """The factory (`task.name="examples.parity:make_env"`): the same numbers for both splits,
  so the trained ones are left out of an evaluation by their `problem_id`.
  `task.options`: "high" (numbers from [0, high), default 100) and "graded" (the role whose
  reply is checked, default "answerer")."""
  return Parity(high=int(task.options.get("high", 100)),
                graded=task.options.get("graded", "answerer"))

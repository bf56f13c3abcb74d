"""MARFT-A, planner → coder, on the bundled stdin/stdout and function-call problems
(reward: the fraction of tests passed in the sandbox)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import (RolloutSection, TaskSection, TeamSection,
                                     TrainConfig)


def get_config():
  return to_config_dict(TrainConfig(
      algorithm="marft_a",
      task=TaskSection(name="code"),
      team=TeamSection(**teams.shipped("code", 2), max_new_tokens=128, last_max_new_tokens=256),
      rollout=RolloutSection(max_context=2048),
  ))

"""MARFT-A, solver → checker on two-operation arithmetic (envs/verify_correct.py): the checker
reads the solver's calculation and gives the final answer, so a wrong first step can be caught.
The untuned SmolLM2-135M team's held-out accuracy: docs/team_tasks.md."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_a", task=TaskSection(name="verify_correct"),
                                    team=TeamSection(**teams.shipped("verify_correct", 2))))

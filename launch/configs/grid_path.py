"""MARFT-A, planner → executor on a 3 × 3 grid with walls (envs/grid_path.py): the planner
writes the moves, the executor the final path in the graded form.
The untuned SmolLM2-135M team's held-out accuracy: docs/team_tasks.md."""

from marft_jax.configs import to_config_dict
from marft_jax.train import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_a", task=TaskSection(name="grid_path"),
                                    team=TeamSection(**teams.shipped("grid_path", 2))))

"""MARFT-A, planner → executor on a small grid with walls (envs/grid_path.py): the planner
picks the way from S to G among the task's candidate paths, the executor writes the final
path in the graded form (the shipped team, `config/teams.py`; its calibration, with the
untuned SmolLM2-135M team's held-out accuracy: docs/team_tasks.md)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig
from marft_jax.train.config import teams


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_a", task=TaskSection(name="grid_path"),
                                    team=TeamSection(**teams.shipped("grid_path", 2))))

"""Single-agent PPO on grid_path (the team sweep's baseline, bench/learning.py): one solver
picks the way from S to G among the candidate paths and writes it in the graded form
(`envs/team_tasks.py`'s `full_information_<task>`, as the other single-agent arms)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

SOLVER = RoleSection(
    "solver", "You are good at finding paths. Check which candidate path goes from S to G "
    "without entering a # wall. Answer in one line, e.g. The path from S to G is R D R.",
    "Finds the path.", graded=True)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_grid_path")
  return to_config_dict(TrainConfig(algorithm="ppo", task=task,
                                    team=TeamSection(roles=(SOLVER,), order="solver")))

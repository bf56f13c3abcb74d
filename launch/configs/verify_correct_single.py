"""Single-agent PPO on verify_correct (the team sweep's baseline, bench/learning.py): one
solver computes the two operations and gives the final result (every role sees the whole
problem; `envs/team_tasks.py`'s `full_information_<task>`, as the other single-agent arms)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

SOLVER = RoleSection(
    "solver", "You are good at arithmetic. Compute the result step by step, one calculation "
    "per line, then the final result in \\boxed{}, e.g. 4 + 7 = 11\n11 * 2 = \\boxed{22}.",
    "Computes the result.", graded=True)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_verify_correct")
  return to_config_dict(TrainConfig(algorithm="ppo", task=task,
                                    team=TeamSection(roles=(SOLVER,), order="solver")))

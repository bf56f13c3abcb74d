"""Single-agent PPO on split_facts with full information (the team sweep's baseline,
bench/learning.py): one solver sees the facts and the question together
(`envs/team_tasks.py`'s `full_information_<task>`), so it needs no teammate."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

SOLVER = RoleSection(
    "solver", "You are good at arithmetic. Answer the question in one line: the calculation, "
    "then the answer in \\boxed{}, e.g. 7 + 5 = \\boxed{12}.", "Answers the question.",
    graded=True)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_split_facts")
  return to_config_dict(TrainConfig(algorithm="ppo", task=task,
                                    team=TeamSection(roles=(SOLVER,), order="solver")))

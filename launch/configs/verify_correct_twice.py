"""One agent answering twice on verify_correct (the team sweep, bench/learning.py): a draft
calculation, then its own check and the final result, both turns on one adapter
(`team.shared_adapter`), trained with MARFT-A."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

DRAFT = RoleSection(
    "draft", "You are good at arithmetic. Compute the result step by step, one calculation "
    "per line, e.g. 4 + 7 = 11\n11 * 2 = 22.", "Writes the calculation.")
FINAL = RoleSection(
    "final", "You are good at arithmetic. Check each line of your draft calculation above "
    "and correct any mistake. Reply with only the final result in \\boxed{}, e.g. "
    "\\boxed{22}.", "Checks the draft and gives the final answer.", graded=True)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_verify_correct")
  return to_config_dict(TrainConfig(
      algorithm="marft_a", task=task,
      team=TeamSection(roles=(DRAFT, FINAL), order="draft,final", shared_adapter=True)))

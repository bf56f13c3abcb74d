"""One agent answering twice on split_facts with full information (the team sweep,
bench/learning.py): a draft, then its own check of the draft and the final answer, both
turns on one adapter (`team.shared_adapter`), trained with MARFT-A."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

DRAFT = RoleSection(
    "draft", "You are good at arithmetic. Answer the question in one line: the calculation, "
    "then the answer in \\boxed{}, e.g. 7 + 5 = \\boxed{12}.", "Answers the question.")
FINAL = RoleSection(
    "final", "You are good at arithmetic. Check your draft answer above and correct any "
    "mistake. Reply with only the final answer in \\boxed{}, e.g. \\boxed{12}.",
    "Checks the draft and gives the final answer.", graded=True)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_split_facts")
  return to_config_dict(TrainConfig(
      algorithm="marft_a", task=task,
      team=TeamSection(roles=(DRAFT, FINAL), order="draft,final", shared_adapter=True)))

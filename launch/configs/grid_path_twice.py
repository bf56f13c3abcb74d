"""One agent answering twice on grid_path (the team sweep, bench/learning.py): a draft path,
then its own check of the draft against the grid and the final path, both turns on one
adapter (`team.shared_adapter`), trained with MARFT-A."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

DRAFT = RoleSection(
    "draft", "You are good at finding paths. Check which candidate path goes from S to G "
    "without entering a # wall. Answer in one line, e.g. The path from S to G is R D R.",
    "Finds a path.")
FINAL = RoleSection(
    "final", "You are good at finding paths. Check your draft path above against the grid and "
    "correct it if it enters a wall. Answer in one line, e.g. The path from S to G is R D R.",
    "Checks the draft and gives the final path.", graded=True, max_new_tokens=32)


def get_config():
  task = TaskSection(name="marft_jax.envs.team_tasks:full_information_grid_path")
  return to_config_dict(TrainConfig(
      algorithm="marft_a", task=task,
      team=TeamSection(roles=(DRAFT, FINAL), order="draft,final", shared_adapter=True)))

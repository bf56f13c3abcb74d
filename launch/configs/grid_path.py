"""MARFT-A, planner → executor on a small grid with walls (envs/grid_path.py): the planner
picks the way from S to G among the task's candidate paths, the executor writes the final
path in the graded form. The roles are declared here (their calibration, with the untuned
SmolLM2-135M team's held-out accuracy: docs/team_tasks.md); the executor has 32 tokens, so a
path of up to 8 moves fits after "The path from S to G is"."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TaskSection, TeamSection, TrainConfig

_FORM = "Answer in one line, e.g. The path from S to G is R D R."
PLANNER = RoleSection(
    "planner", "You are the Planner of a two-person team. Check which candidate path goes from "
    f"S to G without entering a # wall. {_FORM}", "Writes the moves from S to G.")
EXECUTOR = RoleSection(
    "executor", "You are the Executor of a two-person team. Repeat the Planner's path in one "
    "line, e.g. The path from S to G is R D R.", "Writes the final path.", graded=True,
    max_new_tokens=32)


def get_config():
  return to_config_dict(TrainConfig(
      algorithm="marft_a", task=TaskSection(name="grid_path"),
      team=TeamSection(roles=(PLANNER, EXECUTOR), order="planner,executor")))

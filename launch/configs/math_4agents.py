"""MARFT-A, analyst → planner → solver → verifier, on GSM8K-style problems (task.path)."""

from marft_jax.configs import to_config_dict
from marft_jax.train import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(
      algorithm="marft_a",
      task=TaskSection(name="math_jsonl"),
      team=TeamSection(**teams.shipped("math_jsonl", 4)),
  ))

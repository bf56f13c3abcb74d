"""MARFT-A, reasoner → actor, on the bundled GSM8K-style problems (point task.path at
your own JSONL file: `--config.task.path=/data/gsm8k_train.jsonl`)."""

from marft_jax.configs import to_config_dict
from marft_jax.train import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(
      algorithm="marft_a",
      task=TaskSection(name="math_jsonl"),
      # Multi-step budgets (docs/results.md, "Math word-problem prompts: calibration"): with
      # 48 / 16 tokens the untuned reasoner was cut off mid-calculation on most GSM8K-style
      # problems (mean 34 tokens, at the cap on most) and every actor reply hit 16 before any
      # \boxed{}; 128 fits the quantities and 2-3 calculation lines, 32 a boxed answer.
      team=TeamSection(**teams.shipped("math_jsonl", 2), max_new_tokens=128,
                       last_max_new_tokens=32),
  ))

"""MARFT-A, reasoner → actor → verifier, on GSM8K-style problems (task.path)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TaskSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(
      algorithm="marft_a",
      task=TaskSection(name="math_jsonl"),
      # Multi-step budgets (docs/results.md, "Math word-problem prompts: calibration"): with
      # 48 / 16 tokens the untuned reasoner was cut off at 48 on 5 of the 12 GSM8K-style
      # fixtures and 11 of 12 actor replies hit 16 before any answer form. With 128 / 32 the
      # reasoner still hits 128 on 8 of 12 (mean 120) and the actor uses 28 on average: both
      # sized to hold 2-3 calculation lines and a boxed answer, not cut lower.
      team=TeamSection(**teams.shipped("math_jsonl", 3), max_new_tokens=128,
                       last_max_new_tokens=32),
  ))

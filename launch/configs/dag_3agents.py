"""A 3-role DAG on generated arithmetic: a calculator and an estimator work in parallel (each
sees only the task), then a judge, who sees both replies, gives the graded answer."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import RoleSection, TeamSection, TrainConfig


def get_config():
  roles = (
      RoleSection("calculator", "Compute the answer in one line, e.g. 7 + 5 = 12.",
                  "Computes the exact result."),
      RoleSection("estimator", "Estimate the answer roughly, in one line.",
                  "Estimates the result.", temperature=0.7),
      RoleSection("judge", "Two teammates answered. Reply with only the final answer, in "
                  "\\boxed{}, e.g. \\boxed{12}.", "Gives the final answer.", graded=True,
                  max_new_tokens=16),
  )
  team = TeamSection(roles=roles, order="calculator,estimator,judge", graph="dag",
                     edges="calculator>judge, estimator>judge", max_new_tokens=32)
  return to_config_dict(TrainConfig(algorithm="marft_a", team=team))

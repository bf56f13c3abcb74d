"""Single-agent PPO (the baseline): one solver, action level, on generated arithmetic."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="ppo",
                                    team=TeamSection(**teams.shipped("arithmetic", 1))))

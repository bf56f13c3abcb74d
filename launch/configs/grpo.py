"""GRPO without a critic: 4 rollouts of each task (the algorithm's default group size),
advantages normalised per task and agent; reasoner → actor on generated arithmetic."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import RolloutSection, TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="grpo",
                                    team=TeamSection(**teams.shipped("arithmetic", 2)),
                                    rollout=RolloutSection(num_envs=8)))

"""MARFT-T: token-level PPO (every token an action, Bellman backups across token, agent
and env-step boundaries), reasoner → actor on generated arithmetic."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_t",
                                    team=TeamSection(**teams.shipped("arithmetic", 2))))

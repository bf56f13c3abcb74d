"""The echo task for trainer tests: 2 agents "repeat the number shown" with numbers from [0, 1),
so the best reply ("0") is known and a random tiny model says it first in ~2 % of episodes.
As a launch config file (its model folder given as --config.model.source): 8 environments,
2 iterations."""

import dataclasses

from marft_jax.configs import to_config_dict
from marft_jax.lora.config import LoraConfig
from marft_jax.train import algorithms
from marft_jax.train import config as config_lib


def echo_config(algorithm: str = "marft_a", num_envs: int = 8, iterations: int = 2,
                **changes) -> config_lib.TrainConfig:
  base = config_lib.TrainConfig(algorithm=algorithm)
  sections = dict(
      task=config_lib.TaskSection(name="echo", echo_high=1),
      # Temperature: the exploration the echo tests were tuned with. A team of one speaks
      # with last_max_new_tokens (max_new_tokens is refused there).
      team=dataclasses.replace(base.team, last_max_new_tokens=3, temperature=0.7,
                               **({} if algorithms.get(algorithm).num_roles == 1 else
                                  {"max_new_tokens": 3})),
      rollout=dataclasses.replace(base.rollout, num_envs=num_envs, max_context=256),
      lora=LoraConfig(rank=8, alpha=16.0),
      optimizer=config_lib.OptimizerSection(lr=5e-3, epochs=2, minibatches=2),
      checkpoint_every=1000, iterations=iterations)
  if algorithms.get(algorithm).critic:  # a critic's keys are refused without one
    sections["critic"] = dataclasses.replace(base.critic, hidden=(64,), lr=3e-3)
  sections.update(changes)
  return algorithms.resolve(dataclasses.replace(base, **sections))


def get_config():
  return to_config_dict(echo_config())


def echo_flags(algorithm: str, num_envs: int = 8, iterations: int = 2) -> dict:
  """`echo_config` as command-line overrides of the default file launch/configs/train.py:
  what a user types after `python -m launch.train`, including `--config.algorithm`."""
  critic = {"critic.hidden": (64,), "critic.lr": 3e-3} if algorithms.get(algorithm).critic \
      else {}
  return {"algorithm": algorithm, "iterations": iterations, "eval_every": 0,
          "checkpoint_every": 1000, "task.name": "echo", "task.echo_high": 1,
          "team.max_new_tokens": 3, "team.last_max_new_tokens": 3, "team.temperature": 0.7,
          "rollout.num_envs": num_envs, "rollout.max_context": 256, "lora.rank": 8,
          "lora.alpha": 16.0, **critic,
          "optimizer.lr": 5e-3, "optimizer.epochs": 2, "optimizer.minibatches": 2}


def from_default_file(flags: dict) -> config_lib.TrainConfig:
  """The typed, resolved config `launch.train` builds from the default file and `flags`
  (dotted keys, as `--config.<key>=<value>`)."""
  import os
  from launch.cli import CONFIG_DIR, _load_config_file
  from marft_jax.configs import from_config_dict
  from marft_jax.train import algorithms
  config = _load_config_file(os.path.join(CONFIG_DIR, "train.py"))
  for key, value in flags.items():
    *sections, field = key.split(".")
    node = config
    for section in sections:
      node = node[section]
    node[field] = value
  return algorithms.resolve(from_config_dict(config_lib.TrainConfig, config))

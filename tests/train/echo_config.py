"""The echo task for trainer tests: 2 agents "repeat the number shown" with numbers from [0, 1),
so the best reply ("0") is known and a random tiny model says it first in ~2 % of episodes.
As a launch config file (its model folder given as --config.model.source): 8 environments,
2 iterations."""

import dataclasses

import jax

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


def varied_reward(episode, team):
  """A `reward.fn` for trainer tests: the environment's reward plus, per turn, its reply's
  length / 4 and half its role's index (an orchestrator's reply: its length / 8 to every
  role), so rewards differ between episodes, roles and steps. A tiny model's answers are
  rarely right, and which few are depends on the host's float rounding: the environment's
  rewards alone may be 0 in every episode, so no advantage and no update."""
  rewards = [list(map(float, r)) for r in episode.rewards]
  for turn in episode.turns:
    if turn.agent < len(team):
      rewards[turn.env_step][turn.agent] += len(turn.reply) / 4 + 0.5 * turn.agent
    else:  # an orchestrator's routing turn: the team's reward, as if it had hurried or dawdled
      step = rewards[turn.env_step]
      step[:] = [r + len(turn.reply) / 8 for r in step]
  return rewards


def tiny_trainer_model(max_position_embeddings: int = 1024, **shape):
  """The trainer tests' base: the tiny test model (`tiny_config` with `shape`'s changes) and
  tokenizer, with weights at std 0.1 from key 0."""
  from marft_jax.models import tiny, transformer
  from marft_jax.models.config import tiny_config
  from marft_jax.train.build import model as model_lib
  tokenizer = tiny.tiny_tokenizer()
  config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=max_position_embeddings,
                       **shape)
  return model_lib.Model(transformer.init_params(config, jax.random.key(0), std=0.1), config,
                        tokenizer)


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
  return resolved(_load_config_file(os.path.join(CONFIG_DIR, "train.py")), flags)


def set_keys(tree, overrides: dict):
  """`tree` (a nested dict or ConfigDict) with each dotted key of `overrides` set, as
  `--config.<key>=<value>` sets it; returns the same tree."""
  for key, value in overrides.items():
    *sections, field = key.split(".")
    node = tree
    for section in sections:
      node = node[section]
    node[field] = value
  return tree


def resolved(tree, overrides: dict) -> config_lib.TrainConfig:
  """The typed, resolved `TrainConfig` of a config tree with `overrides` (`set_keys`)."""
  from marft_jax.configs import from_config_dict
  return algorithms.resolve(from_config_dict(config_lib.TrainConfig, set_keys(tree, overrides)))

"""A run's environments and how its episodes are played, from the config: the task's entry
builds them (`tasks.lookup`).
"""

from __future__ import annotations

from typing import Collection, Optional

from marft_jax import envs as envs_lib
from marft_jax.rollout import RolloutConfig
from marft_jax.train import tasks
from marft_jax.train.config.schema import TrainConfig


def build_envs(config: TrainConfig, team, seed: int, split: str = "train",
               owned: Optional[range] = None, num_envs: Optional[int] = None,
               group_size: Optional[int] = None, trained: Collection[str] = ()):
  """An `EnvBatch` of the task's `split` ("train" or "test"; for problem files, the disjoint
  parts of `envs.splits.task_problems`, each problem once per epoch in a seeded order), with
  one grading worker or sandbox shared by its environments; `owned`: the environments this
  process builds and steps (default all); `num_envs`, `group_size`: instead of the config's
  rollout section (an evaluation plays one episode per task); `trained`: fingerprints of
  problems a checkpoint trained on, left out of the "test" split (a problem file's:
  `trained_problems.heldout_problems`; generated arithmetic: `trained_problems.Unseen`; a
  factory's: `tasks.unplayed`). The task's entry builds them (`tasks.lookup`)."""
  built = tasks.lookup(config.task.name).build(config.task, team, split, seed, trained)
  return envs_lib.EnvBatch(built.make, num_envs or config.rollout.num_envs, seed=seed,
                           group_size=group_size or config.rollout.group_size, owned=owned,
                           num_tasks=built.num_tasks, closing=built.shared)


def rollout_settings(config: TrainConfig) -> RolloutConfig:
  """How the trainer's and the evaluation's episodes are played."""
  return RolloutConfig(context_mode=config.rollout.context_mode, horizon=config.task.horizon,
                       max_context=config.rollout.max_context or None,
                       transition=config.team.transition or RolloutConfig.transition)

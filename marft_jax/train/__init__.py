"""marft_jax.train: the MARFT trainer, in layers that import only downwards
(`tests/test_layers.py` keeps them so), bottom first:

  leaves     checkpoint.py, saved_steps.py, write_failures.py, metrics.py, eval_progress.py,
             workdir_lock.py, optim.py
  maths      batching.py, local_batch.py, advantages.py, critic.py, update.py (each owning its
             section's dataclass: AdvantageConfig, CriticConfig, LossConfig)
  tasks      tasks.py (the task table), heldout.py
  config/    what a run is: sections, shipped teams, algorithms, TrainConfig, resolve, the
             saved-config record and the compatibility history
  build/     how it is built: preflight checks, team, environments, models, learners;
             trained_problems.py
  run        run.py: one interface for a team on one backbone or several (backbones.py,
             shared_critic.py beneath it)
  drivers    loop.py (`train`), async_rollout.py, evaluate.py, restore.py

`marft_jax.train.train(config, workdir, ..., task=factory)` is `loop.train`, imported on first
use (so `import marft_jax.train.config` loads no training loop). `algorithms`, `teams` and
`config_history` are the old import paths of `config.algorithms` / `config.resolve`,
`config.teams` and `config.history`, kept for code written against them."""


def __getattr__(name):
  if name == "train":
    from marft_jax.train.loop import train
    return train
  raise AttributeError(f"module 'marft_jax.train' has no attribute {name!r}")

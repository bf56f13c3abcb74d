"""marft_jax.train: the MARFT trainer.

`marft_jax.train.train(config, workdir, ..., task=factory)` is `loop.train`, imported on first
use (so `import marft_jax.train.config` loads no training loop)."""


def __getattr__(name):
  if name == "train":
    from marft_jax.train.loop import train
    return train
  raise AttributeError(f"module 'marft_jax.train' has no attribute {name!r}")

"""Shared fixtures of the LoRA tests: a tiny model and adapters whose B is not zero.

Both are drawn with NumPy: compiling JAX's threefry sampler for every shape costs seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import lora
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config

CONFIG = tiny_config()


def random_adapters(num_adapters, rank=4, targets=lora.ALL_LINEAR, seed=0, model_config=CONFIG):
  """Adapters (scale 2) with both factors random, so every adapter changes the model."""
  rng = np.random.default_rng(seed)
  shapes = transformer.linear_shapes(model_config)
  L, A = model_config.num_layers, num_adapters
  layers = {}
  for name in lora.LoraConfig(rank=rank, targets=targets).target_names():
    d_in, d_out = shapes[name]
    layers[name] = {"a": jnp.asarray(rng.normal(0, d_in ** -0.5, (L, A, d_in, rank)), jnp.float32),
                    "b": jnp.asarray(rng.normal(0, 0.2, (L, A, rank, d_out)), jnp.float32)}
  return lora.Adapters(layers=layers, scale=2.0)


def random_params(config=CONFIG, seed=0):
  """Weights normal(0, 0.1), norms 1 + normal(0, 0.1), in the tree of `init_params`."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))

  def draw(path, s):
    norm = "norm" in jax.tree_util.keystr(path)
    return jnp.asarray((1.0 if norm else 0.0) + 0.1 * rng.normal(size=s.shape), s.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


@pytest.fixture(scope="session")
def params():
  return random_params()

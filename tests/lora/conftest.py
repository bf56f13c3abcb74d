"""Shared fixtures of the LoRA tests: a tiny model and adapters whose B is not zero.

Both are drawn with NumPy: compiling JAX's threefry sampler for every shape costs seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import lora
from marft_jax.models import transformer
from marft_jax.models.targets import linear_shapes
from marft_jax.models.config import tiny_config

CONFIG = tiny_config()


def random_adapters(num_adapters, rank=4, targets=lora.ALL_LINEAR, seed=0, model_config=CONFIG):
  """Adapters (scale 2) with both factors random, so every adapter changes the model."""
  rng = np.random.default_rng(seed)
  shapes = linear_shapes(model_config)
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


# A training batch shared by the gradient tests (one compile serves several modules). Row 0: a
# prompt (base), agent 0's reply, then agent 1's; row 1: agent 2; rows 2, 3: agent 0, the base.
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (4, 8)))
IDS = jnp.asarray([[-1, -1, 0, 0, 0, 1, 1, 1], [2] * 8, [0] * 8, [-1] * 8])


def nll(trainable, base, tokens, ids, loss_mask):
  """Mean next-token NLL over positions where `loss_mask` [B, T] is set."""
  logits, _ = transformer.forward(base, tokens, CONFIG, lora=trainable, adapter_ids=ids)
  logp = jax.nn.log_softmax(logits[:, :-1])
  token_nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(token_nll * loss_mask[:, :-1]) / jnp.sum(loss_mask[:, :-1])


nll_value_and_grad = jax.jit(lora.trainable_value_and_grad(nll))

"""Creating, stacking and slicing adapter sets.

One agent's adapter is an `Adapters` with A = 1; per-agent adapters are stacked on the A axis
(`stack_adapters`) so that one forward routes every agent's tokens; `select_adapter` takes one
back out (for export or merging). Worked example, 2 layers, q/v targets, rank 4, 3 agents::

    adapters = init_adapters(LoraConfig(rank=4, targets="q_proj|v_proj"), model_config, rng, 3)
    adapters.layers["q_proj"]["a"].shape   # (2, 3, D, 4): Kaiming-uniform
    adapters.layers["q_proj"]["b"].shape   # (2, 3, 4, H*E): zeros, so the model starts as the base
    select_adapter(adapters, 1).num_adapters  # 1
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from marft_jax.lora.config import LoraConfig
from marft_jax.lora.routing import Adapters, select_adapter  # noqa: F401 (re-exported)
from marft_jax.architecture.config import ModelConfig
from marft_jax.architecture.targets import linear_shapes
from marft_jax.validation import check_positive_int


def init_adapters(lora_config: LoraConfig, model_config: ModelConfig, rng: jax.Array,
                  num_adapters: int = 1) -> Adapters:
  """Fresh adapters as PEFT creates them, deterministic given `rng`.

  `a` is Kaiming-uniform with a = √5 on PEFT's `lora_A.weight [R, D_in]` (fan-in D_in), i.e.
  U(-1/√D_in, 1/√D_in), independently for every layer, adapter and target; `b` is zero. The
  factors are float32 whatever the base dtype: optimizer updates to them are small.

  Returns:
    Adapters with `a`: [L, A, D_in, R] and `b`: [L, A, R, D_out] for each target.
  Raises:
    ValueError: the two configs swapped or of another type, or num_adapters not an int ≥ 1.
  """
  for name, value, kind in (("lora_config", lora_config, LoraConfig),
                            ("model_config", model_config, ModelConfig)):
    if not isinstance(value, kind):
      raise ValueError(f"init_adapters: {name} must be a {kind.__name__}, got "
                       f"{type(value).__name__}")
  check_positive_int("num_adapters", num_adapters)
  shapes = linear_shapes(model_config)
  names = lora_config.target_names()
  keys = jax.random.split(rng, len(names))
  L, A, R = model_config.num_layers, num_adapters, lora_config.rank
  layers = {}
  for key, name in zip(keys, names):
    fan_in, fan_out = shapes[name]
    bound = 1.0 / math.sqrt(fan_in)
    layers[name] = {"a": jax.random.uniform(key, (L, A, fan_in, R), jnp.float32, -bound, bound),
                    "b": jnp.zeros((L, A, R, fan_out), jnp.float32)}
  return Adapters(layers=layers, scale=lora_config.scale, dropout_rate=lora_config.dropout_rate)


def stack_adapters(adapters: Sequence[Adapters]) -> Adapters:
  """Concatenates adapter sets on the A axis (e.g. one A = 1 set per agent -> A = N)."""
  if not adapters:
    raise ValueError("stack_adapters: no adapter sets given")
  describe = lambda x: (f"targets {sorted(x.layers)}, rank {x.rank}, scale {x.scale}, "
                        f"dropout {x.dropout_rate}")
  for i, other in enumerate(adapters[1:], 1):
    if describe(other) != describe(adapters[0]):
      raise ValueError(f"adapter set {i} has {describe(other)}; set 0 has "
                       f"{describe(adapters[0])}: only identical configs stack")
  layers = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *[a.layers for a in adapters])
  return adapters[0].replace(layers=layers)

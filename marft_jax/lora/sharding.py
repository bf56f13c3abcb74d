"""Partition rules for adapter leaves: each factor is split like its base kernel.

`a` [L, A, D_in, R] splits D_in as the base kernel splits its input axis, `b` [L, A, R, D_out]
splits D_out as the base splits its output axis; L, A and R are replicated. A token's
down-projection then meets the same shards of x as the base matmul, and the up-projection
produces the same shards of y, so routing adds no resharding of activations.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from marft_jax import sharding
from marft_jax.lora.routing import Adapters
from marft_jax.architecture.targets import LINEAR


def adapter_logical_axes(adapters: Adapters) -> Adapters:
  """An `Adapters` whose leaves are tuples of logical axis names (one per dim)."""
  layers = {}
  for name in adapters.layers:
    fan_in, fan_out = LINEAR[name].in_axis, LINEAR[name].out_axis
    layers[name] = {"a": ("layers", "adapters", fan_in, "rank"),
                    "b": ("layers", "adapters", "rank", fan_out)}
  return adapters.replace(layers=layers, dropout_rng=None)


def adapter_shardings(mesh: Mesh, adapters: Adapters) -> Any:
  """`NamedSharding`s for `adapters` (arrays or `ShapeDtypeStruct`s); a dimension the mesh
  axis does not divide is replicated, as for the base parameters."""
  return sharding.shardings_for(mesh, adapters, adapter_logical_axes(adapters))


def follow_adapters(mesh: Mesh, tree: Any) -> Any:
  """`NamedSharding`s for any tree holding `Adapters` (a train state, a critic, an optimizer
  state): every `Adapters` in it is split like its base kernels, every other leaf replicated.

  Optimizer moments are `Adapters` themselves (optax maps over the params' structure), so Adam's
  μ and ν land on the same devices as the factors they update: the step is local."""
  is_adapters = lambda x: isinstance(x, Adapters)
  return jax.tree.map(lambda x: adapter_shardings(mesh, x) if is_adapters(x) else
                      sharding.replicated(mesh), tree, is_leaf=is_adapters)

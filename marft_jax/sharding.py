"""Meshes and partition rules: logical axis names of every array -> mesh axes.

Model code never names mesh axes. Each parameter gets logical axis names from its path
(`param_logical_axes`), and one table (`LOGICAL_RULES`) maps them onto the mesh
`("data", "fsdp", "tensor")`:

  batch   -> ("data", "fsdp")   rows of a batch
  embed   -> "fsdp"             model width D: weights are fully sharded (ZeRO-3 style)
  heads, kv_heads, mlp, vocab -> "tensor"   Megatron-style tensor parallelism
  layers, norms, LoRA rank    -> replicated

A dimension that a mesh axis does not divide is left replicated rather than rejected, so the
same rules serve every model size and mesh (e.g. SmolLM2's 3 kv heads on tensor=2).
Jitted entry points state shardings at the call: `jax.jit(f, in_shardings=..., out_shardings=...)`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from marft_jax.models.targets import GLOBALS, LINEAR

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: Mapping[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "layers": None,
    "adapters": None,
    "rank": None,
    "time": None,
    "cache_slots": None,
    "head_dim": None,
}

def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A `("data", "fsdp", "tensor")` mesh with Auto axis types.

  `jax.make_mesh` defaults to Explicit axes in JAX 0.10, under which gathers fail with a
  `ShardingTypeError`; Auto lets XLA propagate shardings from the jit boundary.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = data * fsdp * tensor
  if n > len(devices):
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {n} devices, "
                     f"{len(devices)} available")
  grid = np.array(devices[:n]).reshape(data, fsdp, tensor)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def param_logical_axes(params: Any) -> Any:
  """A tree like `params` whose leaves are tuples of logical axis names (one per dim)."""
  def axes(path, leaf):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if keys[0] in GLOBALS:
      return GLOBALS[keys[0]][2]
    if keys[0] == "layers" and keys[1] in LINEAR:
      fan_in, fan_out = LINEAR[keys[1]].in_axis, LINEAR[keys[1]].out_axis
      return ("layers", fan_in, fan_out) if keys[-1] == "kernel" else ("layers", fan_out)
    return (None,) * np.ndim(leaf)  # norms
  return jax.tree_util.tree_map_with_path(axes, params)


def logical_to_spec(logical_axes: Sequence[Optional[str]], shape: Optional[Sequence[int]] = None,
                    mesh: Optional[Mesh] = None,
                    rules: Mapping[str, Any] = LOGICAL_RULES) -> P:
  """Logical names -> `PartitionSpec`; with `shape` and `mesh`, drops axes that don't divide."""
  spec = []
  for i, name in enumerate(logical_axes):
    mesh_axes = None if name is None else rules[name]
    if mesh_axes is not None and shape is not None and mesh is not None:
      names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
      if shape[i] % int(np.prod([mesh.shape[a] for a in names])):
        mesh_axes = None
    spec.append(mesh_axes)
  return P(*spec)


def shardings_for(mesh: Mesh, tree: Any, logical_axes: Any) -> Any:
  """`NamedSharding`s for `tree` from a matching tree of logical-axis tuples."""
  leaves, treedef = jax.tree.flatten(tree)
  axes = treedef.flatten_up_to(logical_axes)
  return treedef.unflatten([
      NamedSharding(mesh, logical_to_spec(a, np.shape(x), mesh)) for x, a in zip(leaves, axes)])


def param_shardings(mesh: Mesh, params: Any) -> Any:
  """`NamedSharding` for every parameter (works on arrays or `ShapeDtypeStruct`s)."""
  return shardings_for(mesh, params, param_logical_axes(params))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows split over ("data", "fsdp"), the other `ndim - 1` dims replicated."""
  return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def cache_logical_axes(cache: Any) -> Any:
  """Logical axes of a stacked `KVCache`: k [L, B, K, E, S], v [L, B, K, S, E], valid [B, S]."""
  return type(cache)(k=("layers", "batch", "kv_heads", "head_dim", "cache_slots"),
                     v=("layers", "batch", "kv_heads", "cache_slots", "head_dim"),
                     valid=("batch", "cache_slots"), index=())


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())

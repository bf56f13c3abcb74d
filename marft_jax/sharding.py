"""Meshes and partition rules: logical axis names of every array -> mesh axes.

Model code never names mesh axes. Each parameter gets logical axis names from its path
(`param_logical_axes`), and one table (`LOGICAL_RULES`) maps them onto the mesh
`("data", "fsdp", "tensor")`:

  batch   -> ("data", "fsdp")   rows of a batch
  embed   -> "fsdp"             model width D: weights are fully sharded (ZeRO-3 style)
  heads, kv_heads, mlp, vocab -> "tensor"   Megatron-style tensor parallelism
  layers, norms, LoRA rank    -> replicated
  activations [B, T, D]       -> rows over ("data", "fsdp"), the rest replicated

Model code pins its activations at the layer boundaries with `constrain(x, logical_axes)`,
which reads the mesh that the caller set (`with jax.set_mesh(mesh):`, as `train` does) and is
the identity outside one, so single-device code and unit tests pay nothing. Without the pin
the partitioner may choose to gather a whole activation onto every device.

A dimension that a mesh axis does not divide is left replicated rather than rejected, so the
same rules serve every model size and mesh (e.g. SmolLM2's 3 kv heads on tensor=2).
Jitted entry points state shardings at the call: `jax.jit(f, in_shardings=..., out_shardings=...)`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from marft_jax.architecture.targets import GLOBALS, LINEAR

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
    "act_embed": None,  # the residual stream's width: the batch split is the one that matters
    "act_tokens": ("data", "fsdp"),  # feature-major activations [D, B·T]: rows of B·T
}

def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """A `("data", "fsdp", "tensor")` mesh with Auto axis types over the first devices.

  Each size is an int >= 1, or -1 for one axis: all the devices the others leave
  (`mesh_shape`). `jax.make_mesh` defaults to Explicit axes in JAX 0.10, under which gathers
  fail with a `ShardingTypeError`; Auto lets XLA propagate shardings from the jit boundary.
  """
  devices = list(jax.devices() if devices is None else devices)
  # Checked: a size of 0 made an empty mesh, and -1 sliced devices[:-1] (7 of 8).
  data, fsdp, tensor = mesh_shape(data, fsdp, tensor, len(devices))
  grid = np.array(devices[:data * fsdp * tensor]).reshape(data, fsdp, tensor)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def check_mesh_sizes(data: int, fsdp: int, tensor: int) -> None:
  """Each size is >= 1 or -1 ("fill the remaining devices"), with at most one -1; errors name
  the config key (`mesh.data`, ...), so a bad mesh fails before any model loads."""
  sizes = dict(data=data, fsdp=fsdp, tensor=tensor)
  for axis, size in sizes.items():
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f"mesh.{axis}={size!r}: use a size >= 1, or -1 to fill the devices")
  fill = [axis for axis, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ValueError(f"mesh.{fill[0]} and mesh.{fill[1]} are both -1: at most one axis can "
                     "fill the devices")


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
  """The sizes with a -1 resolved against `num_devices`: `mesh_shape(-1, 2, 1, 8) == (4, 2, 1)`.

  Raises ValueError naming the key when the sizes do not fit the devices."""
  check_mesh_sizes(data, fsdp, tensor)
  sizes = dict(data=data, fsdp=fsdp, tensor=tensor)
  fixed = int(np.prod([size for size in sizes.values() if size != -1]))
  fill = [axis for axis, size in sizes.items() if size == -1]
  if fill:
    if num_devices % fixed:
      raise ValueError(f"mesh.{fill[0]}=-1: the other axes multiply to {fixed}, which does "
                       f"not divide the {num_devices} devices")
    sizes[fill[0]] = num_devices // fixed
  total = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
  if total > num_devices:
    raise ValueError(f"mesh.data={sizes['data']} x mesh.fsdp={sizes['fsdp']} x "
                     f"mesh.tensor={sizes['tensor']} needs {total} devices, {num_devices} "
                     "available (set one axis to -1 to fill them)")
  return sizes["data"], sizes["fsdp"], sizes["tensor"]


def mesh_from_config(data: int, fsdp: int, tensor: int) -> Mesh:
  """The run's mesh over all devices of all processes (`jax.devices()`).

  A single process may use the first few of its devices; a multi-process mesh must hold every
  device, or some process would own none of the arrays it is asked to compute.
  """
  shape = mesh_shape(data, fsdp, tensor, jax.device_count())
  if jax.process_count() > 1 and int(np.prod(shape)) != jax.device_count():
    raise ValueError(f"mesh.data={shape[0]} x mesh.fsdp={shape[1]} x mesh.tensor={shape[2]} "
                     f"covers {int(np.prod(shape))} of the {jax.device_count()} devices of "
                     f"{jax.process_count()} processes: a multi-process mesh must cover "
                     "them all (set one axis to -1)")
  return make_mesh(*shape)


def batch_shards(mesh: Mesh) -> int:
  """Into how many row blocks a batch is split ("data" x "fsdp")."""
  return mesh.shape["data"] * mesh.shape["fsdp"]


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


def batch_shardings(mesh: Mesh, batch: Any) -> Any:
  """`batch_sharding` for every leaf of a tree of [B, ...] arrays (scalars replicated)."""
  return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x)) if np.ndim(x) else
                      replicated(mesh), batch)


def constrain(x: jax.Array, logical_axes: Sequence[Optional[str]]) -> jax.Array:
  """`x` pinned to the mesh axes of its logical axes under the current mesh (`jax.set_mesh`);
  the identity without one or on one device. A dimension the mesh does not divide stays
  replicated, as in `logical_to_spec`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def cache_logical_axes(cache: Any) -> Any:
  """Logical axes of a stacked `KVCache`: k [L, B, K, E, S], v [L, B, K, S, E], valid [B, S]."""
  return type(cache)(k=("layers", "batch", "kv_heads", "head_dim", "cache_slots"),
                     v=("layers", "batch", "kv_heads", "cache_slots", "head_dim"),
                     valid=("batch", "cache_slots"), index=())


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())

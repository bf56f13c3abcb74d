"""Running as one of several processes (JAX's multi-controller runtime), and the few host-side
operations that change when arrays span processes.

Every process runs the same program on its own devices; a jitted call sees global arrays whose
shards live on every process's devices. Host code may only read shards it holds, so reading a
split array whole is a collective (`to_host`), and side effects on shared storage (metrics,
transcripts, PEFT exports) are left to process 0 (`is_primary`). Orbax checkpoints are written
and read by every process, each its own shards.

Batches whose rows are split over the mesh's batch axes ("data" x "fsdp") are divided among
the processes in contiguous blocks (`ProcessRows`): a process builds only its own rows
(`ProcessRows.put`) and reads back only its own rows (`ProcessRows.get`), which needs no
collective. What the processes must agree on (a padded width, whether anything is left to
do, a sum for a global mean) goes through small collectives (`max_over_processes`,
`sum_over_processes`, `any_process`, `gather_objects`), called by every process at the same
point of the program.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)  # flags
    initialize()  # a Cloud TPU slice, SLURM, Open MPI or Kubernetes job: read from the env
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def initialize(coordinator_address: str = "", num_processes: int = 0,
               process_id: int = -1) -> None:
  """`jax.distributed.initialize`, before anything touches a device. On CPU (a localhost
  rehearsal with `jax_num_cpu_devices` set) collectives run over Gloo, JAX's CPU default.

  Args:
    coordinator_address: "host:port" of process 0 ("": detected from the cluster's
      environment, as are the next two).
    num_processes: processes in the job (0: detected).
    process_id: this process's rank (-1: detected).
  """
  jax.distributed.initialize(coordinator_address=coordinator_address or None,
                             num_processes=num_processes or None,
                             process_id=None if process_id < 0 else process_id)


def is_primary() -> bool:
  """True in the one process (0) that writes shared files."""
  return jax.process_index() == 0


def to_host(tree: Any) -> Any:
  """NumPy copies of a tree's arrays. An array split over several processes is all-gathered
  first: a collective, so every process must call this at the same point of the program."""
  def fetch(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(fetch, tree)


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is True on any (one process alone cannot stop a run: the
  others would wait for it in the next collective). One tiny all-gather; free on one process."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def max_over_processes(values) -> np.ndarray:
  """The elementwise max of a small int/float vector over the processes (the same on every
  process). A collective; free on one process."""
  values = np.asarray(values)
  if jax.process_count() == 1:
    return values
  return np.max(multihost_utils.process_allgather(values), axis=0)


def sum_over_processes(values) -> np.ndarray:
  """The elementwise sum of a small vector over the processes, in float64, added in process
  order (so every process gets the same bits). A collective; free on one process."""
  values = np.asarray(values, np.float64)
  if jax.process_count() == 1:
    return values
  gathered = multihost_utils.process_allgather(values)
  total = np.zeros_like(values)
  for part in gathered:  # a fixed order, not numpy's pairwise sum
    total = total + part
  return total


def gather_blocks(block: np.ndarray) -> np.ndarray:
  """Every process's equally long block, concatenated in process order (e.g. each process's
  share of a per-environment counter -> the whole counter). A collective."""
  block = np.asarray(block)
  if jax.process_count() == 1:
    return block
  return np.asarray(multihost_utils.process_allgather(block, tiled=True))


def gather_objects(obj: Any) -> list:
  """[obj of process 0, obj of process 1, ...] on every process, for small picklable host
  records (episode transcripts, counters): two collectives (the lengths, then the bytes).
  The processes run the same program, so unpickling their bytes is as safe as running it."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj), np.uint8)
  lengths = multihost_utils.process_allgather(np.asarray([data.size], np.int64))[:, 0]
  padded = np.zeros((int(lengths.max()),), np.uint8)
  padded[:data.size] = data
  gathered = multihost_utils.process_allgather(padded)
  return [pickle.loads(gathered[p, :int(n)].tobytes()) for p, n in enumerate(lengths)]


@dataclasses.dataclass(frozen=True)
class ProcessRows:
  """A batch's rows split over `mesh`'s batch axes ("data" x "fsdp"), seen from one process:
  process p of P holds the p-th of P equal, contiguous row blocks (devices are laid out
  process by process, so the batch shards of one process are neighbours).

  Host code works on its block only: `put` turns this process's rows [B/P, ...] into the
  global [B, ...] array (no data crosses processes), `get` reads this process's rows of a
  global array back from its own devices. B must be a multiple of data x fsdp.
  """

  mesh: Mesh

  @property
  def processes(self) -> int:
    return jax.process_count()

  def sharding(self, ndim: int, axis: int = 0) -> NamedSharding:
    """Rows (dimension `axis`) over ("data", "fsdp"), everything else replicated (a
    scalar: replicated)."""
    spec = [None] * ndim
    if ndim:
      spec[axis] = ("data", "fsdp")
    return NamedSharding(self.mesh, P(*spec))

  def block(self, num_rows: int) -> range:
    """The rows of a `num_rows`-row batch that this process holds. ValueError if the mesh
    does not give each process one contiguous block of B/P rows."""
    return _block(self.mesh, num_rows)

  def put(self, local: np.ndarray, axis: int = 0) -> jax.Array:
    """This process's rows (dimension `axis`: [..., B/P, ...]) -> the global [..., B, ...]
    array, rows over the batch axes."""
    local = np.asarray(local)
    shape = list(local.shape)
    shape[axis] *= self.processes
    return jax.make_array_from_process_local_data(self.sharding(local.ndim, axis), local,
                                                  tuple(shape))

  def get(self, x: jax.Array) -> np.ndarray:
    """This process's rows of a global [B, ...] array, read from its own devices (a copy).

    Falls back to an all-gather (a collective) if the array's layout does not put these
    rows on this process's devices (e.g. an output the partitioner left whole elsewhere)."""
    if jax.process_count() == 1 or x.ndim == 0:
      return np.asarray(x)
    rows = self.block(x.shape[0])
    out = np.empty((len(rows),) + x.shape[1:], x.dtype)
    filled = np.zeros(out.shape, bool)
    for shard in x.addressable_shards:
      index = shard.index
      first = range(x.shape[0])[index[0]]
      lo, hi = max(first.start, rows.start), min(first.stop, rows.stop)
      if lo >= hi:
        continue
      target = (slice(lo - rows.start, hi - rows.start),) + tuple(index[1:])
      if filled[target].all():
        continue  # a replica of a part already read (e.g. over "tensor")
      data = np.asarray(shard.data)
      out[target] = data[lo - first.start:hi - first.start]
      filled[target] = True
    if not filled.all():
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))[rows.start:rows.stop]
    return out


@functools.lru_cache(maxsize=64)
def _block(mesh: Mesh, num_rows: int) -> range:
  """See `ProcessRows.block` (cached: the rollout asks once per sampler call)."""
  processes = jax.process_count()
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if num_rows % shards or shards % processes:
    raise ValueError(f"{num_rows} rows over {shards} batch shards and {processes} processes: "
                     "the rows must split evenly over the shards, and the shards over the "
                     "processes")
  size = num_rows // processes
  start = jax.process_index() * size
  held = set()
  rows = NamedSharding(mesh, P(("data", "fsdp")))
  for index in rows.addressable_devices_indices_map((num_rows,)).values():
    held.update(range(num_rows)[index[0]])
  if held != set(range(start, start + size)):
    raise ValueError(f"process {jax.process_index()} holds rows {sorted(held)[:8]}..., not the "
                     f"block [{start}, {start + size}): the mesh's devices are not laid out "
                     "process by process")
  return range(start, start + size)

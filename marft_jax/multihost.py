"""Running as one of several processes (JAX's multi-controller runtime), and the few host-side
operations that change when arrays span processes.

Every process runs the same program on its own devices; a jitted call sees global arrays whose
shards live on every process's devices. Host code may only read shards it holds, so reading a
split array is a collective (`to_host`), and side effects on shared storage (metrics,
transcripts, PEFT exports) are left to process 0 (`is_primary`). Orbax checkpoints are written
and read by every process, each its own shards.

    initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)  # flags
    initialize()  # a Cloud TPU slice, SLURM, Open MPI or Kubernetes job: read from the env
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


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


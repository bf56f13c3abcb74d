"""A multi-process job's training batch: each process batches the episodes it played.

Process p of P owns the p-th block of B/P rows of the global [B, ...] batch
(`multihost.ProcessRows`), and stacks its own episodes into it with `batching.make_batch`.
The blocks must share one shape, so the processes agree on the widths first: T tokens, K turns
and P trained positions a row, the maxima over the processes, which are what `make_batch`
would bucket for all the episodes at once (its buckets grow with the longest row). Each block
is then padded to them with `make_batch`'s own padding values (`batching.PADDING`); a process
with no episode to train contributes a block of padding rows, masked out of every loss.

    block = local_block(my_kept_episodes, pad_id, rows_per_process)   # a collective
    on_devices = jax.tree.map(process_rows.put, block)                 # the global batch
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from marft_jax import multihost
from marft_jax.rollout.episode import Episode
from marft_jax.train.batching import (MIN_LENGTH_BUCKET, TrainBatch, make_batch,
                                      padding_fields)

def widths(batch: Optional[TrainBatch]) -> tuple[int, int, int]:
  """(T, K, P) of a batch; zeros for none."""
  if batch is None:
    return 0, 0, 0
  return (batch.tokens.shape[1], batch.turn_valid.shape[1], batch.act_positions.shape[1])


def pad_batch(batch: Optional[TrainBatch], num_rows: int, T: int, K: int, P: int,
              pad_id: int) -> TrainBatch:
  """`batch` (rows ≤ num_rows, widths ≤ T, K, P; None: no rows) padded to [num_rows, T],
  [num_rows, K] and [num_rows, P] with `make_batch`'s padding values (`batching.PADDING`)."""
  fields = padding_fields(num_rows, T, K, P, pad_id)
  if batch is not None:
    for name, out in fields.items():
      value = np.asarray(getattr(batch, name))
      out[tuple(slice(0, n) for n in value.shape)] = value
  return TrainBatch(**fields)


def local_block(episodes: Sequence[Episode], pad_id: int, num_rows: int,
                row_length_step: int = MIN_LENGTH_BUCKET) -> TrainBatch:
  """This process's [num_rows, ...] block of the global batch, from its own episodes, padded
  to the widths every process agreed on (a collective: every process calls it, with or
  without episodes). `row_length_step`: `make_batch`'s."""
  batch = make_batch(episodes, pad_id, num_rows=num_rows,
                     row_length_step=row_length_step) if episodes else None
  if batch is not None and batch.tokens.shape[0] != num_rows:
    raise ValueError(f"{batch.tokens.shape[0]} rows of sequences do not fit this process's "
                     f"block of {num_rows} rows")
  T, K, P = (int(n) for n in multihost.max_over_processes(np.asarray(widths(batch), np.int64)))
  return pad_batch(batch, num_rows, T, K, P, pad_id)


"""Routing tokens through per-agent LoRA adapters inside one batched matmul.

An adapter set holds A adapters stacked on a leading axis; each token carries the id of the
adapter it goes through (`adapter_ids`, -1 = no adapter: the frozen base model). One forward
therefore serves a batch that mixes agents, and a sequence whose tokens belong to different
agents, without a pass per agent.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

NO_ADAPTER = -1


@struct.dataclass
class Adapters:
  """LoRA weights for every target linear layer, A adapters stacked.

  `layers` maps a target name of the base tree (`"q_proj"`, ..., `"down_proj"`) to
  `{"a": [L, A, D_in, R], "b": [L, A, R, D_out]}`: L layers (scanned with the base), A adapters.
  The update of target W for an adapter is `scale * x @ a @ b` (PEFT's `lora_B(lora_A(x))`).
  """

  layers: dict[str, dict[str, jax.Array]]
  scale: float = struct.field(pytree_node=False, default=1.0)  # alpha / R, or alpha / sqrt(R).

  @property
  def num_adapters(self) -> int:
    first = next(iter(self.layers.values()))
    return first["a"].shape[1]


def routed_lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, adapter_ids: jax.Array,
                      scale: float) -> jax.Array:
  """Δy[b,t] = scale · x[b,t] @ a[id] @ b[id] with id = adapter_ids[b,t]; 0 where id = -1.

  All A down-projections are computed (R is small, so this is cheap) and the one-hot of the
  id selects which one reaches the up-projection; the result is exactly the per-adapter
  output because the unselected terms are multiplied by 0.

  Args:
    x: [B, T, D_in]. a: [A, D_in, R]. b: [A, R, D_out].
    adapter_ids: [B, T] int in [-1, A).
    scale: the LoRA scale.
  Returns:
    [B, T, D_out] in x's dtype.
  """
  onehot = jax.nn.one_hot(adapter_ids, a.shape[0], dtype=x.dtype)  # -1 gives a zero row.
  down = jnp.einsum("btd,adr->btar", x, a.astype(x.dtype)) * onehot[..., None]
  return jnp.einsum("btar,aro->bto", down, b.astype(x.dtype)) * jnp.asarray(scale, x.dtype)


def broadcast_adapter_ids(adapter_ids: Any, batch: int, time: int) -> jax.Array:
  """Per-sequence ids [B] (or a scalar) become per-token ids [B, T]."""
  ids = jnp.asarray(adapter_ids, jnp.int32)
  if ids.ndim == 0:
    ids = jnp.full((batch,), ids)
  if ids.ndim == 1:
    ids = jnp.broadcast_to(ids[:, None], (batch, time))
  return ids

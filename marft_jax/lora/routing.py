"""Routing tokens through per-agent LoRA adapters inside one batched forward.

An adapter set holds A adapters stacked on a leading axis; each token carries the id of the
adapter it goes through (`adapter_ids`, -1 = no adapter: the frozen base model). One forward
therefore serves a batch that mixes agents, and a sequence whose tokens belong to different
agents, without a pass per agent.

The ids must be the ones the tokens were sampled with: a token's keys and values (and so every
later token's output) depend on the adapter that processed it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marft_jax.validation import check_ids

NO_ADAPTER = -1
# Per-token ids with at least this many adapters take the sorted (grouped) path.
GROUPED_MIN_ADAPTERS = 2
# Tokens sorted together by the grouped path (whole rows; see `_rows_per_block`).
BLOCK_TOKENS = 1024


@struct.dataclass
class Adapters:
  """LoRA weights for every target linear layer, A adapters stacked.

  `layers` maps a target name of the base tree to its two factors, L layers (scanned with the
  base) by A adapters::

      {"q_proj": {"a": [L, A, D_in, R], "b": [L, A, R, D_out]}, "v_proj": {...}, ...}

  The update of target W for adapter i is `scale * dropout(x) @ a[:, i] @ b[:, i]`; `a` is
  PEFT's `lora_A.weight` transposed, `b` is `lora_B.weight` transposed.

  `dropout_rng` is set only inside a training loss (`with_dropout`): it is not a trainable
  leaf, so the adapters passed to `jax.grad` leave it None, and without it there is no dropout.
  """

  layers: dict[str, dict[str, jax.Array]]
  scale: float = struct.field(pytree_node=False, default=1.0)  # alpha / R, or alpha / sqrt(R).
  dropout_rate: float = struct.field(pytree_node=False, default=0.0)
  dropout_rng: Optional[jax.Array] = None

  @property
  def num_adapters(self) -> int:
    return next(iter(self.layers.values()))["a"].shape[1]

  @property
  def num_layers(self) -> int:
    return next(iter(self.layers.values()))["a"].shape[0]

  @property
  def rank(self) -> int:
    return next(iter(self.layers.values()))["a"].shape[-1]

  def with_dropout(self, rng: jax.Array) -> "Adapters":
    """These adapters with LoRA dropout on (a no-op when `dropout_rate` is 0)."""
    return self.replace(dropout_rng=rng)

  def scan_inputs(self) -> dict[str, dict[str, jax.Array]]:
    """The per-layer tree scanned with the base layers: `layers`, plus a dropout key [L] per
    target when dropout is on (independent masks for every layer and target)."""
    if self.dropout_rng is None or self.dropout_rate == 0.0:
      return self.layers
    names = sorted(self.layers)
    keys = jax.random.split(self.dropout_rng, (self.num_layers, len(names)))
    return {name: dict(self.layers[name], dropout_key=keys[:, i]) for i, name in enumerate(names)}

  def delta_fn(self, feature_major: bool = False
               ) -> Callable[[jax.Array, dict, jax.Array], jax.Array]:
    """`routed_lora_delta` (or, for activations [D_in, B·T], `feature_major_lora_delta`) with
    this set's static scale and dropout rate bound: what a layer calls on its slice of
    `scan_inputs()`."""
    route = feature_major_lora_delta if feature_major else routed_lora_delta
    return functools.partial(route, scale=self.scale, dropout_rate=self.dropout_rate)


def check_adapter_index(index: Any, num_adapters: int) -> None:
  """Refuses anything but a Python or NumPy int in [0, A), naming `index`. An array index of
  -1 or A would silently wrap or clamp (NumPy, JAX) to another adapter, and -1 means "no
  adapter" everywhere else in the library."""
  is_int = isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_))
  if not is_int or not 0 <= index < num_adapters:
    raise ValueError(f"index={index!r}: use an int in [0, {num_adapters}), the adapters hold "
                     f"{num_adapters}")


def select_adapter(adapters: Adapters, index: int) -> Adapters:
  """Adapter `index` alone, as an A = 1 set."""
  check_adapter_index(index, adapters.num_adapters)
  return adapters.replace(layers=jax.tree.map(lambda x: x[:, index:index + 1], adapters.layers))


def canonical_adapter_ids(adapter_ids: Any, batch: int, time: int,
                          num_adapters: Optional[int] = None) -> jax.Array:
  """A scalar becomes per-sequence ids [B]; [B] and per-token [B, T] ids are kept as they are.

  Per-sequence ids take the cheaper gather path of `routed_lora_delta`. With `num_adapters`,
  ids outside [-1, A) are refused: a ValueError naming `adapter_ids` for concrete ids, a
  `checkify` error for traced ids under `jax.experimental.checkify.checkify` traced inside
  `validation.traced_checks()` (otherwise they route to the base model on every path, see
  `routed_lora_delta`).
  """
  if num_adapters is not None:
    check_ids("adapter_ids", adapter_ids, num_adapters, low=NO_ADAPTER)
  ids = jnp.asarray(adapter_ids, jnp.int32)
  if ids.ndim == 0:
    ids = jnp.full((batch,), ids)
  elif ids.shape not in ((batch,), (batch, time)):
    raise ValueError(f"adapter_ids has shape {ids.shape}; expected (), ({batch},) or "
                     f"({batch}, {time})")
  return ids


def broadcast_adapter_ids(adapter_ids: Any, batch: int, time: int,
                          num_adapters: Optional[int] = None) -> jax.Array:
  """Per-sequence ids [B] (or a scalar) become per-token ids [B, T]; checked as in
  `canonical_adapter_ids`."""
  ids = canonical_adapter_ids(adapter_ids, batch, time, num_adapters)
  return ids if ids.ndim == 2 else jnp.broadcast_to(ids[:, None], (batch, time))


def adapter_ids_for_agents(agent_ids: jax.Array, shared: bool) -> jax.Array:
  """Adapter ids from agent ids (any shape, -1 = base): identity per agent, or every agent's
  tokens through adapter 0 when all agents share one adapter."""
  agent_ids = jnp.asarray(agent_ids, jnp.int32)
  return jnp.where(agent_ids >= 0, 0, NO_ADAPTER) if shared else agent_ids


def routed_lora_delta(x: jax.Array, adapter: dict[str, jax.Array], adapter_ids: jax.Array,
                      scale: float, dropout_rate: float = 0.0) -> jax.Array:
  """Δy[b,t] = scale · dropout(x[b,t]) @ a[i] @ b[i], i = adapter_ids[b,t]; 0 where i = -1.

  Args:
    x: [B, T, D_in].
    adapter: one layer's {"a": [A, D_in, R], "b": [A, R, D_out]}, and "dropout_key" in training.
    adapter_ids: [B] per-sequence or [B, T] per-token ints in [-1, A). An id outside that
      range (checked by `canonical_adapter_ids` where it can be) gets no adapter, on every
      route alike, so that the sampler and the trainer never compute different policies.
    scale: the LoRA scale (static).
    dropout_rate: applied only when `adapter` holds a "dropout_key" (static).
  Returns:
    [B, T, D_out] in x's dtype.
  """
  x = _dropout(jnp.asarray(x), adapter.get("dropout_key"), dropout_rate)
  a, b = jnp.asarray(adapter["a"], x.dtype), jnp.asarray(adapter["b"], x.dtype)
  adapter_ids = jnp.where((adapter_ids >= 0) & (adapter_ids < a.shape[0]), adapter_ids,
                          NO_ADAPTER)
  if adapter_ids.ndim == 1:
    route = _single if a.shape[0] == 1 else _per_sequence
  else:
    route = _per_token_grouped if a.shape[0] >= GROUPED_MIN_ADAPTERS else _per_token
  return route(x, a, b, adapter_ids) * jnp.asarray(scale, x.dtype)


def feature_major_lora_delta(x: jax.Array, adapter: dict[str, jax.Array],
                             adapter_ids: jax.Array, scale: float,
                             dropout_rate: float = 0.0) -> jax.Array:
  """`routed_lora_delta` for feature-major activations x [D_in, B·T] -> [D_out, B·T].

  One adapter with per-sequence ids (a sampler call whose rows share an agent) stays
  feature-major: `bᵀ (aᵀ x)`, the weights on the left as the decoding layout wants them.
  Anything else goes through the token-major router and back (two transposes of x).
  """
  a, b = jnp.asarray(adapter["a"], x.dtype), jnp.asarray(adapter["b"], x.dtype)
  B = adapter_ids.shape[0]
  if a.shape[0] == 1 and adapter_ids.ndim == 1 and "dropout_key" not in adapter:
    keep = (adapter_ids == 0).astype(x.dtype)  # any other id gets the base, as on every route
    down = jnp.einsum("dr,dn->rn", a[0], x) * jnp.repeat(keep, x.shape[1] // B)[None, :]
    return jnp.einsum("ro,rn->on", b[0], down) * jnp.asarray(scale, x.dtype)
  tokens = x.T.reshape(B, x.shape[1] // B, -1)
  delta = routed_lora_delta(tokens, adapter, adapter_ids, scale, dropout_rate)
  return delta.reshape(x.shape[1], -1).T


def _single(x, a, b, ids):
  """One adapter (A = 1), per-sequence ids: two matmuls over every token; id -1 rows zeroed."""
  down = jnp.einsum("btd,dr->btr", x, a[0]) * (ids >= 0).astype(x.dtype)[:, None, None]
  return jnp.einsum("btr,ro->bto", down, b[0])


def _per_sequence(x, a, b, ids):
  """Gathers each row's factors ([B, D_in, R], [B, R, D_out]): the cost of a single adapter."""
  safe = jnp.maximum(ids, 0)
  down = jnp.einsum("btd,bdr->btr", x, a[safe])
  down = down * (ids >= 0).astype(x.dtype)[:, None, None]
  return jnp.einsum("btr,bro->bto", down, b[safe])


def _per_token(x, a, b, ids):
  """All A down-projections as one [D_in, A·R] matmul; the id's one-hot keeps one of them.

  Exact: the unselected terms are multiplied by 0 (and an id of -1 has an all-zero one-hot).
  The cost is A single-adapter LoRA branches.
  """
  onehot = jax.nn.one_hot(ids, a.shape[0], dtype=x.dtype)  # [B, T, A]
  down = jnp.einsum("btd,adr->btar", x, a) * onehot[..., None]
  return jnp.einsum("btar,aro->bto", down, b)


def _per_token_grouped(x, a, b, ids):
  """Tokens sorted by adapter into tiles of C rows, each tile holding one adapter's tokens.

  Every token meets only its own adapter's factors (gathered per tile), so the cost is one
  LoRA branch plus fewer than A·C padding rows and two row permutations, whatever A is.

  Sorting happens within blocks of k whole rows (`_rows_per_block`), never across them: with
  the batch split over devices, a block then sits on one device and the permutations need no
  communication (a sort over the whole batch made XLA all-reduce permuted activations).
  """
  B, T, D = x.shape
  k = _rows_per_block(B, T)
  blocks = jax.vmap(functools.partial(_grouped_block, a=a, b=b))(
      x.reshape(B // k, k * T, D), ids.reshape(B // k, k * T))
  return blocks.reshape(B, T, -1)


def _rows_per_block(batch: int, time: int) -> int:
  """The largest power of two k dividing B with k·T ≤ BLOCK_TOKENS (at least 1).

  Blocks of ~1k tokens fill tiles big enough for efficient matmuls, and stay within one
  device's rows unless a device holds fewer than ~1k tokens of the batch.
  """
  k = 1
  while batch % (2 * k) == 0 and 2 * k * time <= BLOCK_TOKENS:
    k *= 2
  return k


def _grouped_block(x, ids, a, b):
  """`_per_token_grouped` for one block. x: [N, D_in]; ids: [N]. Tokens with id -1 are left
  out of the tiles and read a zero row."""
  N, A = x.shape[0], a.shape[0]
  rows = _tile_rows(N, A)
  num_tiles = (N + A * (rows - 1)) // rows  # Bounds Σ_g ceil(size_g / C) for Σ size_g ≤ N.
  dest, tile_adapter = _tile_layout(ids, A, rows, num_tiles)
  # src[r]: the token in padded row r, or N (the zero row) for padding.
  src = jnp.full((num_tiles * rows + 1,), N, jnp.int32).at[dest].set(jnp.arange(N))[:-1]
  tiles = _permute_rows(x, src, dest).reshape(num_tiles, rows, -1)
  down = jnp.einsum("tcd,tdr->tcr", tiles, a[tile_adapter])
  up = jnp.einsum("tcr,tro->tco", down, b[tile_adapter])
  return _permute_rows(up.reshape(num_tiles * rows, -1), dest, src)


@jax.custom_vjp
def _permute_rows(x, index, inverse):
  """y[r] = x[index[r]], or 0 where index[r] = len(x).

  `inverse` maps back: inverse[n] is the one r with index[r] = n, or len(y) if none. The
  gradient is then the gather `dx[n] = dy[inverse[n]]` rather than a scatter-add, which XLA
  runs several times slower on CPU.
  """
  return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _permute_rows_fwd(x, index, inverse):
  return _permute_rows(x, index, inverse), (index, inverse)


def _permute_rows_bwd(residuals, dy):
  index, inverse = residuals
  return _permute_rows(dy, inverse, index), None, None


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _tile_rows(num_tokens: int, num_adapters: int) -> int:
  """Rows per tile C: the power of two at most N / 2A, within [16, 512].

  Padding (< A·C rows: under N / 2 once N ≥ 32A) buys tiles big enough for efficient matmuls:
  on CPU, tiles of 32 rows made a 4-adapter step 10% slower than tiles of 64 despite less
  padding.
  """
  target = max(num_tokens // (2 * num_adapters), 1)
  return int(min(max(1 << (target.bit_length() - 1), 16), 512))


def _tile_layout(ids, num_adapters, rows, num_tiles):
  """dest [N]: each token's padded row (num_tiles·rows for id -1); tile_adapter [num_tiles].

  Adapter g's tokens fill rows [start_g, start_g + size_g) in their original order, where
  start_g is the padded size of the adapters before g rounded up to whole tiles.
  """
  group = jnp.where(ids < 0, num_adapters, ids)
  order = jnp.argsort(group, stable=True)
  sorted_pos = jnp.zeros_like(order).at[order].set(jnp.arange(ids.shape[0]))
  sizes = jnp.bincount(group, length=num_adapters + 1)[:num_adapters]
  padded_end = jnp.cumsum(-(-sizes // rows) * rows)
  padded_start = padded_end - -(-sizes // rows) * rows
  sorted_start = jnp.cumsum(sizes) - sizes
  safe = jnp.minimum(group, num_adapters - 1)
  dest = padded_start[safe] + sorted_pos - sorted_start[safe]
  dest = jnp.where(ids < 0, num_tiles * rows, dest)
  tile_adapter = jnp.searchsorted(padded_end, jnp.arange(num_tiles) * rows, side="right")
  return dest, jnp.minimum(tile_adapter, num_adapters - 1)


def _dropout(x, key, rate):
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)

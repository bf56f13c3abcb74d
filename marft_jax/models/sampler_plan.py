"""Planning one `sampler.generate` call on the host, before anything is compiled: the
arguments checked (`checked`: a ValueError names the first bad one), the fast path chosen
(`route`: one adapter merged into the weights, a shared prefix encoded once), and the static
shapes bucketed (`static_shapes`: prompt width P, new tokens N, stop ids M, cache slots S), so
that calls whose sizes vary within a bucket reuse one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import multihost
from marft_jax.lora.merge import merge_adapter
from marft_jax.lora.routing import NO_ADAPTER, Adapters, select_adapter
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig
from marft_jax.models.sampling import check_sampling_args
from marft_jax.models.transformer import KVCache, Params
from marft_jax.validation import check_ids, check_range

# Bucket sizes start at these minima. N and the stop ids round up to powers of two; prompt
# chunks and cache slots to quarter octaves (…, 64, 80, 96, 112, 128, 160, …): a prompt's
# padding costs a whole forward per token (up to half the prefill with powers of two) and
# every decode step reads every cache slot, for a few more compiles per run.
MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 16
MIN_STOP_IDS_BUCKET = 4
SLOT_BUCKETS_PER_OCTAVE = 4
# A fresh prompt whose rows open with at least this many identical tokens encodes them once.
MIN_SHARED_PREFIX = 16


def bucket(n: int, minimum: int, per_octave: int = 1) -> int:
  """The smallest size ≥ max(n, minimum) of the form 2^k·(1 + j / per_octave), j < per_octave
  (`minimum` and `per_octave` powers of two; per_octave 1: the next power of two)."""
  n = int(n)
  if n <= minimum:
    return minimum
  step = max((1 << ((n - 1).bit_length() - 1)) // per_octave, 1)  # of the octave (p, 2p]
  return -(-n // step) * step


def prompt_bucket(n: int) -> int:
  """A prompt chunk's width P: the quarter octave ≥ n (`bucket`), in steps of at least
  `MIN_PROMPT_BUCKET` (16, 32, 48, …, 128, 160, 192, …): a few tokens of padding cost little,
  and prompts whose lengths wander by a few tokens then keep one or two widths."""
  width = bucket(n, MIN_PROMPT_BUCKET, SLOT_BUCKETS_PER_OCTAVE)
  return -(-width // MIN_PROMPT_BUCKET) * MIN_PROMPT_BUCKET


# --- the pieces: per-row arguments, caches, fast paths --------------------------------------


def _per_row(name: str, value, batch: int, dtype) -> np.ndarray:
  """A scalar or [B] argument as a [B] array; other shapes name the argument."""
  array = np.asarray(value)
  if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
    raise ValueError(f"{name} has shape {array.shape}; expected a scalar or ({batch},)")
  return np.broadcast_to(array.astype(dtype), (batch,)).copy()


def _stop_id_table(eos_ids, stop_ids, batch: int, vocab: int) -> np.ndarray:
  """[B, M] int32: EOS ids then each row's own stop ids, -1 padded, M bucketed."""
  eos = np.atleast_1d(np.asarray(() if eos_ids is None else eos_ids, np.int64))
  check_ids("eos_ids", eos, vocab)
  rows = np.broadcast_to(eos, (batch, eos.size))
  if stop_ids is not None:
    stop = np.asarray(stop_ids, np.int64)
    if stop.ndim != 2 or stop.shape[0] != batch:
      raise ValueError(f"stop_ids has shape {stop.shape}; expected ({batch}, M)")
    check_ids("stop_ids", stop, vocab, where=stop != -1)  # -1 pads a row's list
    rows = np.concatenate([rows, stop], axis=1)
  width = bucket(rows.shape[1], MIN_STOP_IDS_BUCKET)
  return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=-1).astype(np.int32)


def _prompt_mask(tokens: np.ndarray, prompt_lens, prompt_mask) -> np.ndarray:
  B, P = tokens.shape
  if prompt_mask is not None:
    mask = np.asarray(prompt_mask)
    if mask.shape != (B, P):
      raise ValueError(f"prompt_mask has shape {mask.shape}; tokens have {(B, P)}")
    return mask.astype(bool)
  if prompt_lens is not None:
    lens = _per_row("prompt_lens", prompt_lens, B, np.int64)
    check_range("prompt_lens", lens, 0, P)
    return np.arange(P)[None, :] < lens[:, None]
  return np.ones((B, P), bool)


def fit_cache(cache: Optional[KVCache], config: ModelConfig, batch: int, size: int,
               rows=None) -> KVCache:
  """A cache of the planned `size` slots: a fresh one, the given one, or it grown (a copy).
  With `rows`, a fresh cache is made on the devices with its rows split like the batch."""
  if cache is None:
    init = functools.partial(transformer.init_cache, config, batch, size)
    if rows is None:
      return init()
    shapes = jax.eval_shape(init)  # k/v [.., B, K, *, *] (batch 4th from last), valid [B, S]
    shardings = jax.tree.map(lambda x: rows.sharding(x.ndim, max(x.ndim - 4, 0)), shapes)
    return jax.jit(init, out_shardings=shardings)()
  return cache if size == cache.size else transformer.grow_cache(cache, size)


def _one_adapter(lora: Optional[Adapters], ids: np.ndarray, rows=None
                 ) -> tuple[Optional[Adapters], np.ndarray]:
  """When every row uses the same adapter (or none), that adapter alone and ids in {0, -1}:
  the model then takes the single-adapter route (plain matmuls instead of gathering each
  row's factors): SmolLM2's LoRA overhead at batch 16 fell from 16 % to 7 % of a decode step
  and from 25-30 % to 11-21 % of a prompt. The processes of a multi-process job agree on the
  choice (the compiled programs, and so the samples, must not differ)."""
  if lora is None or lora.num_adapters == 1:
    return lora, ids
  used = ids[ids >= 0]
  low, high = int(used.min(initial=lora.num_adapters)), int(used.max(initial=NO_ADAPTER))
  if rows is not None:
    high, negative_low = (int(v) for v in multihost.max_over_processes(
        np.asarray([high, -low], np.int64)))
    low = -negative_low
  if high > low:
    return lora, ids
  return select_adapter(lora, max(high, 0)), np.where(ids >= 0, 0, NO_ADAPTER)


def _busy_rows(mask: np.ndarray, max_new: np.ndarray) -> np.ndarray:
  """[B] bool: rows whose tokens matter (a real prompt token, or tokens to sample). The
  others sit the call out: whatever they compute is masked and never attended."""
  return mask.any(axis=1) | (max_new > 0)


def _can_merge(params: Params, config: ModelConfig, lora: Optional[Adapters], ids: np.ndarray,
               busy: np.ndarray, rows=None) -> bool:
  """Whether the call's one adapter can be folded into the weights (`merge_adapter`): every
  busy row goes through it, and weights and compute are float32 (a bfloat16 kernel would
  round most of the small delta away, and the learner, which routes, would score other
  log-probs). The processes of a job agree (one compiled program)."""
  if lora is None or lora.num_adapters != 1:
    return False
  kernels = params["layers"] if config.layout.scan_layers else params["layers"][0]
  float32 = (config.dtype == jnp.float32 and all(
      kernels[name]["kernel"].dtype == jnp.float32 for name in lora.layers))
  ok = float32 and bool(np.all(ids[busy] == 0))
  if rows is not None:
    ok = not multihost.max_over_processes(np.asarray([not ok], np.int64))[0]
  return ok


@functools.partial(jax.jit, static_argnames=("layout",))
def _merged(params: Params, lora: Adapters, layout) -> Params:
  return merge_adapter(params, lora, 0, layout)


def _common_prefix(tokens: np.ndarray, mask: np.ndarray) -> int:
  """The leading columns real and identical in every row of `tokens` [R, P], leaving each row
  at least one real token after (a row samples from its last one)."""
  same = np.all(mask, axis=0) & np.all(tokens == tokens[:1], axis=0)
  first_differing = int(np.argmin(np.append(same, False)))
  return min(first_differing, int(mask.sum(axis=1).min()) - 1)


def _shared_prefix_length(tokens: np.ndarray, mask: np.ndarray, busy: np.ndarray) -> int:
  """How many leading columns every busy row holds, real and identical, leaving each of them
  at least one real token after (the row samples from its last one), rounded down to a
  multiple of `MIN_PROMPT_BUCKET` (one agent's prefix then keeps one width whatever its
  tasks share): 0 for fewer than 2 busy rows or fewer than `MIN_SHARED_PREFIX` columns."""
  if busy.sum() < 2:
    return 0
  length = _common_prefix(tokens[busy], mask[busy])
  length -= length % MIN_PROMPT_BUCKET  # a whole bucket: its width does not vary with the data
  return length if length >= MIN_SHARED_PREFIX else 0


def shared_prefix_cache(params, shared: np.ndarray, lora, adapter_id: int, busy: np.ndarray,
                         config: ModelConfig, width: int, size: int,
                         compile_only: bool = False) -> KVCache:
  """A `size`-slot cache holding the `shared` prefix tokens (padded to `width`) for every
  busy row (`_encode_shared_prefix`); `compile_only`: compiled, and its shapes returned."""
  head = np.zeros((1, width), np.int32)
  head[0, :len(shared)] = shared
  args = (params, jax.device_put(head), jax.device_put(np.arange(width)[None] < len(shared)),
          lora, jax.device_put(np.asarray([adapter_id], np.int32)), jax.device_put(busy))
  if not compile_only:
    return _encode_shared_prefix(*args, config=config, size=size)
  compiled = _encode_shared_prefix.lower(*args, config=config, size=size).compile()
  return _compiled_outputs(compiled, args)


def _compiled_outputs(compiled, args):
  """The shapes (and shardings) of a compiled prefix encoder's output cache."""
  # Its outputs are committed to their devices iff an input is: the compile key differs.
  committed = any(getattr(x, "committed", False) for x in jax.tree.leaves(args))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=s if committed else None),
                      compiled.out_info, compiled.output_shardings)


@functools.partial(jax.jit, static_argnames=("config", "size"))
def _encode_shared_prefix(params, tokens, mask, lora, adapter_ids, busy, *, config, size):
  """Encodes one row's prefix tokens [1, P] into a fresh `size`-slot cache and copies it to
  every row; rows not `busy` [B] get it as invalid slots (they hold no context)."""
  cache = transformer.init_cache(config, 1, size)
  _, cache = transformer.hidden_states(params, tokens, config, mask=mask, cache=cache,
                                       lora=lora, adapter_ids=adapter_ids, cache_is_empty=True)
  B = busy.shape[0]
  copy = lambda x: jnp.repeat(x, B, axis=x.ndim - 4)  # the batch is 4th from last
  return cache.replace(k=jax.tree.map(copy, cache.k), v=jax.tree.map(copy, cache.v),
                       valid=jnp.repeat(cache.valid, B, axis=0) & busy[:, None])


@dataclasses.dataclass(frozen=True, eq=False)
class GroupPrefixes:
  """Prompt prefixes shared within groups of rows (`generate`'s `prefix_groups`): each group's
  is encoded once, from its `heads` row, and copied to its rows."""

  starts: np.ndarray  # [B] the tokens each row takes from its group's prefix (0: none)
  heads: np.ndarray  # [G] the row whose prefix each sharing group encodes
  row_group: np.ndarray  # [B] each row's index into `heads`, or -1 (it shares nothing)


def group_prefixes(tokens: np.ndarray, mask: np.ndarray, busy: np.ndarray,
                   groups: np.ndarray, adapter_ids: np.ndarray) -> Optional[GroupPrefixes]:
  """The prefixes that busy rows of one group (same id >= 0, same adapter) share: the leading
  columns real and identical in all of them, leaving each at least one real token after (the
  row samples from its last one); a group of one row, or sharing fewer than
  `MIN_SHARED_PREFIX` tokens, shares nothing. None when no group shares."""
  starts = np.zeros(len(tokens), np.int64)
  row_group = np.full(len(tokens), -1, np.int64)
  heads = []
  for g in np.unique(groups[busy & (groups >= 0)]):
    rows = np.nonzero(busy & (groups == g))[0]
    if len(rows) < 2 or np.unique(adapter_ids[rows]).size > 1:
      continue
    length = _common_prefix(tokens[rows], mask[rows])
    if length < MIN_SHARED_PREFIX:
      continue
    starts[rows], row_group[rows] = length, len(heads)
    heads.append(rows[0])
  if not heads:
    return None
  return GroupPrefixes(starts, np.asarray(heads, np.int64), row_group)


def group_prefix_cache(params, call: "Call", groups: GroupPrefixes, lora,
                       adapter_ids: np.ndarray, config: ModelConfig, width: int, size: int,
                       compile_only: bool = False) -> KVCache:
  """A `size`-slot cache holding, for each row of a sharing group, its group's prefix (the
  head row's first `starts` tokens, padded to `width`); other rows hold no context.
  `compile_only`: compiled, and its shapes returned (as `shared_prefix_cache`)."""
  heads = groups.heads
  head_tokens = np.zeros((len(heads), width), np.int32)
  head_mask = np.arange(width)[None] < groups.starts[heads][:, None]
  head_tokens[head_mask] = call.tokens[heads, :width][head_mask[:, :call.tokens.shape[1]]]
  args = (params, jax.device_put(head_tokens), jax.device_put(head_mask), lora,
          jax.device_put(adapter_ids[heads].astype(np.int32)),
          jax.device_put(groups.row_group.astype(np.int32)))
  if not compile_only:
    return _encode_group_prefixes(*args, config=config, size=size)
  compiled = _encode_group_prefixes.lower(*args, config=config, size=size).compile()
  return _compiled_outputs(compiled, args)


@functools.partial(jax.jit, static_argnames=("config", "size"))
def _encode_group_prefixes(params, tokens, mask, lora, adapter_ids, row_group, *, config, size):
  """Encodes the groups' prefixes [G, P] into a fresh `size`-slot cache and gives each row
  its group's (`row_group` [B] into G; -1: invalid slots, no context)."""
  cache = transformer.init_cache(config, tokens.shape[0], size)
  _, cache = transformer.hidden_states(params, tokens, config, mask=mask, cache=cache,
                                       lora=lora, adapter_ids=adapter_ids, cache_is_empty=True)
  take = jnp.maximum(row_group, 0)
  pick = lambda x: jnp.take(x, take, axis=x.ndim - 4)  # the batch is 4th from last
  return cache.replace(k=jax.tree.map(pick, cache.k), v=jax.tree.map(pick, cache.v),
                       valid=cache.valid[take] & (row_group >= 0)[:, None])


def _check_positions(config: ModelConfig, cache: Optional[KVCache], mask: np.ndarray,
                     max_new: np.ndarray, rows=None) -> None:
  """Refuses rows whose positions would pass the model's `max_position_embeddings`."""
  read = np.asarray if rows is None else rows.get  # this process's rows of the cache
  before = 0 if cache is None else read(cache.next_positions())
  if cache is not None and np.shape(before) != (len(mask),):
    raise ValueError(f"cache: holds {np.shape(before)[0]} rows but tokens have {len(mask)}: "
                     "continue an earlier call with the same rows")
  end = before + mask.sum(axis=1) + max_new
  if np.any(end > config.max_position_embeddings):
    row = int(np.argmax(end))
    raise ValueError(
        f"row {row}: prompt ({int(np.broadcast_to(before, end.shape)[row])} cached + "
        f"{int(mask[row].sum())} new tokens) + max_new_tokens ({int(max_new[row])}) = "
        f"{int(end[row])} positions, more than the model's max_position_embeddings="
        f"{config.max_position_embeddings}")


# --- the plan: checked arguments, the fast path, static shapes -------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """`generate`'s per-row arguments, checked, as host arrays of this process's B rows."""

  tokens: np.ndarray  # [B, P] int32 prompt chunk
  mask: np.ndarray  # [B, P] bool: real prompt tokens
  max_new: np.ndarray  # [B] int64 ≥ 0
  adapter_ids: np.ndarray  # [B] int64 in [-1, A)
  prompt_adapter_ids: Optional[np.ndarray]  # [B, P] per-token ids, or None
  temperature: np.ndarray  # [B] f32 ≥ 0
  top_p: Optional[np.ndarray]  # [B] f32 in (0, 1], or None (off)
  top_k: Optional[int]  # None: off
  stop_ids: np.ndarray  # [B, M] int32: EOS then the row's own stop ids, -1 padded
  busy: np.ndarray  # [B] bool (`_busy_rows`)


def checked(tokens, config: ModelConfig, max_new_tokens, prompt_lens, prompt_mask, lora,
             adapter_ids, prompt_adapter_ids, temperature, top_p, top_k, eos_ids, stop_ids,
             cache, rows) -> Call:
  """`generate`'s arguments as a `Call`; a ValueError names the first bad one."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens: expected a [B, P] integer array, got shape {tokens.shape} "
                     f"and dtype {tokens.dtype}")
  B, P = tokens.shape
  mask = _prompt_mask(tokens, prompt_lens, prompt_mask)
  check_ids("tokens", tokens, config.vocab_size, where=mask)
  if not np.issubdtype(np.asarray(max_new_tokens).dtype, np.integer):
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int or ints")
  check_range("max_new_tokens", max_new_tokens, 0, np.iinfo(np.int32).max)
  max_new = _per_row("max_new_tokens", max_new_tokens, B, np.int64)
  if np.any((max_new > 0) & ~mask.any(axis=1)):
    raise ValueError("a row with max_new_tokens > 0 has no real prompt token in the chunk")
  check_sampling_args(temperature, top_p, top_k)
  if top_k is not None and (top_k == 0 or top_k >= config.vocab_size):
    top_k = None  # off: one compile for every value that keeps the whole vocabulary
  ids = _per_row("adapter_ids", NO_ADAPTER if adapter_ids is None and lora is None
                 else 0 if adapter_ids is None else adapter_ids, B, np.int64)
  num_adapters = 1 if lora is None else lora.num_adapters
  transformer.check_adapters_fit(lora, config)  # before a merge could broadcast them
  check_ids("adapter_ids", ids, num_adapters, low=NO_ADAPTER)
  if prompt_adapter_ids is not None:
    prompt_adapter_ids = np.asarray(prompt_adapter_ids)
    if prompt_adapter_ids.shape != (B, P):
      raise ValueError(f"prompt_adapter_ids has shape {prompt_adapter_ids.shape}; tokens "
                       f"have {(B, P)}")
    check_ids("prompt_adapter_ids", prompt_adapter_ids, num_adapters, where=mask,
              low=NO_ADAPTER)
  _check_positions(config, cache, mask, max_new, rows)
  return Call(tokens.astype(np.int32), mask, max_new, ids, prompt_adapter_ids,
               _per_row("temperature", temperature, B, np.float32),
               None if top_p is None else _per_row("top_p", top_p, B, np.float32), top_k,
               _stop_id_table(eos_ids, stop_ids, B, config.vocab_size),
               _busy_rows(mask, max_new))


@dataclasses.dataclass(frozen=True, eq=False)
class Route:
  """The fast paths one call takes (the module docstring's shortcuts)."""

  params: Params  # the base weights, or a copy with the call's one adapter merged in
  lora: Optional[Adapters]  # None: no adapter, or it is merged into `params`
  adapter_ids: np.ndarray  # [B] ids into `lora`
  prefix_length: int  # leading tokens encoded once for every busy row (0: none), or the
  #                     longest group prefix (`groups`)
  prefix_adapter: int  # their adapter (one prefix for every row)
  groups: Optional[GroupPrefixes] = None  # prefixes shared within groups of rows instead

  @property
  def starts(self):
    """Where each row's chunk begins in its prompt: int (every row) or [B]."""
    return self.prefix_length if self.groups is None else self.groups.starts


def route(params, config: ModelConfig, call: Call, lora, cache, rows, merge_lora: bool,
           share_prefix: bool, prefix_groups: Optional[np.ndarray] = None) -> Route:
  """One adapter alone when the rows share it (`_one_adapter`), merged into the weights when
  it can be (`_can_merge`), and the prefixes of a fresh prompt encoded once: those its
  `prefix_groups` share (`group_prefixes`), else the one every row shares
  (`_shared_prefix_length`)."""
  ids = call.adapter_ids
  if call.prompt_adapter_ids is None:
    lora, ids = _one_adapter(lora, ids, rows)
  if merge_lora and _can_merge(params, config, lora, ids, call.busy, rows):
    params, lora = _merged(params, lora, config.layout), None
  fresh = cache is None and rows is None and call.prompt_adapter_ids is None
  if fresh and prefix_groups is not None:
    groups = group_prefixes(call.tokens, call.mask, call.busy, prefix_groups,
                            np.zeros_like(ids) if lora is None else ids)
    if groups is not None:
      return Route(params, lora, ids, int(groups.starts.max()), 0, groups)
  prefix = 0
  if share_prefix and fresh and (lora is None or np.unique(ids[call.busy]).size == 1):
    prefix = _shared_prefix_length(call.tokens, call.mask, call.busy)
  return Route(params, lora, ids, prefix, int(ids[call.busy][0]) if prefix else 0)


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The static shapes of one call (with its flags, the compile key of `generate_jit`)."""

  batch: int  # B: every process's rows
  prompt: int  # P: the chunk's width after any shared prefix
  new: int  # N: output columns
  slots: int  # S: the cache's slots during the call
  prefix: int  # the shared prefix's width (0: none)
  greedy: bool  # every row at temperature 0


# A call may reuse an already compiled (P, S) up to this factor wider than its own buckets.
REUSE_FACTOR = 2


class _CompiledShapes:
  """The (P, S) pairs each call signature has run with, so that a call can reuse the
  narrowest that fits (within `REUSE_FACTOR` of its own buckets) instead of compiling a
  narrower program: calls with group prefixes do (`choose`'s `prefer_seen`); the others
  take their own shapes, and `claim` keeps compile-ahead from compiling one twice."""

  def __init__(self):
    self._seen: dict = {}

  def choose(self, key, prompt: int, room: int, slots: int, *, start: int, kept: bool,
             prefer_seen: bool = False) -> tuple[int, int, bool]:
    """(P, S, whether new) for a call that wants `prompt` columns and `slots` slots, and
    writes from slot `start` the P columns and `room` new tokens; `kept`: S is an existing
    cache's size. `prefer_seen`: a compiled (P, S) that fits, when there is one, before the
    call's own. Without it the call's own (P, S), the narrowest that fits, always wins, so a
    narrower call compiles anew (noticed 28 Nov 2026; changing it changes the padding, and
    so the rounding, of the trainer's rollouts: left for a change recorded in
    `config_history.CHANGED`)."""
    fits = lambda p, s: (s == slots if kept else slots <= s <= REUSE_FACTOR * slots) and (
        prompt <= p <= REUSE_FACTOR * prompt and start + p + room <= s)
    seen = self._seen.setdefault(key, set())
    compiled = [(s, p) for p, s in seen if fits(p, s)]
    choice = min(compiled if prefer_seen and compiled else compiled + [(slots, prompt)])[::-1]
    new = choice not in seen
    seen.add(choice)
    return choice + (new,)

  def claim(self, key, prompt: int, slots: int) -> bool:
    """Records a fresh-cache (P, S) about to be compiled ahead; False if one that `choose`
    would reuse for it is compiled already."""
    seen = self._seen.setdefault(key, set())
    if any(prompt <= p <= REUSE_FACTOR * prompt and slots <= s <= REUSE_FACTOR * slots
           for p, s in seen):
      return False
    seen.add((prompt, slots))
    return True


_COMPILED = _CompiledShapes()


def forget_compiled_shapes() -> None:
  """Forgets which shapes have compiled: call it after `jax.clear_caches()`, which drops the
  programs, or the sampler keeps choosing widths it believes compiled (and compiles them
  mid-run instead of ahead)."""
  global _COMPILED
  _COMPILED = _CompiledShapes()


def static_shapes(call: Call, route: Route, config: ModelConfig, cache: Optional[KVCache], *,
                 cache_size: Optional[int], prompt_width: Optional[int],
                 new_tokens: Optional[int], rows, compile_ahead: bool = False
                 ) -> tuple[Shapes, list]:
  """The call's `Shapes`: P, N, S bucketed (see `generate_jit`), P from `prompt_width` when
  given, and an already compiled (P, S) reused when one fits (`_CompiledShapes`); and the
  `Shapes` to compile ahead (`compile_ahead`): when a fresh-cache call compiles a new P, the
  next bucket up too (its prompts then vary by a bucket in the run without compiling again)."""
  starts = np.broadcast_to(route.starts, call.mask.shape[:1])
  ends = np.where(call.mask.any(axis=1),
                  call.mask.shape[1] - np.argmax(call.mask[:, ::-1], axis=1), 0)
  used = int(np.max(np.maximum(ends - starts, 0), initial=0))  # the chunk's real columns
  used = max(used, (prompt_width or 0) - (int(starts.min()) if starts.size else 0))
  greedy = bool(np.all(call.temperature <= 0))
  longest = int(call.max_new.max(initial=0))
  batch = call.tokens.shape[0]
  if rows is not None:  # the compiled shapes and the static flags are the whole batch's
    used, not_greedy, longest = (int(v) for v in multihost.max_over_processes(
        np.asarray([used, not greedy, longest], np.int64)))
    greedy, batch = not not_greedy, batch * rows.processes
  num_new = new_tokens or bucket(longest, MIN_NEW_TOKENS_BUCKET)
  if num_new < longest:
    raise ValueError(f"max_new_tokens_bucket={num_new} < max(max_new_tokens)={longest}")
  # The cache needs room for the tokens asked for, not for the output's N columns.
  room = min(num_new, bucket(longest, MIN_NEW_TOKENS_BUCKET, SLOT_BUCKETS_PER_OCTAVE))
  prompt = prompt_bucket(used)
  prefix = route.prefix_length and bucket(route.prefix_length, MIN_PROMPT_BUCKET,
                                          SLOT_BUCKETS_PER_OCTAVE)
  if cache is None:  # fresh (after any shared prefix)
    start, kept = prefix, False
    slots = max(prefix + prompt + room, cache_size or 0)
  else:
    start, kept = int(cache.index), True
    slots = cache.size
    if start + prompt + room > slots:  # grows to the next quarter octave
      slots = bucket(start + prompt + room, MIN_PROMPT_BUCKET, SLOT_BUCKETS_PER_OCTAVE)
      kept = False
  # Group prefixes vary with each call's tasks; the loop does not depend on where its chunk
  # starts (the cache's index is an argument), so their calls share programs across prefix
  # widths, a narrower prefix running in a wider one's slots. The one prefix of every row keeps
  # its width in the key (its widths are few; the trainer's rollouts keep their shapes).
  key = (config, batch, num_new, call.top_k, greedy, cache is None,
         prefix if route.groups is None else "groups", route.lora is None,
         call.top_p is None, call.prompt_adapter_ids is None, call.stop_ids.shape[1])
  prompt, slots, new = _COMPILED.choose(key, prompt, room, slots, start=start, kept=kept,
                                        prefer_seen=route.groups is not None)
  shapes = Shapes(batch, prompt, num_new, slots, prefix, greedy)
  ahead = []
  if compile_ahead and new and cache is None and rows is None:  # the next bucket up, now
    wider = prompt_bucket(prompt + 1)
    wider_slots = max(prefix + wider + room, cache_size or 0)
    if _COMPILED.claim(key, wider, wider_slots):
      ahead.append(dataclasses.replace(shapes, prompt=wider, slots=wider_slots))
  return shapes, ahead


def fit_prompt(call: Call, starts, width: int, pad_id: int):
  """(tokens, mask, per-token adapter ids or None) of the chunk after the shared prefix
  (`starts`: the columns it takes, int or per row [B]), cut or padded to `width` columns
  (cut columns hold no real token)."""
  if np.ndim(starts):  # each row shifted left by its own prefix
    columns = np.asarray(starts)[:, None] + np.arange(call.tokens.shape[1])[None]
    inside = columns < call.tokens.shape[1]
    columns = np.minimum(columns, call.tokens.shape[1] - 1)
    take = lambda x: np.take_along_axis(x, columns, axis=1)
    call = dataclasses.replace(
        call, tokens=take(call.tokens), mask=take(call.mask) & inside,
        prompt_adapter_ids=None if call.prompt_adapter_ids is None
        else take(call.prompt_adapter_ids))
    starts = 0
  tokens, mask = call.tokens[:, starts:], call.mask[:, starts:]
  pad = ((0, 0), (0, max(width - tokens.shape[1], 0)))
  ids = call.prompt_adapter_ids
  if ids is not None:
    ids = np.pad(np.where(mask, ids, NO_ADAPTER)[:, :width], pad, constant_values=NO_ADAPTER)
    ids = ids.astype(np.int32)
  return (np.pad(tokens[:, :width], pad, constant_values=pad_id),
          np.pad(mask[:, :width], pad), ids)

"""Batched sampling in one jit-compiled `lax.while_loop` over a preallocated KV cache.

`generate` encodes a chunk of prompt tokens (a fresh prompt, or the next agent's transition
text appended to an earlier call's cache), then samples up to N new tokens per row. Each row
stops at its first stop token (EOS or one of its own stop ids) or after its own
`max_new_tokens`; the loop ends when every row has stopped.

Cache layout (see `transformer.KVCache`): all rows write at one shared slot index, padding
slots are invalid and never attended. One call uses slots `[index, index + P + N)`:
the P-slot (bucketed) prompt chunk, then one slot per decode step. The returned cache holds
every real prompt token and every valid generated token (stop tokens included), so a later
call continues it exactly as if the whole history had been one prompt.

Log-probabilities are those of the distribution the token was drawn from: the model's
logits divided by the temperature, restricted to the top-k and then to the top-p nucleus,
renormalised. At temperature 1 without top-k/top-p they equal a teacher-forced forward's
`log_softmax`, so PPO's first importance ratio is 1. Greedy rows (temperature 0) take the
argmax; their log-prob is the model's own (temperature-1, unfiltered) log-softmax.

Two shortcuts give the same samples (to f32 rounding) for less work, both on by default: a
call whose busy rows share one adapter runs with it merged into a copy of float32 weights
(`merge_lora`), and a fresh prompt whose rows open with the same tokens (one agent's system
prompt in the per-agent view) encodes them once (`share_prefix`). On SmolLM2 they took the
per-agent team rollout of `bench/rollout.py` from 148 to 189 tokens/s (one run each, same host).

The params, the cache and `config.layout` go together: generation is fastest in
`layout.decoding()` (on CPU: unrolled, feature-major layers), made once per set of weights.

Example (a second agent continuing the first agent's context)::

    fast = config.replace(layout=layout.decoding())
    fast_params = layout.convert_params(params, config.layout, fast.layout)  # once
    first = generate(fast_params, prompts, fast, rng=k1, max_new_tokens=64, prompt_lens=lens,
                     eos_ids=[eos], cache_size=1024, lora=lora, adapter_ids=[0] * B)
    second = generate(fast_params, transition, fast, rng=k2, max_new_tokens=64,
                      prompt_lens=transition_lens, eos_ids=[eos], cache=first.cache,
                      lora=lora, adapter_ids=[1] * B)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marft_jax import multihost
from marft_jax.lora.merge import merge_adapter
from marft_jax.lora.routing import NO_ADAPTER, Adapters, select_adapter
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig
from marft_jax.models.sampling import check_sampling_args
from marft_jax.models.transformer import KVCache, Params
from marft_jax.validation import check_ids

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
# Inverse-CDF sampling sums probabilities in blocks of this many tokens (two-level search).
_CDF_BLOCK = 256
# 2^30 > the int32 bit pattern of 1.0f: 30 halvings pin an f32 probability threshold exactly.
_TOP_P_ITERATIONS = 30


@struct.dataclass
class SampleOutput:
  """What one `generate` call produced. N is the bucketed number of new tokens."""

  tokens: jax.Array  # [B, N] int32 sampled tokens; `pad_id` where `mask` is False.
  logprobs: jax.Array  # [B, N] f32 log-prob under the sampling distribution; 0 off mask.
  mask: jax.Array  # [B, N] bool: True up to and including the stop token.
  lengths: jax.Array  # [B] int32 number of valid generated tokens.
  cache: KVCache  # every real prompt token and valid generated token; continue from it.


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


# --- sampling one token ---------------------------------------------------------------------


# Everything below works vocab-major, logits [V, B]: in the decoding layout the output
# projection is fastest as [V, D] @ [D, B], and consuming its result as [B, V] would make XLA
# compute it in the slow orientation instead.


def _top_p_keep(logits: jax.Array, top_p: jax.Array) -> jax.Array:
  """[V, B] bool: the nucleus, the most probable tokens whose mass first reaches `top_p`.

  Token i is kept iff the mass of tokens strictly more probable than i is < top_p (ties at the
  boundary are all kept). Instead of sorting V logits, a bisection over the int32 bit patterns
  of the probabilities (monotone for non-negative floats) finds the largest threshold t with
  mass(p ≥ t) ≥ top_p; it is exact after 30 halvings. Rows with top_p ≥ 1 keep everything.

  Args:
    logits: [V, B] f32, -inf on tokens already filtered out. top_p: [B] f32 in (0, 1].
  """
  # The 30 passes reduce along the minor axis: 6x faster than down columns of [V, B].
  p = jnp.exp(logits - jnp.max(logits, axis=0, keepdims=True)).T  # [B, V]; the max is 1.0
  bits = jax.lax.bitcast_convert_type(p, jnp.int32)
  target = top_p * jnp.sum(p, axis=-1)

  def halve(_, bounds):
    lo, hi = bounds  # mass(bits ≥ lo) ≥ target > mass(bits ≥ hi)
    mid = lo + (hi - lo) // 2
    ok = jnp.sum(jnp.where(bits >= mid[:, None], p, 0.0), axis=-1) >= target
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  B = logits.shape[1]
  one = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
  lo, _ = jax.lax.fori_loop(0, _TOP_P_ITERATIONS, halve,
                            (jnp.zeros((B,), jnp.int32), jnp.full((B,), one + 1, jnp.int32)))
  return (bits.T >= lo[None, :]) | (top_p >= 1.0)[None, :]


def _inverse_cdf_sample(rng: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One draw per row from softmax over axis 0 of logits [V, B], one uniform per row.

  Two-level inverse CDF: block sums locate the block holding u · Z, a cumulative sum inside
  that block locates the token. No full-vocabulary sort, cumsum or V random numbers per row.
  Tokens with logit -inf (probability 0) are never drawn.

  Returns:
    tokens [B] int32, and log Z = logsumexp(logits, axis=0) [B] (a by-product).
  """
  V, B = logits.shape
  pad = -V % _CDF_BLOCK
  if pad:
    logits = jnp.pad(logits, ((0, pad), (0, 0)), constant_values=-jnp.inf)
  top = jnp.max(logits, axis=0)
  p = jnp.exp(logits - top[None, :])
  blocks = p.reshape(-1, _CDF_BLOCK, B)
  block_mass = jnp.sum(blocks, axis=1)  # [V / block, B]
  block_cdf = jnp.cumsum(block_mass, axis=0)
  target = jax.random.uniform(rng, (B,)) * block_cdf[-1]

  def first_above(cdf, mass, t):  # first index whose cdf exceeds t, clamped to nonzero mass
    last_nonzero = cdf.shape[0] - 1 - jnp.argmax(mass[::-1] > 0, axis=0)
    return jnp.minimum(jnp.sum(cdf <= t[None, :], axis=0), last_nonzero)

  block = first_above(block_cdf, block_mass, target)
  below = jnp.take_along_axis(block_cdf - block_mass, block[None, :], axis=0)[0]
  inner = jnp.take_along_axis(blocks, block[None, None, :], axis=0)[0]  # [block, B]
  offset = first_above(jnp.cumsum(inner, axis=0), inner, target - below)
  return (block * _CDF_BLOCK + offset).astype(jnp.int32), top + jnp.log(block_cdf[-1])


def sample_vocab_major(rng: jax.Array, logits: jax.Array, temperature: jax.Array,
                       top_p: Optional[jax.Array] = None, *, top_k: Optional[int] = None,
                       greedy: bool = False) -> tuple[jax.Array, jax.Array]:
  """`sample_tokens` for logits [V, B]."""
  at = lambda x, i: jnp.take_along_axis(x, i[None, :], axis=0)[0]

  def argmax_and_logprob():  # the max is the argmax's logit: log p = -log Σ exp(l - max)
    top = jnp.max(logits, axis=0)
    tok = jnp.argmax(logits, axis=0).astype(jnp.int32)
    return tok, -jnp.log(jnp.sum(jnp.exp(logits - top[None, :]), axis=0))

  if greedy:
    return argmax_and_logprob()
  is_greedy = temperature <= 0.0
  # The max is subtracted before dividing: a tiny temperature then sends every other logit
  # towards -inf (probability 0) instead of overflowing, and log-probs stay finite.
  shifted = logits - jnp.max(logits, axis=0, keepdims=True)
  scaled = shifted / jnp.where(is_greedy, 1.0, temperature)[None, :]
  ids = None
  if top_k and top_k < logits.shape[0]:  # 0 / None: off; ≥ V: keeps everything anyway
    values, ids = jax.lax.top_k(scaled.T, top_k)  # sorted: the top-p search is a cumsum
    scaled, ids = values.T, ids.T  # [k, B]
  if top_p is not None:
    if ids is None:
      keep = _top_p_keep(scaled, top_p)
    else:
      p = jax.nn.softmax(scaled, axis=0)
      keep = (jnp.cumsum(p, axis=0) - p < top_p[None, :]) | (top_p >= 1.0)[None, :]
    scaled = jnp.where(keep, scaled, -jnp.inf)
  choice, log_z = _inverse_cdf_sample(rng, scaled)
  tok = choice if ids is None else at(ids, choice)
  logprob = at(scaled, choice) - log_z
  B = logits.shape[1]
  no_greedy_row = lambda: (jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.float32))
  greedy_tok, greedy_logprob = jax.lax.cond(jnp.any(is_greedy), argmax_and_logprob, no_greedy_row)
  return (jnp.where(is_greedy, greedy_tok, tok), jnp.where(is_greedy, greedy_logprob, logprob))


def sample_tokens(rng: jax.Array, logits: jax.Array, temperature: jax.Array,
                  top_p: Optional[jax.Array] = None, *, top_k: Optional[int] = None,
                  greedy: bool = False) -> tuple[jax.Array, jax.Array]:
  """Draws one token per row and returns its log-prob under the distribution used.

  The distribution is softmax(logits / temperature) restricted to the `top_k` most probable
  tokens (ties broken towards the lower id), then to the top-p nucleus of those, renormalised.
  Rows with temperature 0 take the argmax and report the model's unfiltered log-softmax.

  Args:
    rng: a PRNG key. logits: [B, V] f32.
    temperature: [B] f32 ≥ 0 (traced). top_p: [B] f32 in (0, 1] or None (traced).
    top_k: static; None keeps the whole vocabulary.
    greedy: static fast path: every row is greedy (temperature ignored).
  Returns:
    tokens [B] int32, logprobs [B] f32.
  """
  return sample_vocab_major(rng, logits.T, temperature, top_p, top_k=top_k, greedy=greedy)


# --- the jitted loop ------------------------------------------------------------------------


@struct.dataclass
class _LoopState:
  step: jax.Array  # [] int32: tokens sampled so far (the next output column).
  last: jax.Array  # [B] int32: the token sampled last, not yet in the cache.
  last_valid: jax.Array  # [B] bool: `last` is a real generated token (write it to the cache).
  active: jax.Array  # [B] bool: the row samples again at the next step.
  tokens: jax.Array  # [B, N + 1] int32 (the extra column takes the final, discarded draw)
  logprobs: jax.Array  # [B, N + 1] f32
  mask: jax.Array  # [B, N + 1] bool
  cache: KVCache


def _last_real_hidden(h: jax.Array, mask: jax.Array) -> jax.Array:
  """[B, T, D], [B, T] -> [B, D]: the hidden state at each row's last real token."""
  T = mask.shape[1]
  last = T - 1 - jnp.argmax(mask[:, ::-1], axis=-1)
  return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]


def _generate(params, tokens, mask, cache, lora, adapter_ids, rng, temperature, top_p,
              max_new_tokens, stop_ids, prompt_adapter_ids=None, *, config, num_new, top_k,
              greedy, pad_id, on_step=None, fresh_cache=False):
  """See `generate_jit`."""
  B = tokens.shape[0]
  sample = functools.partial(sample_vocab_major, top_k=top_k, greedy=greedy)
  model = functools.partial(transformer.hidden_states, params, config=config, lora=lora)

  def record(state: _LoopState, h: jax.Array) -> _LoopState:
    """Samples column `state.step` from hidden states h [B, D] for the active rows."""
    logits = transformer.logits_from_hidden(params, h, config, vocab_major=True)
    tok, logprob = sample(jax.random.fold_in(rng, state.step), logits, temperature, top_p)
    active = state.active
    tok = jnp.where(active, tok, pad_id)
    column = lambda buf, value: jax.lax.dynamic_update_slice(buf, value[:, None], (0, state.step))
    stop = jnp.any(tok[:, None] == stop_ids, axis=-1)
    step = state.step + 1
    return state.replace(
        step=step, last=tok, last_valid=active,
        active=active & ~stop & (step < max_new_tokens),
        tokens=column(state.tokens, tok),
        logprobs=column(state.logprobs, jnp.where(active, logprob, 0.0)),
        mask=column(state.mask, active))

  # --- prefill: encode the chunk; logits only at each row's last real token ---
  prefill_ids = adapter_ids if prompt_adapter_ids is None else prompt_adapter_ids
  h, cache = model(tokens, mask=mask, cache=cache, adapter_ids=prefill_ids,
                   cache_is_empty=fresh_cache)
  state = _LoopState(
      step=jnp.zeros((), jnp.int32), last=jnp.full((B,), pad_id, jnp.int32),
      last_valid=jnp.zeros((B,), bool), active=max_new_tokens > 0,
      tokens=jnp.full((B, num_new + 1), pad_id, jnp.int32),
      logprobs=jnp.zeros((B, num_new + 1), jnp.float32),
      mask=jnp.zeros((B, num_new + 1), bool), cache=cache)
  state = record(state, _last_real_hidden(h, mask))

  # --- decode: write the last token into the cache, sample the next ---
  # The loop runs until no token is pending, so its last step only writes the final tokens
  # (its draw goes to the spare column with an all-False mask): one copy of the model in
  # the compiled loop, and the returned cache holds every valid token.
  def body(state: _LoopState) -> _LoopState:
    h, cache = model(state.last[:, None], mask=state.last_valid[:, None], cache=state.cache,
                     adapter_ids=adapter_ids)
    if on_step is not None:  # host-side progress report, e.g. a tqdm bar
      jax.debug.callback(on_step, state.step)
    return record(state.replace(cache=cache), h[:, 0])

  state = jax.lax.while_loop(lambda state: jnp.any(state.last_valid), body, state)
  mask = state.mask[:, :num_new]
  return SampleOutput(tokens=state.tokens[:, :num_new], logprobs=state.logprobs[:, :num_new],
                      mask=mask, lengths=jnp.sum(mask, axis=-1, dtype=jnp.int32),
                      cache=state.cache)


_STATIC = ("config", "num_new", "top_k", "greedy", "pad_id", "on_step", "fresh_cache")
_generate_jit = jax.jit(_generate, static_argnames=_STATIC, donate_argnames=("cache",))


def generate_jit(params: Params, tokens: jax.Array, mask: jax.Array, cache: KVCache,
                 lora: Optional[Adapters], adapter_ids: jax.Array, rng: jax.Array,
                 temperature: jax.Array, top_p: Optional[jax.Array], max_new_tokens: jax.Array,
                 stop_ids: jax.Array, prompt_adapter_ids: Optional[jax.Array] = None, *,
                 config: ModelConfig, num_new: int, top_k: Optional[int], greedy: bool,
                 pad_id: int, on_step: Optional[Callable[[jax.Array], None]] = None,
                 fresh_cache: bool = False) -> SampleOutput:
  """The jitted generation loop; `generate` pads and buckets its arguments and calls this.

  Static arguments (a new value compiles again): `config`, `num_new` (N, the bucketed
  maximum of `max_new_tokens`), `top_k`, `greedy` (every row at temperature 0), `pad_id`,
  whether `top_p` and `lora` are None, `fresh_cache` (the cache holds no valid slot yet:
  the prompt skips attending to it). Every array's shape is also part of the compile key,
  so `generate` buckets them:

    P (prompt chunk width)  `prompt_bucket` of max(last real token + 1, the caller's
                            `prompt_width` bound), after a shared prefix (whose length is
                            floored to a multiple of 16): a multiple of 16 ≥ the quarter
                            octave
    N (new tokens)          next power of two ≥ max(16, max(max_new_tokens)), or
                            `max_new_tokens_bucket`
    M (stop ids per row)    next power of two ≥ max(4, number of stop ids)
    S (cache slots)         fresh: `cache_size` or prefix + P + n, n = min(N, next quarter
                            octave ≥ max(16, max(max_new_tokens))); continued: kept if
                            index + P + n fits, else the next quarter octave ≥ that

  (quarter octaves: 16, 20, 24, 28, 32, 40, …, 64, 80, 96, 112, 128, 160, …; see `bucket`).
  A (P, S) the same static arguments compiled before is reused instead when it is at most
  `REUSE_FACTOR` wider, and a fresh-cache call that compiles a new P compiles the next P up
  ahead (`_plan_shapes`): prompts that vary by a bucket compile nothing after the first call.

  Traced (changing them does not compile): tokens [B, P], mask [B, P], cache (S slots,
  donated: its buffers become the returned cache's), lora, adapter_ids [B], rng,
  temperature [B], top_p [B], max_new_tokens [B], stop_ids [B, M] (-1 = unused).
  """
  return _generate_jit(params, tokens, mask, cache, lora, adapter_ids, rng, temperature,
                       top_p, max_new_tokens, stop_ids, prompt_adapter_ids, config=config,
                       num_new=num_new, top_k=top_k, greedy=greedy, pad_id=pad_id,
                       on_step=on_step, fresh_cache=fresh_cache)


# --- the host-side entry point --------------------------------------------------------------


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
    check_ids("prompt_lens", lens, P + 1)
    return np.arange(P)[None, :] < lens[:, None]
  return np.ones((B, P), bool)


def _fit_cache(cache: Optional[KVCache], config: ModelConfig, batch: int, size: int,
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


def _shared_prefix_length(tokens: np.ndarray, mask: np.ndarray, busy: np.ndarray) -> int:
  """How many leading columns every busy row holds, real and identical, leaving each of them
  at least one real token after (the row samples from its last one), rounded down to a
  multiple of `MIN_PROMPT_BUCKET` (one agent's prefix then keeps one width whatever its
  tasks share): 0 for fewer than 2 busy rows or fewer than `MIN_SHARED_PREFIX` columns."""
  if busy.sum() < 2:
    return 0
  t, m = tokens[busy], mask[busy]
  same = np.all(m, axis=0) & np.all(t == t[:1], axis=0)
  length = int(np.argmin(np.append(same, False)))  # the first column that differs
  length = min(length, int(m.sum(axis=1).min()) - 1)
  length -= length % MIN_PROMPT_BUCKET  # a whole bucket: its width does not vary with the data
  return length if length >= MIN_SHARED_PREFIX else 0


def _shared_prefix_cache(params, shared: np.ndarray, lora, adapter_id: int, busy: np.ndarray,
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


def _check_positions(config: ModelConfig, cache: Optional[KVCache], mask: np.ndarray,
                     max_new: np.ndarray, rows=None) -> None:
  """Refuses rows whose positions would pass the model's `max_position_embeddings`."""
  read = np.asarray if rows is None else rows.get  # this process's rows of the cache
  before = 0 if cache is None else read(cache.next_positions())
  end = before + mask.sum(axis=1) + max_new
  if np.any(end > config.max_position_embeddings):
    row = int(np.argmax(end))
    raise ValueError(
        f"row {row}: prompt ({int(np.broadcast_to(before, end.shape)[row])} cached + "
        f"{int(mask[row].sum())} new tokens) + max_new_tokens ({int(max_new[row])}) = "
        f"{int(end[row])} positions, more than the model's max_position_embeddings="
        f"{config.max_position_embeddings}")


# --- planning: checked arguments, fast paths, static shapes ---------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
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


def _checked(tokens, config: ModelConfig, max_new_tokens, prompt_lens, prompt_mask, lora,
             adapter_ids, prompt_adapter_ids, temperature, top_p, top_k, eos_ids, stop_ids,
             cache, rows) -> _Call:
  """`generate`'s arguments as a `_Call`; a ValueError names the first bad one."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens: expected a [B, P] integer array, got shape {tokens.shape} "
                     f"and dtype {tokens.dtype}")
  B, P = tokens.shape
  mask = _prompt_mask(tokens, prompt_lens, prompt_mask)
  check_ids("tokens", tokens, config.vocab_size, where=mask)
  if not np.issubdtype(np.asarray(max_new_tokens).dtype, np.integer):
    raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int or ints")
  max_new = _per_row("max_new_tokens", max_new_tokens, B, np.int64)
  check_ids("max_new_tokens", max_new, np.iinfo(np.int32).max)
  if np.any((max_new > 0) & ~mask.any(axis=1)):
    raise ValueError("a row with max_new_tokens > 0 has no real prompt token in the chunk")
  check_sampling_args(temperature, top_p, top_k)
  if top_k is not None and (top_k == 0 or top_k >= config.vocab_size):
    top_k = None  # off: one compile for every value that keeps the whole vocabulary
  ids = _per_row("adapter_ids", NO_ADAPTER if adapter_ids is None and lora is None
                 else 0 if adapter_ids is None else adapter_ids, B, np.int64)
  num_adapters = 1 if lora is None else lora.num_adapters
  check_ids("adapter_ids", ids, num_adapters, low=NO_ADAPTER)
  if prompt_adapter_ids is not None:
    prompt_adapter_ids = np.asarray(prompt_adapter_ids)
    if prompt_adapter_ids.shape != (B, P):
      raise ValueError(f"prompt_adapter_ids has shape {prompt_adapter_ids.shape}; tokens "
                       f"have {(B, P)}")
    check_ids("prompt_adapter_ids", prompt_adapter_ids, num_adapters, where=mask,
              low=NO_ADAPTER)
  _check_positions(config, cache, mask, max_new, rows)
  return _Call(tokens.astype(np.int32), mask, max_new, ids, prompt_adapter_ids,
               _per_row("temperature", temperature, B, np.float32),
               None if top_p is None else _per_row("top_p", top_p, B, np.float32), top_k,
               _stop_id_table(eos_ids, stop_ids, B, config.vocab_size),
               _busy_rows(mask, max_new))


@dataclasses.dataclass(frozen=True, eq=False)
class _Route:
  """The fast paths one call takes (the module docstring's shortcuts)."""

  params: Params  # the base weights, or a copy with the call's one adapter merged in
  lora: Optional[Adapters]  # None: no adapter, or it is merged into `params`
  adapter_ids: np.ndarray  # [B] ids into `lora`
  prefix_length: int  # leading tokens encoded once for every busy row (0: none)
  prefix_adapter: int  # their adapter


def _route(params, config: ModelConfig, call: _Call, lora, cache, rows, merge_lora: bool,
           share_prefix: bool) -> _Route:
  """One adapter alone when the rows share it (`_one_adapter`), merged into the weights when
  it can be (`_can_merge`), and the shared prefix of a fresh prompt (`_shared_prefix_length`)."""
  ids = call.adapter_ids
  if call.prompt_adapter_ids is None:
    lora, ids = _one_adapter(lora, ids, rows)
  if merge_lora and _can_merge(params, config, lora, ids, call.busy, rows):
    params, lora = _merged(params, lora, config.layout), None
  prefix = 0
  if share_prefix and cache is None and rows is None and call.prompt_adapter_ids is None and (
      lora is None or np.unique(ids[call.busy]).size == 1):
    prefix = _shared_prefix_length(call.tokens, call.mask, call.busy)
  return _Route(params, lora, ids, prefix, int(ids[call.busy][0]) if prefix else 0)


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
  """The (P, S) pairs each call signature has run with, so that a call reuses the narrowest
  that fits (within `REUSE_FACTOR` of its own buckets) instead of compiling a narrower
  program: once a run has seen its longest prompts, shorter ones compile nothing."""

  def __init__(self):
    self._seen: dict = {}

  def choose(self, key, prompt: int, room: int, slots: int, *, start: int, kept: bool
             ) -> tuple[int, int, bool]:
    """(P, S, whether new) for a call that wants `prompt` columns and `slots` slots, and
    writes from slot `start` the P columns and `room` new tokens; `kept`: S is an existing
    cache's size."""
    fits = lambda p, s: (s == slots if kept else slots <= s <= REUSE_FACTOR * slots) and (
        prompt <= p <= REUSE_FACTOR * prompt and start + p + room <= s)
    seen = self._seen.setdefault(key, set())
    choice = min((s, p) for p, s in seen | {(prompt, slots)} if fits(p, s))[::-1]
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


def _plan_shapes(call: _Call, route: _Route, config: ModelConfig, cache: Optional[KVCache], *,
                 cache_size: Optional[int], prompt_width: Optional[int],
                 new_tokens: Optional[int], rows, compile_ahead: bool = False
                 ) -> tuple[Shapes, list]:
  """The call's `Shapes`: P, N, S bucketed (see `generate_jit`), P from `prompt_width` when
  given, and an already compiled (P, S) reused when one fits (`_CompiledShapes`); and the
  `Shapes` to compile ahead (`compile_ahead`): when a fresh-cache call compiles a new P, the
  next bucket up too (its prompts then vary by a bucket in the run without compiling again)."""
  real = call.mask[:, route.prefix_length:].any(axis=0)
  used = int(np.max(np.nonzero(real)[0], initial=-1)) + 1
  used = max(used, (prompt_width or 0) - route.prefix_length)
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
  key = (config, batch, num_new, call.top_k, greedy, cache is None, prefix, route.lora is None,
         call.top_p is None, call.prompt_adapter_ids is None, call.stop_ids.shape[1])
  prompt, slots, new = _COMPILED.choose(key, prompt, room, slots, start=start, kept=kept)
  shapes = Shapes(batch, prompt, num_new, slots, prefix, greedy)
  ahead = []
  if compile_ahead and new and cache is None and rows is None:  # the next bucket up, now
    wider = prompt_bucket(prompt + 1)
    wider_slots = max(prefix + wider + room, cache_size or 0)
    if _COMPILED.claim(key, wider, wider_slots):
      ahead.append(dataclasses.replace(shapes, prompt=wider, slots=wider_slots))
  return shapes, ahead


def _fit_prompt(call: _Call, prefix_length: int, width: int, pad_id: int):
  """(tokens, mask, per-token adapter ids or None) of the chunk after the shared prefix,
  cut or padded to `width` columns (cut columns hold no real token)."""
  tokens, mask = call.tokens[:, prefix_length:], call.mask[:, prefix_length:]
  pad = ((0, 0), (0, max(width - tokens.shape[1], 0)))
  ids = call.prompt_adapter_ids
  if ids is not None:
    ids = np.pad(np.where(mask, ids, NO_ADAPTER)[:, :width], pad, constant_values=NO_ADAPTER)
    ids = ids.astype(np.int32)
  return (np.pad(tokens[:, :width], pad, constant_values=pad_id),
          np.pad(mask[:, :width], pad), ids)


def generate(params: Params, tokens, config: ModelConfig, *, rng: jax.Array,
             max_new_tokens: Union[int, Sequence[int], np.ndarray],
             prompt_lens=None, prompt_mask=None, cache: Optional[KVCache] = None,
             cache_size: Optional[int] = None, lora: Optional[Adapters] = None,
             adapter_ids=None, prompt_adapter_ids=None, temperature=1.0,
             top_k: Optional[int] = None, top_p=None,
             eos_ids: Union[int, Sequence[int], None] = None, stop_ids=None,
             pad_id: int = 0, max_new_tokens_bucket: Optional[int] = None,
             on_step: Optional[Callable[[jax.Array], None]] = None,
             rows: Optional[multihost.ProcessRows] = None, merge_lora: bool = True,
             share_prefix: bool = True, prompt_width: Optional[int] = None,
             compile_ahead: bool = False) -> SampleOutput:
  """Encodes a chunk of prompt tokens and samples up to `max_new_tokens` per row.

  For speed pass params and config in `layout.decoding()` (`layout.convert_params`, once):
  on CPU decoding SmolLM2-135M is then about 1.4x (batch 1) to 1.6x (batch 16) faster than
  in the training layout, for a longer compile (the layers are unrolled).

  Every argument is checked here, on the host, before anything is compiled: a bad value is a
  ValueError naming the argument, never a silently wrong sample.

  Args:
    params: the model's parameter tree, in `config.layout`.
    tokens: [B, P] int prompt tokens (the new chunk when continuing `cache`), padded
      anywhere (right padding with `prompt_lens`); real tokens must lie in [0, V).
    config: the static model config (its layout is the params' and the cache's).
    rng: a PRNG key; the same key gives the same output.
    max_new_tokens: int or [B] per-row limits ≥ 0 (0: only encode the prompt). Cached
      positions + real prompt tokens + max_new_tokens may not pass
      `config.max_position_embeddings`.
    prompt_lens: [B] real tokens at the start of each row; or `prompt_mask` [B, P] bool.
      Default: every token is real. A row that samples needs ≥ 1 real token in the chunk.
    cache: continue an earlier call's `SampleOutput.cache` (donated; don't reuse it). It grows
      (a copy) when the new chunk and tokens do not fit its slots.
    cache_size: slots of a fresh cache, to leave room for later continuations.
    lora, adapter_ids: adapters and a scalar or [B] per-row adapter ids in [-1, A)
      (-1 = base) for prompt and output.
    prompt_adapter_ids: optional [B, P] per-token ids for the prompt chunk instead (e.g. a
      re-encoded multi-agent history, each token through the adapter that first encoded it).
    temperature: scalar or [B], finite and ≥ 0; 0 = greedy. A tiny temperature is computed
      stably (the max logit is subtracted first) and approaches greedy.
    top_k: static int ≥ 0, or None; 0 and None are off (as in transformers).
    top_p: None, scalar or [B] in (0, 1]; 1 and None are off.
    eos_ids: stop ids of every row in [0, V); stop_ids: [B, M] further per-row stop ids in
      [0, V), -1 = none.
    pad_id: fills `tokens` off the mask (any int; never attended).
    max_new_tokens_bucket: N, the static output width (≥ max(max_new_tokens)); default
      `bucket(max(max_new_tokens), 16)`. Fixing it keeps one compile across varying limits.
    on_step: static; called on the host with the number of tokens sampled so far, once per
      decode step (for progress bars). A new function object compiles again: pass the same
      one to repeated calls.
    rows: a multi-process job's `multihost.ProcessRows`: every per-row argument (tokens,
      lens, masks, limits, ids, temperature, top_p, stop ids) holds only this process's
      block of the rows, B/P of them, and `cache` is a global one from an earlier call. The
      processes agree on the padded widths and on greedy (small collectives: every process
      must make the same calls, with the same `top_p`-or-None and `lora`-or-None choice),
      each places its own rows, and the output is global (read your rows back with
      `rows.get`). None: one process, or every process passes the whole batch.
    merge_lora: when every busy row (one with a real prompt token or tokens to sample) goes
      through the same adapter and weights and compute are float32, fold that adapter into a
      copy of the weights for this call (`lora.merge_adapter`): no LoRA branch in any matmul,
      for a second copy of the weights while the call runs. Same outputs to f32 rounding.
    share_prefix: a fresh prompt (no `cache`, no `prompt_adapter_ids`, one process) whose
      busy rows all open with the same ≥ `MIN_SHARED_PREFIX` real tokens through the same
      adapter (e.g. one agent's system prompt in the per-agent view) encodes those tokens
      once, for one row, and gives every busy row a copy of their keys and values. Same
      outputs to f32 rounding; the returned cache holds the prefix's slots.
    prompt_width: a bound on the chunk's real width that the caller knows from its budgets
      (e.g. the prompt as it would be had every earlier reply used its whole
      `max_new_tokens`): P is bucketed from it, not from this call's tokens, so calls whose
      prompts vary below the bound compile once (`_plan_shapes`).
    compile_ahead: for a loop that calls again with prompts of other lengths (a trainer's
      rollouts): when this call compiles a fresh-cache program for a new prompt bucket, the
      next bucket up compiles too, now, so that a later, longer prompt does not stop the loop
      to compile. Off for a one-off call (it would pay for a program it never runs).
  Returns:
    A `SampleOutput` with N output columns.
  Raises:
    ValueError naming the argument for any value outside the ranges above.
  """
  call = _checked(tokens, config, max_new_tokens, prompt_lens, prompt_mask, lora, adapter_ids,
                  prompt_adapter_ids, temperature, top_p, top_k, eos_ids, stop_ids, cache, rows)
  route = _route(params, config, call, lora, cache, rows, merge_lora, share_prefix)
  shapes, ahead = _plan_shapes(call, route, config, cache, cache_size=cache_size,
                               prompt_width=prompt_width, new_tokens=max_new_tokens_bucket,
                               rows=rows, compile_ahead=compile_ahead)
  run = functools.partial(_launch, call, route, config=config, cache=cache, rng=rng,
                          pad_id=int(pad_id), on_step=on_step, rows=rows)
  for wider in ahead:
    run(wider, compile_only=True)
  return run(shapes)


def _launch(call: _Call, route: _Route, shapes: Shapes, *, config, cache, rng, pad_id, on_step,
            rows, compile_only: bool = False) -> Optional[SampleOutput]:
  """Runs the planned call; `compile_only`: compiles its programs without running them (a
  fresh cache is still made, so that the small programs filling it compile too)."""
  tokens, mask, token_ids = _fit_prompt(call, route.prefix_length, shapes.prompt, pad_id)
  place = jax.device_put if rows is None else rows.put  # rows: this process's block -> global
  fresh = cache is None and not route.prefix_length
  if route.prefix_length:
    cache = _shared_prefix_cache(
        route.params, call.tokens[call.busy][0, :route.prefix_length], route.lora,
        route.prefix_adapter, call.busy, config, width=shapes.prefix, size=shapes.slots,
        compile_only=compile_only)
  else:
    cache = _fit_cache(cache, config, shapes.batch, shapes.slots, rows)
  args = (route.params, place(tokens), place(mask), cache, route.lora,
          place(route.adapter_ids.astype(np.int32)), rng, place(call.temperature),
          None if call.top_p is None else place(call.top_p),
          place(call.max_new.astype(np.int32)), place(call.stop_ids),
          None if token_ids is None else place(token_ids))
  static = dict(config=config, num_new=shapes.new, top_k=call.top_k, greedy=shapes.greedy,
                pad_id=pad_id, on_step=on_step, fresh_cache=fresh)
  if compile_only:
    _generate_jit.lower(*args, **static).compile()
    return None
  return generate_jit(*args, **static)

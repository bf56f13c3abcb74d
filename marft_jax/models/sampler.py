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
A third, asked for by the caller, does the same within groups of rows (`prefix_groups`: the n
samples of one problem in a sampled evaluation).

`generate` plans a call on the host (`sampler_plan`: arguments checked, the fast path chosen,
shapes bucketed), then runs the jitted loop below; one token is drawn by `token_sampling`.

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

import functools
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marft_jax import multihost
from marft_jax.lora.routing import Adapters
from marft_jax.models import sampler_plan as plan
from marft_jax.models import transformer
from marft_jax.models.config import ModelConfig
from marft_jax.models.token_sampling import sample_vocab_major
from marft_jax.models.transformer import KVCache, Params

@struct.dataclass
class SampleOutput:
  """What one `generate` call produced. N is the bucketed number of new tokens."""

  tokens: jax.Array  # [B, N] int32 sampled tokens; `pad_id` where `mask` is False.
  logprobs: jax.Array  # [B, N] f32 log-prob under the sampling distribution; 0 off mask.
  mask: jax.Array  # [B, N] bool: True up to and including the stop token.
  lengths: jax.Array  # [B] int32 number of valid generated tokens.
  cache: KVCache  # every real prompt token and valid generated token; continue from it.


# --- the jitted loop ------------------------------------------------------------------------


@struct.dataclass
class _LoopState:
  step: jax.Array  # [] int32: tokens sampled so far (the next output column).
  hidden: jax.Array  # [B, D]: the hidden state the next token is sampled from.
  active: jax.Array  # [B] bool: the row samples again at the next step.
  tokens: jax.Array  # [B, N] int32
  logprobs: jax.Array  # [B, N] f32
  mask: jax.Array  # [B, N] bool
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

  def record(state: _LoopState) -> tuple[_LoopState, jax.Array, jax.Array]:
    """Samples column `state.step` from `state.hidden` for the active rows: (the state, the
    tokens [B], which of them are real [B])."""
    logits = transformer.logits_from_hidden(params, state.hidden, config, vocab_major=True)
    tok, logprob = sample(jax.random.fold_in(rng, state.step), logits, temperature, top_p)
    active = state.active
    tok = jnp.where(active, tok, pad_id)
    column = lambda buf, value: jax.lax.dynamic_update_slice(buf, value[:, None], (0, state.step))
    stop = jnp.any(tok[:, None] == stop_ids, axis=-1)
    step = state.step + 1
    state = state.replace(
        step=step, active=active & ~stop & (step < max_new_tokens),
        tokens=column(state.tokens, tok),
        logprobs=column(state.logprobs, jnp.where(active, logprob, 0.0)),
        mask=column(state.mask, active))
    return state, tok, active

  # --- prefill: encode the chunk; the first token comes from each row's last real token ---
  prefill_ids = adapter_ids if prompt_adapter_ids is None else prompt_adapter_ids
  h, cache = model(tokens, mask=mask, cache=cache, adapter_ids=prefill_ids,
                   cache_is_empty=fresh_cache)
  state = _LoopState(
      step=jnp.zeros((), jnp.int32), hidden=_last_real_hidden(h, mask),
      active=max_new_tokens > 0, tokens=jnp.full((B, num_new), pad_id, jnp.int32),
      logprobs=jnp.zeros((B, num_new), jnp.float32), mask=jnp.zeros((B, num_new), bool),
      cache=cache)

  # --- decode: sample the next token, then write it into the cache ---
  # A row's last token (its stop token, or its last allowed one) is written too, so the
  # returned cache holds every valid token; the step that writes it samples nothing more.
  # Sampling sits in the loop alone, not also after the prefill: one copy of the head and the
  # sampling code (its PRNG, the top-p filter) in the program. For the tiny test model that is
  # a sixth to a fifth of its instructions, and its compile 11-23 % faster (per-agent LoRA or
  # none); the suite compiles some 160 sampler programs.
  def body(state: _LoopState) -> _LoopState:
    state, tok, real = record(state)
    if on_step is not None:  # host-side progress report, e.g. a tqdm bar
      jax.debug.callback(on_step, state.step)
    h, cache = model(tok[:, None], mask=real[:, None], cache=state.cache,
                     adapter_ids=adapter_ids)
    return state.replace(hidden=h[:, 0], cache=cache)

  state = jax.lax.while_loop(lambda state: jnp.any(state.active), body, state)
  return SampleOutput(tokens=state.tokens, logprobs=state.logprobs, mask=state.mask,
                      lengths=jnp.sum(state.mask, axis=-1, dtype=jnp.int32), cache=state.cache)


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

  (quarter octaves: 16, 20, 24, 28, 32, 40, …, 64, 80, 96, 112, 128, 160, …; see
  `sampler_plan.bucket`).
  A (P, S) the same static arguments compiled before is reused instead when it is at most
  `sampler_plan.REUSE_FACTOR` wider, and a fresh-cache call that compiles a new P compiles the
  next P up ahead (`sampler_plan.static_shapes`): prompts that vary by a bucket compile
  nothing after the first call.

  Traced (changing them does not compile): tokens [B, P], mask [B, P], cache (S slots,
  donated: its buffers become the returned cache's), lora, adapter_ids [B], rng,
  temperature [B], top_p [B], max_new_tokens [B], stop_ids [B, M] (-1 = unused).
  """
  return _generate_jit(params, tokens, mask, cache, lora, adapter_ids, rng, temperature,
                       top_p, max_new_tokens, stop_ids, prompt_adapter_ids, config=config,
                       num_new=num_new, top_k=top_k, greedy=greedy, pad_id=pad_id,
                       on_step=on_step, fresh_cache=fresh_cache)


# --- the host-side entry point --------------------------------------------------------------


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
             share_prefix: bool = True, prefix_groups=None,
             prompt_width: Optional[int] = None,
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
      busy rows all open with the same ≥ `sampler_plan.MIN_SHARED_PREFIX` real tokens
      through the same adapter (e.g. one agent's system prompt in the per-agent view)
      encodes those tokens once, for one row, and gives every busy row a copy of their keys
      and values. Same outputs to f32 rounding; the returned cache holds the prefix's slots.
    prefix_groups: None, or [B] ints: rows of a fresh prompt (one process, no
      `prompt_adapter_ids`) with the same id >= 0 and the same adapter share the leading
      tokens they all hold (≥ `sampler_plan.MIN_SHARED_PREFIX`, each row keeping one to
      sample from): each group's are encoded once and copied to its rows, as `share_prefix`
      does for a prefix of every row (e.g. the n samples of one problem in a sampled
      evaluation, whose prompts are the same up to what earlier agents replied). Used instead
      of `share_prefix` when a group shares; same outputs to f32 rounding.
    prompt_width: a bound on the chunk's real width that the caller knows from its budgets
      (e.g. the prompt as it would be had every earlier reply used its whole
      `max_new_tokens`): P is bucketed from it, not from this call's tokens, so calls whose
      prompts vary below the bound compile once (`sampler_plan.static_shapes`).
    compile_ahead: for a loop that calls again with prompts of other lengths (a trainer's
      rollouts): when this call compiles a fresh-cache program for a new prompt bucket, the
      next bucket up compiles too, now, so that a later, longer prompt does not stop the loop
      to compile. Off for a one-off call (it would pay for a program it never runs).
  Returns:
    A `SampleOutput` with N output columns.
  Raises:
    ValueError naming the argument for any value outside the ranges above.
  """
  call = plan.checked(tokens, config, max_new_tokens, prompt_lens, prompt_mask, lora,
                      adapter_ids, prompt_adapter_ids, temperature, top_p, top_k, eos_ids,
                      stop_ids, cache, rows)
  if prefix_groups is not None:
    prefix_groups = np.asarray(prefix_groups)
    if prefix_groups.shape != call.busy.shape or not np.issubdtype(prefix_groups.dtype,
                                                                    np.integer):
      raise ValueError(f"prefix_groups: expected [B={call.busy.shape[0]}] ints, got shape "
                       f"{prefix_groups.shape} and dtype {prefix_groups.dtype}")
  route = plan.route(params, config, call, lora, cache, rows, merge_lora, share_prefix,
                     prefix_groups)
  shapes, ahead = plan.static_shapes(call, route, config, cache, cache_size=cache_size,
                                     prompt_width=prompt_width,
                                     new_tokens=max_new_tokens_bucket, rows=rows,
                                     compile_ahead=compile_ahead)
  run = functools.partial(_launch, call, route, config=config, cache=cache, rng=rng,
                          pad_id=int(pad_id), on_step=on_step, rows=rows)
  for wider in ahead:
    run(wider, compile_only=True)
  return run(shapes)


def _launch(call: plan.Call, route: plan.Route, shapes: plan.Shapes, *, config, cache, rng,
            pad_id, on_step, rows, compile_only: bool = False) -> Optional[SampleOutput]:
  """Runs the planned call; `compile_only`: compiles its programs without running them (a
  fresh cache is still made, so that the small programs filling it compile too)."""
  tokens, mask, token_ids = plan.fit_prompt(call, route.starts, shapes.prompt, pad_id)
  place = jax.device_put if rows is None else rows.put  # rows: this process's block -> global
  fresh = cache is None and not route.prefix_length
  if route.groups is not None:
    cache = plan.group_prefix_cache(route.params, call, route.groups, route.lora,
                                    route.adapter_ids, config, width=shapes.prefix,
                                    size=shapes.slots, compile_only=compile_only)
  elif route.prefix_length:
    cache = plan.shared_prefix_cache(
        route.params, call.tokens[call.busy][0, :route.prefix_length], route.lora,
        route.prefix_adapter, call.busy, config, width=shapes.prefix, size=shapes.slots,
        compile_only=compile_only)
  else:
    cache = plan.fit_cache(cache, config, shapes.batch, shapes.slots, rows)
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

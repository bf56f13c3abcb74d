"""Drawing one token per row from logits: temperature, top-k, the top-p nucleus, and the
log-prob of the drawn token under the distribution it was drawn from (`sample_tokens`). The
sampler's loop calls `sample_vocab_major` on the decoding layout's [V, B] logits.

Log-probabilities are those of softmax(logits / temperature) restricted to the top-k and then
to the top-p nucleus, renormalised: at temperature 1 without top-k/top-p, a teacher-forced
forward's `log_softmax`. Greedy rows (temperature 0) take the argmax; their log-prob is the
model's own (temperature-1, unfiltered) log-softmax.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

# Inverse-CDF sampling sums probabilities in blocks of this many tokens (two-level search).
_CDF_BLOCK = 256
# 2^30 > the int32 bit pattern of 1.0f: 30 halvings pin an f32 probability threshold exactly.
_TOP_P_ITERATIONS = 30

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

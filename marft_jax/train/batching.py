"""From episode records to the padded arrays one jitted update trains on.

Every `TokenSequence` of every kept episode becomes one row of a [B, T] batch (right-padded,
T bucketed so the update compiles a few times per run: `row_length`). The learner works in
the action frame: position t is the decision that emits token t+1 (its logits predict it), so
every per-decision array here is shifted by one from the records' per-token arrays.

The learner needs logits only at the trained decisions: `act_positions` lists them row by row
(P, the most of any row, bucketed), so the vocabulary projection, a fifth of the model's
FLOPs, skips the prompts (most of a per-agent-view row).

Agent turns (one reply each) are also indexed per row, up to K turns a row ([B, K] arrays):
action-level algorithms take one log-prob, one value and one advantage per turn. A turn's
value is read at the decision that emits its first token: the state after its whole prompt.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from marft_jax.models.sampler_plan import bucket
from marft_jax.rollout.episode import Episode

MIN_LENGTH_BUCKET = 64
# `row_length`'s steps (`optimizer.row_length_step`), and the longest row it rounds to one.
ROW_LENGTH_STEPS = (8, 16, 32, 64, 128, 256)
FINE_ROW_LENGTH = 256
POSITION_WIDTHS = 8  # trained-position widths P per row length T (`act_positions`)


@struct.dataclass
class TrainBatch:
  """B sequences padded to T tokens, K turns a row. All NumPy or JAX arrays."""

  tokens: np.ndarray  # [B, T] int32
  mask: np.ndarray  # [B, T] bool: a real token (not padding)
  # [B, T] int32: the adapter each token was sampled/encoded with; or [B] (`per_row_adapters`)
  adapter_ids: np.ndarray
  act_mask: np.ndarray  # [B, T] bool: decision t emitted a sampled token t+1 (trained)
  act_agent: np.ndarray  # [B, T] int32: the agent of that decision, -1 elsewhere
  act_turn: np.ndarray  # [B, T] int32: its turn's index in the row, -1 elsewhere
  act_temperature: np.ndarray  # [B, T] f32: its sampling temperature (1 elsewhere)
  act_behaviour_logp: np.ndarray  # [B, T] f32: the sampler's log-prob of token t+1
  act_positions: np.ndarray  # [B, P] int32: each row's trained decisions, then -1 (see below)
  turn_valid: np.ndarray  # [B, K] bool
  turn_agent: np.ndarray  # [B, K] int32
  turn_value_pos: np.ndarray  # [B, K] int32: decision emitting the turn's first token
  turn_length: np.ndarray  # [B, K] int32: its number of tokens
  row_episode: np.ndarray  # [B] int32: index of the row's episode in the batch
  # Filled in by `advantages.py` (zeros until then).
  act_advantage: np.ndarray  # [B, T] f32 per decision (token-level algorithms)
  act_return: np.ndarray  # [B, T] f32 value targets per decision
  act_old_value: np.ndarray  # [B, T] f32 critic values at rollout time
  turn_advantage: np.ndarray  # [B, K] f32 (action-level algorithms)
  turn_return: np.ndarray  # [B, K] f32
  turn_old_value: np.ndarray  # [B, K] f32


PAD_TOKEN = "pad_id"  # `PADDING`'s marker for the tokenizer's pad id
# Every field's width after the row axis ("T" tokens, "K" turns, "P" trained positions, None:
# a [B] field), dtype, and the value its padding holds: a padding row or column is masked out
# of every loss (`make_batch` fills real rows over these; multi-process blocks pad with them).
PADDING = {
    "tokens": ("T", np.int32, PAD_TOKEN),
    "mask": ("T", np.bool_, False),
    "adapter_ids": ("T", np.int32, -1),
    "act_mask": ("T", np.bool_, False),
    "act_agent": ("T", np.int32, -1),
    "act_turn": ("T", np.int32, -1),
    "act_temperature": ("T", np.float32, 1.0),
    "act_behaviour_logp": ("T", np.float32, 0.0),
    "act_positions": ("P", np.int32, -1),
    "turn_valid": ("K", np.bool_, False),
    "turn_agent": ("K", np.int32, -1),
    "turn_value_pos": ("K", np.int32, 0),
    "turn_length": ("K", np.int32, 0),
    "row_episode": (None, np.int32, -1),
    "act_advantage": ("T", np.float32, 0.0),
    "act_return": ("T", np.float32, 0.0),
    "act_old_value": ("T", np.float32, 0.0),
    "turn_advantage": ("K", np.float32, 0.0),
    "turn_return": ("K", np.float32, 0.0),
    "turn_old_value": ("K", np.float32, 0.0),
}


def padding_fields(num_rows: int, T: int, K: int, P: int, pad_id: int) -> dict[str, np.ndarray]:
  """Every `TrainBatch` field as a [num_rows] or [num_rows, T | K | P] array of padding."""
  sizes = {"T": T, "K": K, "P": P}
  return {name: np.full((num_rows,) if width is None else (num_rows, sizes[width]),
                        pad_id if fill == PAD_TOKEN else fill, dtype)
          for name, (width, dtype, fill) in PADDING.items()}


def positions_width(n: int, T: int) -> int:
  """n ≤ T positions rounded up to a multiple of max(T // POSITION_WIDTHS, 1), that step
  rounded down to a multiple of 8 above 8, at most T. The rounding keeps a step of 16 at
  T = 160 (`row_length` at step 32), where 20 padded the default job's 48-token replies to
  60 positions; every T of step 64's rule has a multiple of 8 already (its widths and bits
  unchanged)."""
  step = max(T // POSITION_WIDTHS, 1)
  if step > 8:
    step -= step % 8
  return min(-(-max(int(n), 1) // step) * step, T)


def bucket_length(n: int, minimum: int = MIN_LENGTH_BUCKET) -> int:
  """Lengths round up to a multiple of `minimum` (a power of two) up to 4·minimum, then to
  half octaves (…, 256, 384, 512, 768, 1024, …; `sampler_plan.bucket`): padding is under a
  third of a row where powers of two alone padded up to half (a 587-token orchestrator row
  went to 1024), for at most one more compile an octave."""
  n = max(int(n), 1)
  if n <= 4 * minimum:
    return -(-n // minimum) * minimum
  return bucket(n, 4 * minimum, per_octave=2)


def row_length(n: int, step: int = MIN_LENGTH_BUCKET) -> int:
  """The update's row length T for a longest row of n tokens: a multiple of `step` up to
  `FINE_ROW_LENGTH` (256), then half octaves (384, 512, 768, …; `sampler_plan.bucket`).

  Every padding column costs the update and `prepare` a full column of forward (and
  backward) work: the default job's longest rows (reasoner → actor, SmolLM2) reach 148-160
  tokens with every reply at its budget, which step 64 pads to 192 (the batch 63-70 % real
  tokens) and step 32 to 160 (75-83 %), for at most one more compile an extra step crosses.
  Step 64 is `bucket_length`'s rule, the only one before `optimizer.row_length_step`: the
  padding changes the f32 rounding of the real tokens' activations (2e-6 in the tiny model's
  critic hidden states at T = 160 against 192), so old checkpoints resume with 64.
  """
  if step not in ROW_LENGTH_STEPS:
    raise ValueError(f"row_length_step={step!r}: use one of {ROW_LENGTH_STEPS}")
  n = max(int(n), 1)
  if n <= FINE_ROW_LENGTH:
    return -(-n // step) * step
  return bucket(n, FINE_ROW_LENGTH, per_octave=2)


def act_positions(act_mask: np.ndarray, at_least: int = 0) -> np.ndarray:
  """[B, T] bool -> [B, P] int32: the indices of each row's True entries, padded with -1.

  P is the most of any row (or `at_least`, a bound) rounded up to a multiple of T/8
  (`positions_width`): every padded position costs a full vocabulary row in the update (on
  XLA:CPU a 96-decision SmolLM2 reply padded to 128 cost 2-3 % of an update), while at most
  8 widths per T bound the compiles.
  """
  counts = act_mask.sum(axis=1)
  P = positions_width(max(int(counts.max(initial=0)), at_least), act_mask.shape[1])
  out = np.full((act_mask.shape[0], P), -1, np.int32)
  for r, row in enumerate(act_mask):
    index = np.flatnonzero(row)
    out[r, :len(index)] = index
  return out


def per_row_adapters(batch: TrainBatch) -> TrainBatch:
  """The batch with per-row adapter ids [B] when every row's real tokens went through one
  adapter (the per-agent view: a row is one agent's prompt and reply); unchanged otherwise.

  Exact: a padding token's adapter changes only its own outputs, which nothing attends to or
  trains on. Where LoRA is routed rather than fused (`lora.fused`: with dropout, or adapters
  too wide to fuse), per-row ids take the router's gather path, a single adapter's cost,
  where per-token ids sort tokens into tiles (6 % of a SmolLM2 forward + backward at
  8 × 256); the fused path costs the same for both. A row with no real token gets -1.
  """
  ids = np.asarray(batch.adapter_ids)
  if ids.ndim == 1:
    return batch
  mask = np.asarray(batch.mask, bool)
  first = np.where(mask.any(axis=1), ids[np.arange(ids.shape[0]), mask.argmax(axis=1)], -1)
  if not np.all((ids == first[:, None]) | ~mask):
    return batch
  return batch.replace(adapter_ids=first.astype(np.int32))


def decision_adapters(batch: TrainBatch):
  """[B, T] int32: the adapter that sampled decision t's token (`adapter_ids` of token t+1),
  -1 where t is no trained decision or its token came from the frozen base (a `base` role's
  reply). NumPy in, NumPy out; traced in, traced out."""
  xp = _array_module(batch.adapter_ids, batch.act_mask)
  ids = batch.adapter_ids
  if ids.ndim == 1:  # per-row ids (`per_row_adapters`)
    act = xp.broadcast_to(ids[:, None], batch.act_mask.shape)
  else:
    act = xp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
  return xp.where(batch.act_mask, act, -1)


def trained_masks(batch: TrainBatch, active=None):
  """([B, T] bool decisions, [B, K] bool turns) that train a policy: sampled with an adapter
  (not a `base` role's) that `active` ([A] bool, the adapters the agent-by-agent schedule
  trains now; None: every adapter) lets move. Only these enter the advantage whitening, the
  policy losses and the policy metrics; the critic still learns every turn, and its values
  at the others still serve their predecessors' bootstraps. A turn trains if its decisions
  do (`act_turn`; one reply is sampled with one adapter)."""
  xp = _array_module(batch.adapter_ids, batch.act_mask)
  act = decision_adapters(batch)
  trained = act >= 0
  if active is not None:
    active = xp.asarray(active, bool)
    trained = trained & active[xp.clip(act, 0, active.shape[0] - 1)]
  K = batch.turn_valid.shape[1]
  in_turn = xp.asarray(batch.act_turn)[:, None, :] == xp.arange(K)[None, :, None]  # [B, K, T]
  turns = xp.any(trained[:, None, :] & in_turn, axis=2)
  return trained, turns & xp.asarray(batch.turn_valid, bool)


def _array_module(*arrays):
  """jax.numpy if any of `arrays` is a JAX array (or traced), else NumPy."""
  return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def make_batch(episodes: Sequence[Episode], pad_id: int, num_rows: int = 0,
               max_turns: int = 0, reply_budgets: Optional[Sequence[int]] = None,
               row_length_step: int = MIN_LENGTH_BUCKET) -> TrainBatch:
  """Stacks the sequences of `episodes` (dropped ones excluded by the caller) into a batch.

  Args:
    episodes: the episodes to train on.
    pad_id: the token id filling padding (never attended, never trained).
    num_rows: pad the batch to this many rows (0: exactly the sequences); padded rows are
      all-masked, so a fixed B keeps one compile when episodes are dropped.
    max_turns: K (0: the most turns of any row).
    reply_budgets: each agent's max_new_tokens (by agent id): T and P are then bucketed from
      the rows as long as they would be had every reply used its whole budget
      (`budgeted_widths`), so reply lengths do not change the update's shapes. None: from
      the rows as they are.
    row_length_step: T is a multiple of it (`row_length`; `optimizer.row_length_step`).
  """
  rows = [(e, s.arrays(), s.spans) for e, ep in enumerate(episodes) for s in ep.sequences]
  if not rows:
    raise ValueError("no sequences to train on (every episode was dropped?)")
  B = max(num_rows, len(rows))
  length, positions = budgeted_widths(episodes, reply_budgets)
  T = row_length(length, row_length_step)
  K = max(max_turns, max(len(spans) for _, _, spans in rows), 1)
  b = padding_fields(B, T, K, 0, pad_id)  # P is known once the rows are in
  for r, (e, a, spans) in enumerate(rows):
    n = len(a["tokens"])
    b["row_episode"][r] = e
    b["tokens"][r, :n], b["mask"][r, :n] = a["tokens"], True
    b["adapter_ids"][r, :n] = a["adapter_ids"]
    # Action frame: decision t emits token t + 1.
    b["act_mask"][r, :n - 1] = a["loss_mask"][1:]
    b["act_agent"][r, :n - 1] = np.where(a["loss_mask"][1:], a["agent_ids"][1:], -1)
    b["act_temperature"][r, :n - 1] = a["temperature"][1:]
    b["act_behaviour_logp"][r, :n - 1] = a["behaviour_logprobs"][1:]
    if len(spans) > K:
      raise ValueError(f"a sequence has {len(spans)} turns, more than max_turns={K}")
    for k, span in enumerate(spans):
      if span.end == span.start:
        continue  # an empty reply emits nothing: no decision to train
      if span.start == 0:
        raise ValueError("a reply starts a sequence: no prompt conditions it")
      b["act_turn"][r, span.start - 1:span.end - 1] = k
      b["turn_valid"][r, k] = True
      b["turn_agent"][r, k] = span.agent
      b["turn_value_pos"][r, k] = span.start - 1
      b["turn_length"][r, k] = span.end - span.start
  b["act_positions"] = act_positions(b["act_mask"], positions)
  return TrainBatch(**b)


def budgeted_widths(episodes: Sequence[Episode], reply_budgets: Optional[Sequence[int]] = None
                    ) -> tuple[int, int]:
  """(the longest row, the most trained decisions of a row), unbucketed. With
  `reply_budgets` (max_new_tokens by agent id), bounds on them from the budgets: a row
  counts every reply of its episode as its whole budget (a per-agent prompt holds earlier
  replies; up to re-tokenisation of their text), and its trained decisions are its replies'
  budgets. Without, the rows' own lengths and counts."""
  length = positions = 0
  for episode in episodes:
    unused = 0 if reply_budgets is None else max(sum(
        reply_budgets[t.agent] - t.num_tokens for t in episode.turns), 0)
    for sequence in episode.sequences:
      length = max(length, len(sequence.tokens) + unused)
      positions = max(positions, sum(
          s.end - s.start if reply_budgets is None else reply_budgets[s.agent]
          for s in sequence.spans))
  return length, positions


def over_row_chunks(fn, batch: TrainBatch, chunks: int, *others):
  """`fn(batch, *others)` computed on `chunks` equal blocks of the rows in turn (`lax.map`:
  one block's activations at a time), a block of padding rows alone giving zeros without
  running `fn` (`lax.cond`): the tail of a batch padded to the most rows its team can fill.
  Traced (call it under `jit`). `others`: pytrees whose leaves also have B rows first,
  split alongside; `fn` maps a block of R rows to arrays of R rows: [B, ...] out.
  """
  B = batch.tokens.shape[0]
  if B % chunks:
    raise ValueError(f"{B} rows do not split into {chunks} blocks")
  blocks = jax.tree.map(lambda x: x.reshape((chunks, B // chunks) + x.shape[1:]),
                        (batch,) + others)

  def run(block):
    shapes = jax.eval_shape(fn, *block)
    zeros = lambda *_: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.cond(jnp.any(block[0].mask), fn, zeros, *block)

  return jax.tree.map(lambda y: y.reshape((B,) + y.shape[2:]), jax.lax.map(run, blocks))

"""Turn chains: the backup of a multi-agent episode whose turns may run in parallel.

An episode is a list of agent turns in execution order. Each turn belongs to an env step
and, within it, to a layer: turns of one layer ran in parallel, each seeing only what the
earlier layers wrote (a DAG's Kahn layer, `envs.AgentGraph.layers`). A sequential chain and
an orchestrator's calls have one turn a layer. The functions here turn those ids into the
arrays of one backup, all pure, unbatched and with static shapes (vmap over episodes):

  turn_successors  the turn each turn's hop leads to: the first turn of the next layer (of
                   this env step, else of the next), never a sibling of the same layer.
  turn_hops        the discount and trace decay of that hop: γ_agent, λ_agent inside an env
                   step; γ·(1 − done), λ out of it.
  expand_turns     one position per turn (action level) or per token (token level): inside
                   a reply hops discount by γ_token, λ_token and carry no reward; the reply's
                   last token carries the turn's reward (`credit.turn_credit`: equal /
                   step_discount / per_step) and hop.
Then `returns.successor_gae` runs GAE along the successor pointers (`masked_gae` when
each position's successor is the next one).

Why successors and not a plain sequence: a branch of a DAG must bootstrap from a state that
contains its reply. Laid out one after the other, branch b would hop to its sibling c, whose
prompt never saw b's reply. With successors both hop to the join (the next layer's first
turn), whose prompt saw every branch; and each branch is trained on its own tokens only.

Index conventions: `_k` arrays have one entry per turn (padding turns last, `valid_k` 0),
`_t` arrays one per position. A successor index equal to the array's length means "none":
the episode ends there (bootstrap value 0 unless `v_bootstrap` says otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.validation import (check_forward_pointers, check_range, check_rank,
                                  check_same_shape, check_unit_interval, is_traced)


def turn_successors(step_k: jax.Array, layer_k: jax.Array, valid_k: jax.Array) -> jax.Array:
  """[n] int32: the index of the turn each turn hops to, n where none.

  Turns of one (env step, layer) are a group; a turn's successor is the first turn of the
  next group in execution order. Valid turns come first and a group's turns are contiguous.

  Args:
    step_k: [n] env step of each turn.
    layer_k: [n] layer of each turn within its env step.
    valid_k: [n] non-zero on real turns (a prefix).
  Raises:
    ValueError: concrete valid_k that is not a prefix, or a group whose turns are not
      contiguous (traced ones are not checked: successors would then skip or repeat groups).
  """
  check_rank(1, step_k=step_k, layer_k=layer_k, valid_k=valid_k)
  check_same_shape(step_k=step_k, layer_k=layer_k, valid_k=valid_k)
  if not is_traced(step_k, layer_k, valid_k):
    _check_turn_order(np.asarray(step_k), np.asarray(layer_k), np.asarray(valid_k) != 0)
  n = step_k.shape[0]
  valid = jnp.asarray(valid_k) != 0
  index = jnp.arange(n)
  changed = (step_k != jnp.roll(step_k, 1)) | (layer_k != jnp.roll(layer_k, 1))
  starts = valid & ((index == 0) | changed)
  start_index = jnp.where(starts, index, n)
  later = jnp.concatenate([start_index[1:], jnp.full((1,), n, start_index.dtype)])
  successor = jax.lax.cummin(later, reverse=True)
  return jnp.where(valid, successor, n).astype(jnp.int32)


def _check_turn_order(step, layer, valid) -> None:
  if np.any(valid[1:] & ~valid[:-1]):
    i = int(np.argmax(valid[1:] & ~valid[:-1])) + 1
    raise ValueError(f"valid_k[{i}]: a real turn after a padding one (real turns come first)")
  groups = list(zip(step[valid].tolist(), layer[valid].tolist()))
  seen = set()
  for i, group in enumerate(groups):
    if group in seen and group != groups[i - 1]:
      raise ValueError(f"step_k, layer_k: turn {i} (step {group[0]}, layer {group[1]}) is "
                       f"apart from the earlier turns of its group (a group's turns are "
                       f"contiguous)")
    seen.add(group)


def turn_hops(step_k: jax.Array, next_k: jax.Array, done_k: jax.Array, gamma: float,
              lambda_: float, gamma_agent: float | None = None,
              lambda_agent: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Discount and trace decay of the hop leaving each turn: ([n], [n]).

      inside an env step (the successor is in the same step):  γ_agent, λ_agent
      out of it (next step, or no successor):                  γ·(1 − d), λ

  where d is the done flag of the turn's env step. The done flag never cuts a hop inside a
  step (the original MARFT did: reference defect D4, docs/references.md). γ_agent, λ_agent
  default to γ, λ (the original's one γ, one λ at every hop).

  Args:
    step_k: [n] env step of each turn.
    next_k: [n] successor (`turn_successors`), n where none.
    done_k: [n] non-zero if the episode ended after the turn's env step.
    gamma, lambda_, gamma_agent, lambda_agent: in [0, 1].
  Raises:
    ValueError: a γ or λ outside [0, 1] or NaN; a concrete next_k[k] outside (k, n].
  """
  check_rank(1, step_k=step_k, next_k=next_k, done_k=done_k)
  check_same_shape(step_k=step_k, next_k=next_k, done_k=done_k)
  check_forward_pointers("next_k", next_k, step_k.shape[0])
  for name, value in (("gamma", gamma), ("lambda_", lambda_), ("gamma_agent", gamma_agent),
                      ("lambda_agent", lambda_agent)):
    check_unit_interval(name, value)
  gamma_agent = gamma if gamma_agent is None else gamma_agent
  lambda_agent = lambda_ if lambda_agent is None else lambda_agent
  n = step_k.shape[0]
  next_step = jnp.asarray(step_k)[jnp.clip(next_k, 0, n - 1)]
  leaves = (next_k >= n) | (next_step != step_k)
  not_done = (jnp.asarray(done_k) == 0).astype(jnp.float32)
  discount = jnp.where(leaves, gamma * not_done, jnp.float32(gamma_agent))
  lambdas = jnp.where(leaves, jnp.float32(lambda_), jnp.float32(lambda_agent))
  return discount.astype(jnp.float32), lambdas.astype(jnp.float32)


def expand_turns(r_k: jax.Array, discount_k: jax.Array, lambda_k: jax.Array,
                 next_k: jax.Array, length_k: jax.Array, width: int,
                 gamma_token: float = 1.0, lambda_token: float = 1.0):
  """Per-position arrays of a turn chain whose turn k fills `length_k[k]` positions.

  Positions are laid out turn after turn (turn k at [s_k, s_k + length_k)). Inside a turn
  the hop goes to the next position with γ_token, λ_token and no reward; the turn's last
  position carries its reward and hop, to the first position of its successor turn.
  Action level: every length is 1 (one position a turn).

  Args:
    r_k, discount_k, lambda_k: [n] per-turn reward and hop (`credit.turn_credit`,
      `turn_hops`).
    next_k: [n] successor turn, a later one (k < next_k[k]), n where none.
    length_k: [n] positions of each turn (0 for padding turns; real turns ≥ 1).
    width: W ≥ Σ length_k, static.
    gamma_token, lambda_token: in [0, 1].

  Returns:
    (r_t, discount_t, lambda_t, next_t, mask_t, turn_t), each [W]: next_t = W where no
    successor, mask_t 1 on real positions, turn_t the position's turn (n on padding).
  Raises:
    ValueError: gamma_token or lambda_token outside [0, 1]; concrete next_k[k] outside
      (k, n], a negative length_k or Σ length_k > width.
  """
  check_rank(1, r_k=r_k, discount_k=discount_k, lambda_k=lambda_k, next_k=next_k,
             length_k=length_k)
  check_same_shape(r_k=r_k, discount_k=discount_k, lambda_k=lambda_k, next_k=next_k,
                   length_k=length_k)
  check_unit_interval("gamma_token", gamma_token)
  check_unit_interval("lambda_token", lambda_token)
  n = r_k.shape[0]
  check_forward_pointers("next_k", next_k, n)
  check_range("length_k", length_k, 0)
  filled = None if is_traced(length_k) else int(np.sum(length_k))
  if filled is not None and filled > width:
    raise ValueError(f"length_k: the turns fill {filled} positions, more than width={width}")
  length = jnp.asarray(length_k, jnp.int32)
  end = jnp.cumsum(length)
  start = end - length
  t = jnp.arange(width)
  turn = jnp.searchsorted(end, t, side="right").astype(jnp.int32)  # n past the last turn
  mask = turn < n
  k = jnp.clip(turn, 0, n - 1)
  last = mask & (t == end[k] - 1)
  successor = jnp.asarray(next_k)[k]
  first_of_successor = jnp.where(successor < n, start[jnp.clip(successor, 0, n - 1)], width)
  next_t = jnp.where(last, first_of_successor, t + 1).astype(jnp.int32)
  pick = lambda x, inside: jnp.where(last, jnp.asarray(x, jnp.float32)[k], inside)
  r_t = jnp.where(mask, pick(r_k, 0.0), 0.0)
  discount_t = jnp.where(mask, pick(discount_k, gamma_token), 1.0)
  lambda_t = jnp.where(mask, pick(lambda_k, lambda_token), 1.0)
  return r_t, discount_t, lambda_t, next_t, mask, jnp.where(mask, turn, n)

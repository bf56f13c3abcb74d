"""Turn chains: the backup of a multi-agent episode whose turns may run in parallel.

An episode is a list of agent turns in execution order, each in an env step. Who sees whom
is one relation, `sees_kk[j, k]`: turn j's prompt contains turn k's reply (k earlier in the
same env step). In a DAG a role sees the replies of its ancestors (`envs.AgentGraph.ancestors`,
what `envs.Schedule.visible` puts in its prompt); in a chain or an orchestrator's calls every
earlier turn's; in a schedule of layers every earlier layer's (`layer_sees`). The functions
here turn it into the arrays of one backup, all pure, unbatched and with static shapes (vmap
over episodes):

  turn_successors  the turn each turn's hop leads to: its first descendant in execution
                   order, the earliest later turn of its env step whose prompt contains its
                   reply. A turn that no later turn of its env step sees (a sink of the step)
                   hops to the next env step's first turn, or ends the episode.
  layer_sees       the relation of a schedule of layers (each sees every earlier layer).
  hops_to_sink     the hops from a turn along its successors to its step's sink (credit).
  turn_hops        the discount and trace decay of that hop: γ_agent, λ_agent inside an env
                   step; γ·(1 − done), λ out of it.
  expand_turns     one position per turn (action level) or per token (token level): inside
                   a reply hops discount by γ_token, λ_token and carry no reward; the reply's
                   last token carries the turn's reward (`credit.turn_credit`: equal /
                   step_discount / per_step, defined on the same successors) and hop.
Then `returns.successor_gae` runs GAE along the successor pointers (`masked_gae` when
each position's successor is the next one).

Why the first descendant. A turn's advantage bootstraps from the value of the state its hop
leads to, so that state must contain the turn's reply: a state that never saw it (a sibling
branch's prompt) values a future the reply had no part in, and the TD error would score the
sibling instead. Among the states that contain the reply, the first descendant's is the
earliest: the one-step successor that GAE's trace then extends. So a fork's predecessor (a,
with edges a>b, a>c, b run first) hops to b, the earliest state holding a's reply; c's prompt
holds it too but comes later. A branch hops to the join that sees it, or, when nothing later
in the step sees it (edges a>b, a>c, b>d: c), to the next env step: that is the first state
whose prompt may hold its effect (through the environment's next observation). Every turn's
path inside its env step runs from descendant to descendant and ends at exactly one sink,
which is where "equal" credit puts the team reward (`credit.turn_credit`): each turn's return
collects it once. The sequential cases are unchanged by the rule: in a chain or an
orchestrator's calls each turn hops to the next one, and in a diamond (a>b, a>c, b>d, c>d)
a to b and both branches to the join d. Each branch is trained on its own tokens only.

Index conventions: `_k` arrays have one entry per turn (padding turns last, `valid_k` 0),
`_kk` arrays one per pair of turns, `_t` arrays one per position. A successor index equal to
the array's length means "none": the episode ends there (bootstrap value 0 unless
`v_bootstrap` says otherwise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.ppo._checks import check_range, check_unit_interval
from marft_jax.validation import (check_forward_pointers, check_rank, check_same_shape,
                                  is_traced)


def turn_successors(step_k: jax.Array, sees_kk: jax.Array, valid_k: jax.Array) -> jax.Array:
  """[n] int32: the index of the turn each turn hops to, n where none.

      next_k[k] = min { j > k : step_j = step_k, sees_kk[j, k] }   (its first descendant)
                  else min { j > k : step_j ≠ step_k }              (a sink: the next step)
                  else n                                            (the episode ends)

  over the valid turns j. Only the entries of `sees_kk` with k < j in one env step are read.

  Args:
    step_k: [n] env step of each turn, non-decreasing over the valid turns (execution order).
    sees_kk: [n, n] non-zero where turn j's prompt contains turn k's reply (`layer_sees` for
      a schedule of layers).
    valid_k: [n] non-zero on real turns (a prefix).
  Raises:
    ValueError: sees_kk not [n, n]; a concrete valid_k that is not a prefix, or concrete env
      steps that go back (traced ones are not checked: a turn could then hop past a step).

  Example: env step 0 runs turn 0, then turns 1 and 2 in parallel (both see turn 0, not
  each other); env step 1 runs turn 3. Turn 0 hops to its first descendant, 1; both branches
  are sinks of step 0 and hop to step 1; turn 3 ends the episode (4: none).

    >>> step, layer, valid = jnp.array([0, 0, 0, 1]), jnp.array([0, 1, 1, 0]), jnp.ones(4)
    >>> print(turn_successors(step, layer_sees(step, layer, valid), valid))
    [1 3 3 4]
  """
  check_rank(1, step_k=step_k, valid_k=valid_k)
  check_rank(2, sees_kk=sees_kk)
  check_same_shape(step_k=step_k, valid_k=valid_k)
  n = step_k.shape[0]
  if tuple(np.shape(sees_kk)) != (n, n):
    raise ValueError(f"sees_kk: shape {tuple(np.shape(sees_kk))} is not (n, n) for the n={n} "
                     f"turns of step_k")
  if not is_traced(step_k, valid_k):
    _check_turn_order(np.asarray(step_k), np.asarray(valid_k) != 0)
  return _successors(jnp.asarray(step_k), jnp.asarray(sees_kk) != 0, jnp.asarray(valid_k) != 0)


# The bodies below are jitted so that eager callers compile each once per shape instead of
# every array op on its own; inside an outer jit they inline.
@jax.jit
def _successors(step, sees, valid):
  n = step.shape[0]
  j = jnp.arange(n)[:, None]  # the later turn
  later = (j > jnp.arange(n)[None, :]) & valid[:, None]
  same_step = step[:, None] == step[None, :]
  descendant = later & same_step & sees
  first = lambda candidates: jnp.min(jnp.where(candidates, j, n), axis=0)
  successor = jnp.where(jnp.any(descendant, axis=0), first(descendant),
                        first(later & ~same_step))
  return jnp.where(valid, successor, n).astype(jnp.int32)


def layer_sees(step_k: jax.Array, layer_k: jax.Array, valid_k: jax.Array) -> jax.Array:
  """[n, n] bool `sees_kk` of a schedule of layers: each turn sees every turn of the earlier
  layers of its env step, none of its own layer's.

  Turns of one (env step, layer) are a group, run in parallel; groups run one after the
  other, a group's turns contiguous. A sequential chain or an orchestrator's calls have one
  turn a group (`turn_successors`: the next turn); a DAG whose layers each see all earlier
  layers (a diamond) has its Kahn layers as groups (the next layer's first turn). For any
  other DAG pass its own relation to `turn_successors`: a layer does not see every earlier
  layer there.

  Args:
    step_k, layer_k: [n] env step and layer of each turn.
    valid_k: [n] non-zero on real turns (a prefix).
  Raises:
    ValueError: a concrete valid_k that is not a prefix, env steps that go back, or a group
      whose turns are not contiguous.

  Example: a fork, turn 0 then turns 1 and 2 in parallel: both see turn 0 (row j, column k:
  turn j's prompt holds turn k's reply).

    >>> step, layer = jnp.array([0, 0, 0]), jnp.array([0, 1, 1])
    >>> print(layer_sees(step, layer, jnp.ones(3)).astype(int))
    [[0 0 0]
     [1 0 0]
     [1 0 0]]
  """
  check_rank(1, step_k=step_k, layer_k=layer_k, valid_k=valid_k)
  check_same_shape(step_k=step_k, layer_k=layer_k, valid_k=valid_k)
  if not is_traced(step_k, layer_k, valid_k):
    _check_turn_order(np.asarray(step_k), np.asarray(valid_k) != 0, np.asarray(layer_k))
  return _layer_sees(jnp.asarray(step_k), jnp.asarray(layer_k), jnp.asarray(valid_k) != 0)


@jax.jit
def _layer_sees(step, layer, valid):
  index = jnp.arange(step.shape[0])
  # Groups are contiguous: an earlier turn of another layer of the step is an earlier group's.
  return ((step[:, None] == step[None, :]) & (layer[:, None] != layer[None, :])
          & (index[:, None] > index[None, :]) & valid[:, None] & valid[None, :])


def _check_turn_order(step, valid, layer=None) -> None:
  if np.any(valid[1:] & ~valid[:-1]):
    i = int(np.argmax(valid[1:] & ~valid[:-1])) + 1
    raise ValueError(f"valid_k[{i}]: a real turn after a padding one (real turns come first)")
  steps = step[valid]
  if np.any(steps[1:] < steps[:-1]):
    i = int(np.argmax(steps[1:] < steps[:-1])) + 1
    raise ValueError(f"step_k: turn {i} (step {steps[i]}) after a turn of step {steps[i - 1]} "
                     f"(turns come in execution order)")
  if layer is None:
    return
  groups = list(zip(steps.tolist(), layer[valid].tolist()))
  seen = set()
  for i, group in enumerate(groups):
    if group in seen and group != groups[i - 1]:
      raise ValueError(f"step_k, layer_k: turn {i} (step {group[0]}, layer {group[1]}) is "
                       f"apart from the earlier turns of its group (a group's turns are "
                       f"contiguous)")
    seen.add(group)


def hops_to_sink(step_k: jax.Array, next_k: jax.Array) -> jax.Array:
  """[n] int32: the hops from each turn along next_k to the last turn of its path inside
  its env step (its sink: 0 there, and at a turn whose successor is in another step or
  none).

  Args:
    step_k: [n] env step of each turn.
    next_k: [n] successor of each turn, in (k, n] (n: none).
  Raises:
    ValueError: a concrete next_k[k] outside (k, n].

  Example: a chain of three turns in env step 0, then one turn in step 1.

    >>> print(hops_to_sink(jnp.array([0, 0, 0, 1]), jnp.array([1, 2, 3, 4])))
    [2 1 0 0]
  """
  check_rank(1, step_k=step_k, next_k=next_k)
  check_same_shape(step_k=step_k, next_k=next_k)
  n = step_k.shape[0]
  check_forward_pointers("next_k", next_k, n)
  return _hops_to_sink(jnp.asarray(step_k), jnp.asarray(next_k))


@jax.jit
def _hops_to_sink(step, next_k):
  n = step.shape[0]
  index = jnp.arange(n)
  inside = (next_k < n) & (step[jnp.clip(next_k, 0, n - 1)] == step)
  # Pointer doubling: after i rounds, `ahead` is 2^i hops on (a sink points to itself) and
  # `hops` counts the hops taken; a path has fewer than n hops.
  ahead = jnp.where(inside, next_k, index)
  hops = inside.astype(jnp.int32)
  for _ in range(max(n - 1, 1).bit_length()):
    hops, ahead = hops + hops[ahead], ahead[ahead]
  return hops


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

  Example: two turns in env step 0, one in step 1 where the episode ends, γ = λ = 0.5
  across env steps and γ_agent = λ_agent = 1 inside one.

    >>> step, next_k, done = jnp.array([0, 0, 1]), jnp.array([1, 2, 3]), jnp.array([0, 0, 1])
    >>> discount, lambdas = turn_hops(step, next_k, done, 0.5, 0.5, gamma_agent=1.0,
    ...                               lambda_agent=1.0)
    >>> print(discount, lambdas)
    [1.  0.5 0. ] [1.  0.5 0.5]
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

  Example: turn 0 at two positions (its tokens), turn 1 at one, in a width of 4 (position 3
  is padding), γ_token = 0.5. Turn 0's first position hops to its second with γ_token and
  no reward; its last one carries the turn's reward and hop, to turn 1's position 2.

    >>> r_t, discount_t, _, next_t, mask_t, turn_t = expand_turns(
    ...     jnp.array([0.0, 1.0]), jnp.array([1.0, 0.0]), jnp.ones(2), jnp.array([1, 2]),
    ...     jnp.array([2, 1]), width=4, gamma_token=0.5)
    >>> print(r_t, discount_t, next_t)
    [0. 0. 1. 0.] [0.5 1.  0.  1. ] [1 2 4 4]
    >>> print(mask_t, turn_t)
    [ True  True  True False] [0 0 1 2]
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

"""Advantages and returns: GAE over agent chains, turn chains and token-level backups.

One backup step does every GAE: `masked_gae` runs it as a reverse `lax.scan` over positions
in which masked positions are transparent, `successor_gae` along successor pointers (a
position may hop past its neighbours). The MARFT forms only build their per-position
rewards, discounts and trace decays:

- `action_level_advantages` (MARFT-A; the original's agent-chain GAE, docs/references.md):
  the agents of an env step are consecutive decisions; the last agent of step t bootstraps
  from agent 0 of step t+1.
- `token_level_advantages` (MARFT-T; the original's token-level backup, docs/references.md):
  one backup over the flattened (env step, agent, token) positions, with separate
  discounts for the three kinds of hop.
- `turn_chain_advantages` (what the trainer runs): the turns of one episode, sequential,
  in a DAG or routed, at one position a turn or one a token; `successor_gae` is the backup
  along its successor pointers: each turn hops to its first descendant in execution order,
  the earliest later turn of its env step whose prompt contains its reply, and a turn that
  none sees to the next env step (`chains`, which says why).

Index convention: an array suffixed `_t` has one entry per position t of the scan; the
reward, discount and λ at t belong to the hop from position t to the next one, as in rlax.
Advantages are targets: compute them outside the loss (they carry no useful gradient).

Checks: every discount and trace decay (γ, λ in any form) must lie in [0, 1]; a NaN or an
out-of-range value given as a number or a concrete array raises `ValueError` naming the
argument. Traced values are checked only under `checkify` (see `marft_jax.ppo`); without
it the backup runs with the bad value (γ > 1 grows advantages geometrically, NaN spreads
to every earlier position). Values at masked positions are never read, so padding may hold
NaN or inf without reaching the advantages or their gradients; the one exception is the
padding of `turn_chain_advantages`' v_t past the positions its turns fill, which must be 0
when concrete (a value there is one its length_k does not count). v_bootstrap is a scalar
(one sequence: vmap for a batch); anything else is refused by name before the scan.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.ppo import chains
from marft_jax.ppo import credit as ppo_credit  # `credit` is turn_chain_advantages' mode
from marft_jax.ppo.masked import at_least_float32
from marft_jax.ppo._checks import check_range, check_unit_interval
from marft_jax.validation import (check_forward_pointers, check_rank, check_same_shape,
                                  is_traced)


def masked_gae(r_t: jax.Array, discount_t: jax.Array, lambda_t: jax.Array | float,
               v_t: jax.Array, mask_t: jax.Array, v_bootstrap: jax.Array | float) -> jax.Array:
  """Generalized advantage estimation over one sequence with transparent positions.

  Unmasked positions are states with values v_t. Masked positions (prompt, padding,
  transition tokens, empty actions) have no value and no advantage: their hops fold into
  the preceding state's. For a state p whose next state is q (every p < s < q masked):

      r_pq = r_p + γ_p r_{p+1} + γ_p γ_{p+1} r_{p+2} + … + (Π_{s<q-1} γ_s) r_{q-1}
      δ_p  = r_pq + (Π_{s=p}^{q-1} γ_s) v_q − v_p
      A_p  = δ_p + (Π_{s=p}^{q-1} γ_s λ_s) A_q

  After the last state v = v_bootstrap and A = 0. With no position masked this is plain
  truncated GAE, A_t = δ_t + γ_t λ_t A_{t+1} (Schulman et al. 2016), equal to
  `rlax.truncated_generalized_advantage_estimation(r_t, discount_t, lambda_t,
  concat([v_t, [v_bootstrap]]))`.

  Args:
    r_t: [T] reward on the hop t → t+1.
    discount_t: [T] discount on that hop; 0 ends the episode (no bootstrap, no trace).
    lambda_t: [T] or scalar, trace decay on that hop.
    v_t: [T] values, read only where mask_t is set.
    mask_t: [T] non-zero where position t is a state.
    v_bootstrap: scalar value of the state after position T−1.

  Returns:
    [T] advantages A_t, 0 at masked positions.

  Raises:
    ValueError: a concrete discount_t or lambda_t entry outside [0, 1] or NaN, or a
      v_bootstrap that is not a scalar (vmap for one per sequence).

  Example: a 3-step episode, reward 1 on its last hop, every value 0.5, γ = 1, λ = 0.5.
  δ = (0, 0, 0.5), so A₂ = 0.5, A₁ = 0 + 0.5 A₂, A₀ = 0 + 0.5 A₁; with position 1 masked,
  its hop folds into position 0's: A₀ = δ₀₂ + (γλ)² A₂ with δ₀₂ = r₀ + r₁ + v₂ − v₀ = 0.

    >>> r = jnp.array([0.0, 0.0, 1.0])
    >>> discount = jnp.array([1.0, 1.0, 0.0])  # 0: the episode ends after position 2
    >>> v = jnp.array([0.5, 0.5, 0.5])
    >>> print(masked_gae(r, discount, 0.5, v, jnp.ones(3), v_bootstrap=0.0))
    [0.125 0.25  0.5  ]
    >>> print(masked_gae(r, discount, 0.5, v, jnp.array([1, 0, 1]), v_bootstrap=0.0))
    [0.125 0.    0.5  ]
  """
  check_rank(1, r_t=r_t, discount_t=discount_t, v_t=v_t, mask_t=mask_t)
  check_rank(0, v_bootstrap=v_bootstrap)
  check_same_shape(r_t=r_t, discount_t=discount_t, v_t=v_t, mask_t=mask_t)
  check_unit_interval("discount_t", discount_t)
  check_unit_interval("lambda_t", lambda_t)
  return _gae(r_t, discount_t, lambda_t, v_t, mask_t, v_bootstrap)


def _gae(r_t, discount_t, lambda_t, v_t, mask_t, v_bootstrap) -> jax.Array:
  # `masked_gae` without the argument checks, for callers that built valid hops.
  v_t = at_least_float32(v_t)
  dtype = v_t.dtype
  is_state = jnp.asarray(mask_t) != 0
  # Select before arithmetic: a NaN value at a masked position must not reach the gradient.
  v_t = jnp.where(is_state, v_t, jnp.zeros((), dtype))
  xs = (jnp.asarray(r_t, dtype), jnp.asarray(discount_t, dtype),
        jnp.broadcast_to(jnp.asarray(lambda_t, dtype), r_t.shape), v_t, is_state)

  zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)
  init = (jnp.asarray(v_bootstrap, dtype), zero, zero, one, one)
  return _reverse_backup(init, xs)


def _backup(carry, x):
  v_next, adv_next, r_acc, g_acc, gl_acc = carry
  r, g, lam, v, is_state = x
  # Compose this hop with the pending hops through the transparent positions after it.
  r_acc, g_acc, gl_acc = r + g * r_acc, g * g_acc, g * lam * gl_acc
  adv = r_acc + g_acc * v_next - v + gl_acc * adv_next
  at_state = (v, adv, jnp.zeros_like(v), jnp.ones_like(v), jnp.ones_like(v))
  carry = jax.tree.map(lambda a, b: jnp.where(is_state, a, b), at_state,
                       (v_next, adv_next, r_acc, g_acc, gl_acc))
  return carry, jnp.where(is_state, adv, jnp.zeros_like(adv))


# Jitted so that eager callers (host-side advantage computation on NumPy episode records)
# compile the scan once per shape instead of on every call; inside an outer jit it inlines.
@jax.jit
def _reverse_backup(init, xs):
  return jax.lax.scan(_backup, init, xs, reverse=True)[1]


def successor_gae(r_t: jax.Array, discount_t: jax.Array, lambda_t: jax.Array,
                  v_t: jax.Array, mask_t: jax.Array, next_t: jax.Array,
                  v_bootstrap: jax.Array | float = 0.0) -> jax.Array:
  """GAE where position t's hop leads to position next_t[t] > t (T: past the end).

  For a state p whose hop leads, through transparent (masked) positions, to state q:

      δ_p = r_pq + Γ_pq v_q − v_p,    A_p = δ_p + (Γλ)_pq A_q

  with r_pq, Γ_pq and (Γλ)_pq composed along the pointer path exactly as in `masked_gae`
  (which is this function with next_t = t + 1). Past the end v = v_bootstrap and A = 0.
  Several positions may share a successor (parallel branches joining).

  Args:
    r_t, discount_t, lambda_t, v_t, mask_t: [T] as in `masked_gae`.
    next_t: [T] int, each entry in (t, T] (T: none).
    v_bootstrap: scalar value past the end.
  Returns:
    [T] advantages, 0 at masked positions.
  Raises:
    ValueError: a concrete discount_t or lambda_t entry outside [0, 1] or NaN, or a concrete
      next_t[t] outside (t, T], or a v_bootstrap that is not a scalar.

  Example: positions 0 and 1 are parallel branches, both hopping to position 2 (γ = 1,
  λ = 0.5): A₂ = 1 − 0.5, A₀ = (v₂ − v₀) + 0.5 A₂, A₁ = (v₂ − v₁) + 0.5 A₂.

    >>> r = jnp.array([0.0, 0.0, 1.0])
    >>> discount = jnp.array([1.0, 1.0, 0.0])
    >>> v = jnp.array([0.25, 0.5, 0.5])
    >>> next_t = jnp.array([2, 2, 3])  # 3: past the end
    >>> print(successor_gae(r, discount, 0.5, v, jnp.ones(3), next_t))
    [0.5  0.25 0.5 ]
  """
  check_rank(1, r_t=r_t, discount_t=discount_t, v_t=v_t, mask_t=mask_t, next_t=next_t)
  check_rank(0, v_bootstrap=v_bootstrap)
  check_same_shape(r_t=r_t, discount_t=discount_t, v_t=v_t, mask_t=mask_t, next_t=next_t)
  check_forward_pointers("next_t", next_t, r_t.shape[0])
  check_unit_interval("discount_t", discount_t)
  check_unit_interval("lambda_t", lambda_t)
  v_t = at_least_float32(v_t)
  dtype = v_t.dtype
  T = r_t.shape[0]
  is_state = jnp.asarray(mask_t) != 0
  v_t = jnp.where(is_state, v_t, jnp.zeros((), dtype))
  xs = (jnp.asarray(r_t, dtype), jnp.asarray(discount_t, dtype),
        jnp.broadcast_to(jnp.asarray(lambda_t, dtype), r_t.shape), v_t, is_state,
        jnp.asarray(next_t, jnp.int32), jnp.arange(T))
  # What a hop into each position (or past the end, at T) composes with: the carry of
  # `masked_gae`'s scan, one entry per position instead of one running value.
  zero, one = jnp.zeros((T + 1,), dtype), jnp.ones((T + 1,), dtype)
  table = (zero.at[T].set(jnp.asarray(v_bootstrap, dtype)), zero, zero, one, one)
  return _successor_backup(table, xs)


@jax.jit
def _successor_backup(table, xs):
  def step(table, x):
    *hop, successor, t = x
    carry, adv = _backup(tuple(column[successor] for column in table), tuple(hop))
    return tuple(column.at[t].set(c) for column, c in zip(table, carry)), adv
  return jax.lax.scan(step, table, xs, reverse=True)[1]


def _check_hops(**hops) -> None:
  for name, value in hops.items():
    check_unit_interval(name, value)


def _agent_hops(done_t: jax.Array, num_agents: int, gamma, lambda_, gamma_agent, lambda_agent,
                dtype) -> tuple[jax.Array, jax.Array]:
  """Discount and λ of the hop leaving each agent's action: [T, N] each.

  The turns of a regular team (N agents a step, one a layer) in `chains.turn_hops`' terms:
  agent i < N−1 hands over to agent i+1 of the same env step (γ_agent, λ_agent, never cut by
  the done flags: reference defect D4 in docs/references.md); the last agent hands over to
  agent 0 of step t+1 (γ, λ), cut when the episode ended at t.
  """
  T, N = done_t.shape[0], num_agents
  step_k = jnp.repeat(jnp.arange(T), N)
  valid_k = jnp.ones((T * N,), bool)
  sees_kk = chains.layer_sees(step_k, jnp.tile(jnp.arange(N), T), valid_k)
  next_k = chains.turn_successors(step_k, sees_kk, valid_k)
  discount, lambdas = chains.turn_hops(step_k, next_k, jnp.repeat(done_t, N), gamma, lambda_,
                                       gamma_agent, lambda_agent)
  return discount.reshape(T, N).astype(dtype), lambdas.reshape(T, N).astype(dtype)


def action_level_advantages(r_t: jax.Array, v_t: jax.Array, done_t: jax.Array,
                            v_bootstrap: jax.Array | float, gamma: float, lambda_: float,
                            gamma_agent: float | None = None,
                            lambda_agent: float | None = None) -> tuple[jax.Array, jax.Array]:
  """MARFT-A advantages: GAE chained over the agents of each step, then over steps.

  With (t, i) the i-th agent's decision at env step t and V[t, i] = V(s_t, a_t^{1:i-1}):

      i < N−1:  δ[t,i] = r[t,i] + γ_a V[t,i+1] − V[t,i]
                A[t,i] = δ[t,i] + γ_a λ_a A[t,i+1]
      i = N−1:  δ[t,i] = r[t,i] + γ (1−d_t) V[t+1,0] − V[t,i]
                A[t,i] = δ[t,i] + γ λ (1−d_t) A[t+1,0]
      R[t,i] = V[t,i] + A[t,i]

  V[T, 0] = v_bootstrap. The done flag d_t cuts the chain only between steps t and t+1;
  the original cut the agent chain at the first step of each new episode (reference defect
  D4, docs/references.md). The defaults γ_a = γ, λ_a = λ are the original's (one γ, one λ
  at every hop). With γ_a = λ_a = 1 the agents' deltas telescope,
  Σ_i δ[t,i] = Σ_i r[t,i] + γ V[t+1,0] − V[t,0] (the multi-agent advantage decomposition,
  MARFT Theorem 1; docs/references.md), and A[t,0] is the single-agent GAE of the joint
  action.

  Args:
    r_t: [T, N] reward after agent i's action at step t.
    v_t: [T, N] per-agent-position values.
    done_t: [T] non-zero if the episode ended after step t.
    v_bootstrap: scalar value of agent 0 at step T, computed on agent 0's prompt like every
      other V (the original scored the raw env string instead: reference defect D3,
      docs/references.md).
    gamma, lambda_: discount and trace decay across env steps.
    gamma_agent, lambda_agent: across agents of one step; default gamma, lambda_.

  Returns:
    (advantages, returns), both [T, N].

  Raises:
    ValueError: a concrete gamma, lambda_, gamma_agent or lambda_agent outside [0, 1] or NaN,
      or a v_bootstrap that is not a scalar.

  Example: two env steps of two agents, the team's reward 1 after the last action, every
  value 0.5, γ = 1, λ = 0.5: each earlier decision gets half its successor's advantage.

    >>> r = jnp.array([[0.0, 0.0], [0.0, 1.0]])  # [T=2, N=2]
    >>> v = jnp.full((2, 2), 0.5)
    >>> adv, ret = action_level_advantages(r, v, jnp.array([0, 1]), 0.0, gamma=1.0,
    ...                                    lambda_=0.5)
    >>> print(adv)
    [[0.0625 0.125 ]
     [0.25   0.5   ]]
    >>> print(ret)  # v + A
    [[0.5625 0.625 ]
     [0.75   1.    ]]
  """
  check_rank([2, 2, 1, 0], r_t=r_t, v_t=v_t, done_t=done_t, v_bootstrap=v_bootstrap)
  check_same_shape(r_t=r_t, v_t=v_t)
  check_same_shape(leading=1, r_t=r_t, done_t=done_t)
  _check_hops(gamma=gamma, lambda_=lambda_, gamma_agent=gamma_agent, lambda_agent=lambda_agent)
  gamma_agent = gamma if gamma_agent is None else gamma_agent
  lambda_agent = lambda_ if lambda_agent is None else lambda_agent
  # A regular team's turn chain (one agent a layer, N a step, one position a turn), its own
  # rewards per turn: the trainer's `turn_chain_advantages`, not a second copy of it.
  T, N = r_t.shape
  ones = jnp.ones((T * N,), jnp.int32)
  r = at_least_float32(r_t).reshape(-1)
  step_k = jnp.repeat(jnp.arange(T), N)
  adv, ret = turn_chain_advantages(
      step_k, chains.layer_sees(step_k, jnp.tile(jnp.arange(N), T), ones), ones, ones,
      jnp.zeros_like(r), r, jnp.repeat(jnp.asarray(done_t), N), jnp.asarray(v_t).reshape(-1),
      credit="per_step", gamma=gamma, lambda_=lambda_, gamma_agent=gamma_agent, lambda_agent=lambda_agent,
      v_bootstrap=v_bootstrap)
  return adv.reshape(T, N), ret.reshape(T, N)


def token_level_advantages(r_t: jax.Array, v_t: jax.Array, mask_t: jax.Array,
                           done_t: jax.Array, v_bootstrap: jax.Array | float, gamma: float,
                           lambda_: float, gamma_token: float | None = None,
                           lambda_token: float | None = None, gamma_agent: float | None = None,
                           lambda_agent: float | None = None) -> tuple[jax.Array, jax.Array]:
  """MARFT-T token-level Bellman backup over (env step, agent, token) positions.

  v[t,i,k] = V(x_i, w_{<k}) is the value of agent i's prompt plus its first k tokens. One
  reverse scan runs over the flattened positions; with K_i agent i's last valid token:

      k < K_i:          δ = γ_tok v[t,i,k+1] − v[t,i,k]                 (reward 0 inside an action)
      k = K_i, i < N−1: δ = r[t,i] + γ_a v[t,i+1,0] − v[t,i,k]          (next agent's first token)
      k = K_i, i = N−1: δ = r[t,i] + γ (1−d_t) v[t+1,0,0] − v[t,i,k]    (next env step)
      A = δ + γ_hop λ_hop A_next,    R = v + A

  "Next token" means the next valid one: padding, holes and empty actions (no valid token)
  are skipped exactly and hold A = R = 0, so no stale value survives in a pad slot
  (reference defect D6, docs/references.md).
  An empty action is still a turn: its reward and its agent hop are kept and fold into the
  previous valid token's hop. v[T,0,0] = v_bootstrap. The defaults (every γ, λ equal to
  `gamma`, `lambda_`) reproduce the original.

  Why γ_tok = λ_tok = 1 is usually better: tokens are not env time. With γ_tok = 0.99 a
  512-token reply scales its own terminal reward by 0.99^512 ≈ 0.006 and its trace by
  (γλ)^512 ≈ 1e-14 before reaching the first token, so early tokens learn almost only from
  bootstrapped values, and the discount alone favours short replies. With γ_tok = λ_tok = 1
  the within-action deltas telescope: A[t,i,0] equals the action-level advantage computed
  from the first-token values, and per-token credit only redistributes it within the reply.

  Args:
    r_t: [T, N] reward after agent i's action at step t.
    v_t: [T, N, K] token values; read only where mask_t is set.
    mask_t: [T, N, K] non-zero on the action's tokens.
    done_t: [T] non-zero if the episode ended after step t.
    v_bootstrap: scalar first-token value of agent 0 at step T, on agent 0's prompt (D3,
      docs/references.md).
    gamma, lambda_: across env steps (and the default for the other hops).
    gamma_token, lambda_token: between tokens of one action.
    gamma_agent, lambda_agent: from an agent's last token to the next agent's first.

  Returns:
    (advantages, returns), both [T, N, K], 0 where mask_t is 0.

  Raises:
    ValueError: a concrete γ or λ argument outside [0, 1] or NaN, or a v_bootstrap that is
      not a scalar.

  Example: one env step, agent 0 writes two tokens and agent 1 one (its second slot is
  padding), reward 1 after agent 1, every value 0.5, γ = 1, λ = 0.5 at every hop: the last
  token gets 1 − 0.5, each earlier one half its successor's.

    >>> r = jnp.array([[0.0, 1.0]])  # [T=1, N=2]
    >>> v = jnp.full((1, 2, 2), 0.5)  # [T, N, K=2]
    >>> mask = jnp.array([[[1, 1], [1, 0]]])
    >>> adv, ret = token_level_advantages(r, v, mask, jnp.array([1]), 0.0, gamma=1.0,
    ...                                   lambda_=0.5)
    >>> print(adv[0])
    [[0.125 0.25 ]
     [0.5   0.   ]]
  """
  check_rank([2, 3, 3, 1, 0], r_t=r_t, v_t=v_t, mask_t=mask_t, done_t=done_t,
             v_bootstrap=v_bootstrap)
  check_same_shape(v_t=v_t, mask_t=mask_t)
  check_same_shape(leading=2, r_t=r_t, v_t=v_t)
  check_same_shape(leading=1, r_t=r_t, done_t=done_t)
  _check_hops(gamma=gamma, lambda_=lambda_, gamma_token=gamma_token,
              lambda_token=lambda_token, gamma_agent=gamma_agent, lambda_agent=lambda_agent)
  gamma_token, gamma_agent = (gamma if g is None else g for g in (gamma_token, gamma_agent))
  lambda_token, lambda_agent = (lambda_ if x is None else x for x in (lambda_token, lambda_agent))
  valid = jnp.asarray(mask_t) != 0
  v_t = at_least_float32(v_t)
  dtype = v_t.dtype
  v_t = jnp.where(valid, v_t, jnp.zeros((), dtype))
  # A token hop happens where a valid token follows some earlier valid token of the action;
  # every other slot-to-slot step inside the padded action is an identity hop.
  token_hop = (jnp.cumsum(valid, axis=-1) > 0)[..., :-1] & valid[..., 1:]
  one = jnp.ones((), dtype)
  g_in = jnp.where(token_hop, jnp.asarray(gamma_token, dtype), one)
  l_in = jnp.where(token_hop, jnp.asarray(lambda_token, dtype), one)
  g_out, l_out = _agent_hops(done_t, r_t.shape[1], gamma, lambda_, gamma_agent, lambda_agent,
                             dtype)
  discount = jnp.concatenate([g_in, g_out[..., None]], axis=-1)
  lambdas = jnp.concatenate([l_in, l_out[..., None]], axis=-1)
  rewards = jnp.concatenate([jnp.zeros_like(g_in), jnp.asarray(r_t, dtype)[..., None]], axis=-1)
  adv = _gae(rewards.reshape(-1), discount.reshape(-1), lambdas.reshape(-1), v_t.reshape(-1),
             valid.reshape(-1), v_bootstrap).reshape(v_t.shape)
  return adv, jnp.where(valid, v_t + adv, jnp.zeros_like(adv))


def turn_chain_advantages(step_k: jax.Array, sees_kk: jax.Array, valid_k: jax.Array,
                          length_k: jax.Array, team_reward_k: jax.Array,
                          own_reward_k: jax.Array, done_k: jax.Array, v_t: jax.Array, *,
                          credit: str, gamma: float, lambda_: float,
                          gamma_agent: float | None = None, lambda_agent: float | None = None,
                          gamma_token: float = 1.0, lambda_token: float = 1.0,
                          credit_discount: float = 1.0,
                          kl_reward_t: jax.Array | None = None,
                          v_bootstrap: jax.Array | float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Advantages of one episode's turns, sequential, in a DAG or routed (what the trainer
  runs for MARFT-A, MARFT-T, single-agent and shared-stream PPO, and GRPO's returns).

  In order: `chains.turn_successors` (each turn's first descendant in execution order: the
  earliest later turn of its env step whose prompt contains its reply; a sink of the step
  hops to the next step's first turn), `chains.turn_hops` (γ_agent inside a step,
  γ·(1 − done) out of it), `credit.turn_credit` (on those successors: "equal" puts R on
  every sink), the per-position layout (`chains.expand_turns`: one position a turn at the
  action level, one per token at the token level: `length_k`), then `successor_gae`.
  Positions lie turn after turn: turn k's at [s_k, s_k + length_k[k]).

  With a chain's relation (`chains.layer_sees` with one turn a layer), regular N agents a
  step and every length 1 this is `action_level_advantages`; with token lengths,
  `token_level_advantages` (both tested against the original MARFT's vectors).

  Args:
    step_k, valid_k, length_k: [n] each turn's env step (non-decreasing), realness (a
      prefix) and number of positions (≥ 1 on real turns).
    sees_kk: [n, n] non-zero where turn j's prompt contains turn k's reply (k < j, same env
      step; `chains.layer_sees` for layers: a chain is one turn a layer).
    team_reward_k, own_reward_k: [n] the team's and the turn's own role's reward of its env
      step (`credit.turn_credit`).
    done_k: [n] the episode ended after the turn's env step.
    v_t: [W] values of the positions, in the layout above; W ≥ Σ length_k, and the
      padding past the last position 0 (a value there is one the turns do not count).
    credit, credit_discount: `credit.turn_credit`'s mode and γ_c (static).
    gamma … lambda_token: the hops' discounts and trace decays, in [0, 1].
    kl_reward_t: optional [W] rewards added at every position (KL-in-reward: on a token's
      position at the token level; summed over the reply at the action level by the caller).
    v_bootstrap: the value after the last turn when the episode did not end there (the
      trainer's episodes always end: 0).

  Returns:
    (advantages [W], returns [W]): 0 past the last position.
  Raises:
    ValueError: as the functions above; a v_bootstrap that is not a scalar; a kl_reward_t not
      of v_t's shape; or concrete v_t and length_k whose layout disagrees: v_t narrower than
      Σ length_k, or not 0 past it (a v_t of width 3 for two one-position turns).

  Example: `token_level_advantages`' example as a chain of two turns in env step 0 (turn 1
  sees turn 0), the team reward 1 on the step's last turn ("equal" credit): first one
  position a turn, then turn 0 at two positions (its tokens), in a v_t padded to width 4.

    >>> step = jnp.array([0, 0])
    >>> sees = chains.layer_sees(step, jnp.array([0, 1]), jnp.ones(2))  # turn 1 sees turn 0
    >>> team, own, done = jnp.ones(2), jnp.zeros(2), jnp.ones(2)
    >>> hops = dict(credit="equal", gamma=1.0, lambda_=0.5, lambda_token=0.5)
    >>> adv, ret = turn_chain_advantages(step, sees, jnp.ones(2), jnp.array([1, 1]), team, own,
    ...                                  done, jnp.array([0.5, 0.5]), **hops)
    >>> print(adv, ret)
    [0.25 0.5 ] [0.75 1.  ]
    >>> adv, _ = turn_chain_advantages(step, sees, jnp.ones(2), jnp.array([2, 1]), team, own,
    ...                                done, jnp.array([0.5, 0.5, 0.5, 0.0]), **hops)
    >>> print(adv)
    [0.125 0.25  0.5   0.   ]
  """
  check_rank(1, v_t=v_t, length_k=length_k)
  check_rank(0, v_bootstrap=v_bootstrap)
  if kl_reward_t is not None:
    check_same_shape(v_t=v_t, kl_reward_t=kl_reward_t)
  _check_layout(v_t, length_k)
  width = v_t.shape[0]
  next_k = chains.turn_successors(step_k, sees_kk, valid_k)
  discount_k, lambda_k = chains.turn_hops(step_k, next_k, done_k, gamma, lambda_, gamma_agent,
                                          lambda_agent)
  r_k = ppo_credit.turn_credit(team_reward_k, own_reward_k, step_k, next_k, valid_k, credit,
                               credit_discount)
  r_t, discount_t, lambda_t, next_t, mask_t, _ = chains.expand_turns(
      r_k, discount_k, lambda_k, next_k, length_k, width, gamma_token, lambda_token)
  if kl_reward_t is not None:
    r_t = r_t + jnp.where(mask_t, kl_reward_t, 0.0)
  adv = successor_gae(r_t, discount_t, lambda_t, v_t, mask_t, next_t, v_bootstrap)
  v_t = jnp.asarray(v_t, adv.dtype)
  return adv, jnp.where(mask_t, v_t + adv, jnp.zeros_like(adv))


def _check_layout(v_t, length_k) -> None:
  """Refuses concrete values that the turns' layout would silently drop or miss.

  Padding is what makes widths static (the trainer vmaps over episodes of bucketed width),
  so a wider v_t is not an error in itself; a non-zero value past the turns' positions is
  one the caller counted and the backup never reads: a length_k that misses a turn's tokens,
  or one position a turn for a v_t of token values.
  """
  if is_traced(v_t, length_k):
    return
  check_range("length_k", length_k, 0)
  filled, width = int(np.sum(length_k)), v_t.shape[0]
  if filled > width:
    raise ValueError(f"v_t: width {width} holds fewer positions than the {filled} that "
                     f"length_k fills")
  padding = np.asarray(v_t)[filled:]
  if np.any(padding != 0):
    t = filled + int(np.argmax(padding != 0))
    raise ValueError(f"v_t[{t}]={np.asarray(v_t)[t].item()!r}: past the {filled} positions "
                     f"that length_k fills, where v_t is padding and must be 0 (width {width})")

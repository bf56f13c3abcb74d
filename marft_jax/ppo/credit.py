"""Credit: which frame a reward or a value lives in, and where each turn's reward lands.

Frames. An episode record stores per-token arrays (token frame): `tokens[j]`,
`loss_mask[j]` = 1 on generated tokens, `agent_ids[j]` = the agent that generated token j
(−1 on prompt and transition tokens). The loss and the values live in the action frame,
where position t is the decision that emits token t+1 (the logits at t predict token t+1).
`token_to_action_frame` converts. A turn's reward belongs to the decision that emits its last
token; the AReaL code writes it one position later, on a transition position with loss mask 0
that its GAE loop then drops (note A1 in docs/references.md).

Turn credit. The trainer's backup (`returns.turn_chain_advantages`) gives every turn one
reward, from its env step's team reward R or from its own role's reward, by `turn_credit`'s
rule (`CREDITS`), on the successor pointers the backup runs along (`chains.turn_successors`).
Inside an env step each turn's path of hops runs from descendant to descendant and ends at
one sink (a turn that no later turn of the step sees, whose hop leaves the step):

  equal          R at every sink of the step, 0 elsewhere: each turn's path collects R once.
  step_discount  R·γ_c^h on every turn, h the hops along its own path to its sink (0 at a
                 sink). Where every path crosses every layer (a chain, a diamond) this is
                 γ_c^(L−1−ℓ) for layer ℓ of L; in a>b, a>c, b>d, h is 2, 1, 0, 0 for
                 a, b, c, d.
  per_step       each turn its own role's reward (an orchestrator's turns: 0). A turn's
                 return collects the rewards of the turns on its path: a fork's predecessor
                 those of the branch it hops to, not its sibling's.

In a chain or a diamond the one sink is the step's last turn, as with the earlier rule by
layers. `chains.expand_turns` puts the reward on the turn's last position.

Checks: an unknown credit, or a concrete γ_c outside [0, 1] or NaN, raises `ValueError`
naming the argument. A traced γ_c is checked only under `checkify` (see `marft_jax.ppo`);
without it the rewards are scaled by the bad factor's powers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.ppo import chains
from marft_jax.ppo._checks import check_unit_interval
from marft_jax.validation import check_forward_pointers, check_rank, check_same_shape

CREDITS = ("equal", "step_discount", "per_step")


def token_to_action_frame(x_t: jax.Array, fill) -> jax.Array:
  """out[t] = x[t+1] for t < T−1 and out[T−1] = fill: token frame → action frame.

  Unlike AReaL's `roll(x, −1)`, nothing wraps around from the start of the sequence.

  Args:
    x_t: [T] per-token array (loss mask, step ids, behaviour log-probs, versions).
    fill: value for the last position, which emits no token (0, −1, …).
  Returns:
    [T] array in x's dtype.

  Example: a loss mask on the two generated tokens 1 and 2 moves to the decisions that
  emit them, positions 0 and 1.

    >>> print(token_to_action_frame(jnp.array([0, 1, 1, 0]), fill=0))
    [1 1 0 0]
  """
  check_rank(1, x_t=x_t)
  x_t = jnp.asarray(x_t)
  return jnp.concatenate([x_t[1:], jnp.full((1,), fill, x_t.dtype)])


def turn_credit(team_reward_k: jax.Array, own_reward_k: jax.Array, step_k: jax.Array,
                next_k: jax.Array, valid_k: jax.Array, credit: str,
                gamma_c: float = 1.0) -> jax.Array:
  """[n] reward of each turn, from its env step's team reward or its own role's reward.

  A turn is a sink of its env step when its successor is not in the step (no later turn of
  the step sees its reply); h_k counts the hops from turn k along next_k to its sink:

      equal          R on every sink, 0 elsewhere (a chain's last turn; each of several
                     sinks, e.g. parallel last branches: each path's return is the team's
                     outcome). The critic and GAE share R out along the path.
      step_discount  R · γ_c^h_k on every turn (γ_c = 0.5, a chain of three: R/4, R/2, R).
      per_step       each turn its own role's reward r_i (an orchestrator's turns: 0).

  Args:
    team_reward_k: [n] the team reward R of the turn's env step.
    own_reward_k: [n] the reward of the turn's own role for that step.
    step_k: [n] env step of each turn.
    next_k: [n] successor of each turn (`chains.turn_successors`), n where none.
    valid_k: [n] non-zero on real turns; padding gets 0.
    credit: one of `CREDITS` (static).
    gamma_c: the step_discount factor in [0, 1].
  Raises:
    ValueError: an unknown credit, gamma_c outside [0, 1], or a concrete next_k[k] outside
      (k, n].

  Example: a chain of three turns in one env step, team reward 1 (the turns' own rewards
  2, 3, 4).

    >>> team, own = jnp.ones(3), jnp.array([2.0, 3.0, 4.0])
    >>> step, next_k, valid = jnp.zeros(3, int), jnp.array([1, 2, 3]), jnp.ones(3)
    >>> print(turn_credit(team, own, step, next_k, valid, "equal"))
    [0. 0. 1.]
    >>> print(turn_credit(team, own, step, next_k, valid, "step_discount", gamma_c=0.5))
    [0.25 0.5  1.  ]
    >>> print(turn_credit(team, own, step, next_k, valid, "per_step"))
    [2. 3. 4.]
  """
  check_rank(1, team_reward_k=team_reward_k, own_reward_k=own_reward_k, step_k=step_k,
             next_k=next_k, valid_k=valid_k)
  check_same_shape(team_reward_k=team_reward_k, own_reward_k=own_reward_k, step_k=step_k,
                   next_k=next_k, valid_k=valid_k)
  if credit not in CREDITS:
    raise ValueError(f"credit={credit!r}: use one of {CREDITS}")
  check_unit_interval("gamma_c", gamma_c)
  check_forward_pointers("next_k", next_k, step_k.shape[0])
  valid = jnp.asarray(valid_k) != 0
  hops = chains.hops_to_sink(step_k, next_k)
  team = jnp.asarray(team_reward_k, jnp.float32)
  if credit == "equal":
    reward = jnp.where(hops == 0, team, 0.0)
  elif credit == "step_discount":
    reward = team * jnp.power(jnp.float32(gamma_c), hops.astype(jnp.float32))
  else:
    reward = jnp.asarray(own_reward_k, jnp.float32)
  return jnp.where(valid, reward, 0.0)


"""Credit assignment: where each agent's reward lands in one multi-agent token sequence.

Frames. An episode record stores per-token arrays (token frame): `tokens[j]`,
`loss_mask[j]` = 1 on generated tokens, `step_ids[j]` = the agent step that generated
token j (−1 on prompt and transition tokens). The loss, the values and the advantages
live in the action frame, where position t is the decision that emits token t+1 (the
logits at t predict token t+1). `token_to_action_frame` converts, and every other
function here takes action-frame step ids.

A step's reward belongs to the decision that emits its last token: action-frame
position e_i − 2 when step i's tokens end (exclusively) at e_i. The AReaL code writes it
at e_i − 1, a transition position with loss mask 0, and its GAE loop then drops it
(note A1 in docs/references.md); `credit_strategy` then changes nothing but the logs.

Step ids count agent turns in execution order (0 … S−1), so one role may own several
steps; in a plain sequential chain they equal the agent ids. A negative id (−1) marks a
position with no decision. A step's positions must be contiguous in the sequence. A step
that emitted no token has no decision to credit.

Checks: a concrete step id ≥ S (the number of steps) or a concrete γ_c outside [0, 1]
raises `ValueError` naming the argument. Traced values are checked only under `checkify`
(see `marft_jax.ppo`); what a bad traced value does is in each docstring.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from marft_jax.validation import check_ids, check_unit_interval


def token_to_action_frame(x_t: jax.Array, fill) -> jax.Array:
  """out[t] = x[t+1] for t < T−1 and out[T−1] = fill: token frame → action frame.

  Unlike AReaL's `roll(x, −1)`, nothing wraps around from the start of the sequence.

  Args:
    x_t: [T] per-token array (loss mask, step ids, behaviour log-probs, versions).
    fill: value for the last position, which emits no token (0, −1, …).
  Returns:
    [T] array in x's dtype.
  """
  chex.assert_rank(x_t, 1)
  x_t = jnp.asarray(x_t)
  return jnp.concatenate([x_t[1:], jnp.full((1,), fill, x_t.dtype)])


def step_ends(step_ids_t: jax.Array) -> jax.Array:
  """[T] bool, True at each step's last decision: step_ids_t ≥ 0 and step_ids_{t+1} ≠ step_ids_t."""
  chex.assert_rank(step_ids_t, 1)
  step_ids_t = jnp.asarray(step_ids_t)
  next_ids = jnp.concatenate([step_ids_t[1:], jnp.full((1,), -1, step_ids_t.dtype)])
  return (step_ids_t >= 0) & (next_ids != step_ids_t)


def equal_credit(reward: jax.Array | float, step_ids_t: jax.Array) -> jax.Array:
  """`equal`: the team reward R at the last decision of the sequence, 0 elsewhere.

  Agents share R through the critic and GAE; credit across agents is the backup's job.

  Args:
    reward: scalar team reward R.
    step_ids_t: [T] action-frame step ids, −1 where no decision.
  Returns:
    [T] per-position rewards.
  """
  chex.assert_rank(step_ids_t, 1)
  is_decision = jnp.asarray(step_ids_t) >= 0
  decisions_from_here = jnp.cumsum(is_decision[::-1])[::-1]
  is_last = is_decision & (decisions_from_here == 1)
  reward = jnp.asarray(reward, jnp.float32)
  return jnp.where(is_last, reward, jnp.zeros_like(reward))


def step_discount_credit(reward: jax.Array | float, step_ids_t: jax.Array,
                         num_steps: jax.Array | int, gamma_c: float) -> jax.Array:
  """`step_discount`: R·γ_c^(S−1−i) at the last decision of every step i.

  Earlier agents get less of the team reward (γ_c = 0.5 with three steps gives 0.25, 0.5, 1).

  Args:
    reward: scalar team reward R.
    step_ids_t: [T] action-frame step ids in [0, S), −1 where no decision.
    num_steps: S, the number of steps in the episode.
    gamma_c: credit discount in [0, 1].
  Returns:
    [T] per-position rewards.
  Raises:
    ValueError: a concrete step id ≥ num_steps, or gamma_c outside [0, 1] or NaN. Under
      jit an id ≥ S is not caught: its step gets R·γ_c^(S−1−i) with a negative exponent,
      more than the team reward.
  """
  chex.assert_rank(step_ids_t, 1)
  check_unit_interval("gamma_c", gamma_c)
  check_ids("step_ids_t", step_ids_t, num_steps, skip_negative=True)
  steps_to_go = (num_steps - 1 - step_ids_t).astype(jnp.float32)
  discount = jnp.power(jnp.asarray(gamma_c, jnp.float32), steps_to_go)
  credit = jnp.asarray(reward, jnp.float32) * discount
  return jnp.where(step_ends(step_ids_t), credit, jnp.zeros_like(credit))


def per_step_credit(step_rewards_s: jax.Array, step_ids_t: jax.Array) -> jax.Array:
  """`per_step`: each step's own reward r_i at its last decision.

  Args:
    step_rewards_s: [S] reward of step i (from the role's reward function).
    step_ids_t: [T] action-frame step ids in [0, S) or −1 where no decision.
  Returns:
    [T] per-position rewards.
  Raises:
    ValueError: a concrete step id ≥ S. Under jit such an id is not caught: it is clipped
      to S − 1 and its step is credited with the last step's reward.
  """
  chex.assert_rank([step_rewards_s, step_ids_t], 1)
  check_ids("step_ids_t", step_ids_t, step_rewards_s.shape[0], skip_negative=True)
  ids = jnp.clip(jnp.asarray(step_ids_t), 0, step_rewards_s.shape[0] - 1)
  credit = jnp.asarray(step_rewards_s)[ids]
  return jnp.where(step_ends(step_ids_t), credit, jnp.zeros_like(credit))

"""Reward and advantage shaping: affine transform and clip, then masked normalisation.

Normalisation pools only the elements a mask marks as genuine. The original excluded
exact zeros (reference defect D7, docs/references.md), which drops genuine zero
rewards/advantages from the
statistics and then normalises the padding; here the mask decides, genuine zeros count,
and masked elements come back as 0 without touching the statistics.

Pools:
- `normalize`: one pool over the whole array (AReaL `batch`; the original's per-minibatch
  advantage whitening).
- `agent_group_normalize`: one pool per (group, agent), a group being e.g. the G rollouts
  of one prompt (GRPO), with an optional leave-one-out mean (RLOO). Each role is normalised
  against its own rollouts of the same prompt, so a planner's rewards are not measured
  against a verifier's (the agent-wise GRPO normalisation AReaL issue #1114 asks for; note
  A3 in docs/references.md). With num_agents = 1 it is plain per-group normalisation.

Arrays may have any shape (sequence rewards [B], per-token rewards [B, T], …); ids and
masks have the same shape as the data. Masked elements never reach the arithmetic, so
padding may hold NaN or inf, and the gradient is finite even for a pool of one element.

Checks: a concrete group or agent id outside its range on a valid element, eps ≤ 0, NaN
or inf, or a non-finite scale, bias or clip raise `ValueError` naming the argument.
Traced ids are checked only under `checkify` (see `marft_jax.ppo`); without it an
out-of-range id is silently wrong: `segment_sum` drops the element from every pool, and
the gather then reads another pool's statistics (negative ids wrap to the last pools,
ids ≥ the pool count clamp to the last one).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from marft_jax.ppo.masked import at_least_float32
from marft_jax.ppo._checks import check_positive, check_range
from marft_jax.validation import check_ids, check_same_shape, check_size


def shape_rewards(r: jax.Array, scale: float = 1.0, bias: float = 0.0,
                  clip: float | None = None) -> jax.Array:
  """r' = clip((r + bias) · scale, −clip, clip), elementwise (AReaL's order).

  Raises:
    ValueError: a concrete scale or bias that is NaN or inf, or clip ≤ 0 or NaN (a clip of
      0 would zero every reward; +inf means no clip).

  Example: (r + 1) · 0.5 = (−1, 0.75, 2), clipped to [−1, 1].

    >>> print(shape_rewards(jnp.array([-3.0, 0.5, 3.0]), scale=0.5, bias=1.0, clip=1.0))
    [-1.    0.75  1.  ]
  """
  check_range("scale", scale, -math.inf, math.inf, low_open=True, high_open=True)
  check_range("bias", bias, -math.inf, math.inf, low_open=True, high_open=True)
  check_range("clip", clip, 0.0, math.inf, low_open=True)
  r = (at_least_float32(r) + bias) * scale
  return r if clip is None else jnp.clip(r, -clip, clip)


def _pool_normalize(x, mask, group_ids, num_groups, center, scale, leave_one_out, unbiased,
                    eps):
  # `normalize` and `agent_group_normalize` without the argument checks: one pool per id.
  x = at_least_float32(x)
  valid = (jnp.asarray(mask) != 0).reshape(-1)
  ids = jnp.where(valid, jnp.asarray(group_ids).reshape(-1), 0)
  xs = jnp.where(valid, x.reshape(-1), jnp.zeros((), x.dtype))
  segment_sum = functools.partial(jax.ops.segment_sum, segment_ids=ids, num_segments=num_groups)
  count = segment_sum(valid.astype(x.dtype))
  mean = segment_sum(xs) / jnp.maximum(count, 1.0)
  sq_dev = jnp.where(valid, (xs - mean[ids]) ** 2, jnp.zeros_like(xs))
  var = segment_sum(sq_dev) / jnp.maximum(count - float(unbiased), 1.0)
  # sqrt'(0) = inf: a pool of one element (or of equal ones) would get a NaN gradient.
  positive = var > 0
  std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
  out = xs
  if center:
    out = xs - _baseline(xs, mean[ids], count[ids], leave_one_out)
  if scale:
    out = out / (std[ids] + eps)
  return jnp.where(valid, out, jnp.zeros_like(out)).reshape(x.shape)


def _baseline(xs: jax.Array, mean: jax.Array, count: jax.Array, leave_one_out: bool):
  if not leave_one_out:
    return mean
  others = (count * mean - xs) / jnp.maximum(count - 1.0, 1.0)
  return jnp.where(count > 1, others, xs)


def normalize(x: jax.Array, mask: jax.Array, *, center: bool = True, scale: bool = True,
              unbiased: bool = False, eps: float = 1e-5) -> jax.Array:
  """x' = (x − μ) / (σ + eps) with μ, σ over all valid elements; 0 where mask is 0.

  The original whitened advantages with eps 1e-8 (per minibatch); AReaL uses eps 1e-5
  and the unbiased std. See `agent_group_normalize` for the formulas (one pool here).

  Raises:
    ValueError: eps not > 0 (or NaN, inf) when concrete.

  Example: μ = 2 and σ = 1 over the two valid elements; the padding's 100 is not counted.

    >>> x, mask = jnp.array([1.0, 3.0, 100.0]), jnp.array([1, 1, 0])
    >>> import numpy as np  # rounded on the host: the digits are the same on every CPU
    >>> print(np.asarray(normalize(x, mask)).round(3))
    [-1.  1.  0.]
  """
  check_same_shape(x=x, mask=mask)
  check_positive("eps", eps)
  return _pool_normalize(x, mask, jnp.zeros(jnp.shape(x), jnp.int32), 1, center, scale, False,
                         unbiased, eps)


def agent_group_normalize(x: jax.Array, mask: jax.Array, group_ids: jax.Array,
                          agent_ids: jax.Array, num_groups: int, num_agents: int, *,
                          center: bool = True, scale: bool = True, leave_one_out: bool = False,
                          unbiased: bool = False, eps: float = 1e-5) -> jax.Array:
  """x' = (x − b_p) / (σ_p + eps) within each pool p = (group, agent), over its valid elements.

      n_p = Σ_{j∈p} m_j,   μ_p = Σ_{j∈p} m_j x_j / n_p
      σ_p² = Σ_{j∈p} m_j (x_j − μ_p)² / (n_p − u)
      b_p = μ_p,  or with leave_one_out  b_{p,i} = (n_p μ_p − x_i) / (n_p − 1)

  with pool id = group · A + agent and u = 1 if unbiased else 0. A pool with one valid
  element has no leave-one-out baseline and is centred to 0, as with the plain mean.
  center=False skips b; scale=False skips σ (Dr. GRPO). num_agents = 1 (agent_ids all 0)
  pools by group alone (GRPO, RLOO).

  Args:
    x, mask: any shape; mask non-zero on genuine elements. group_ids, agent_ids: same
      shape; group_ids in [0, num_groups), agent_ids in [0, num_agents) on valid elements
      (−1 on prompt tokens is fine where mask is 0).
    num_groups, num_agents: static sizes.
    eps: added to σ, finite and > 0.
  Returns:
    normalised x, 0 where mask is 0.
  Raises:
    ValueError: a concrete group id outside [0, num_groups) or agent id outside
      [0, num_agents) where mask is set (not caught under jit: an agent id out of range
      moves the element into a neighbouring group's pool), a size not an int ≥ 1, or eps
      not > 0.

  Example: one group (a prompt's rollouts) of two agents, alternating: each agent's pool
  is its own two rewards, (1, 3) and (10, 20), so each is normalised to (−1, 1) however far
  apart the agents' scales are. Leave-one-out, centred only: each minus the other's reward.

    >>> x, mask = jnp.array([1.0, 10.0, 3.0, 20.0]), jnp.ones(4)
    >>> group, agent = jnp.zeros(4, int), jnp.array([0, 1, 0, 1])
    >>> import numpy as np
    >>> print(np.asarray(agent_group_normalize(x, mask, group, agent, 1, 2)).round(3))
    [-1. -1.  1.  1.]
    >>> print(agent_group_normalize(x, mask, group, agent, 1, 2, scale=False,
    ...                             leave_one_out=True))
    [ -2. -10.   2.  10.]
  """
  check_same_shape(x=x, mask=mask, group_ids=group_ids, agent_ids=agent_ids)
  num_groups = check_size("num_groups", num_groups)
  num_agents = check_size("num_agents", num_agents)
  check_positive("eps", eps)
  check_ids("group_ids", group_ids, num_groups, where=mask)
  check_ids("agent_ids", agent_ids, num_agents, where=mask)
  pool_ids = group_ids * num_agents + agent_ids
  return _pool_normalize(x, mask, pool_ids, num_groups * num_agents, center, scale,
                         leave_one_out, unbiased, eps)

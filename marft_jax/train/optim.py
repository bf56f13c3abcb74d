"""Optimizers for stacked per-agent adapters: per-agent clipping and per-agent freezing.

All agents' adapters live in one `Adapters` tree stacked on the A axis and share one optax
optimizer, so two things must be done per agent rather than over the whole tree:

* Clipping. Each agent's gradient is clipped to `max_norm` on its own (the original MARFT
  clips each agent's parameters separately): one agent's large gradient never shrinks
  another's step.
* Freezing. An agent that had no tokens in the minibatch, or that the agent-by-agent
  schedule freezes, must not move: AdamW would still decay its weights and advance its
  moments. `lora.where_adapters` keeps its weights and optimizer moments.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from marft_jax.lora.routing import Adapters
from marft_jax.lora.training import where_adapters


def per_agent_norms(grads: Adapters) -> jax.Array:
  """[A] the global L2 norm of each agent's gradient (leaves [L, A, ...])."""
  squares = [jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(i for i in range(g.ndim)
                                                                    if i != 1))
             for g in jax.tree.leaves(grads.layers)]
  return jnp.sqrt(sum(squares))


def clip_per_agent(grads: Adapters, max_norm: float) -> tuple[Adapters, jax.Array]:
  """Each agent's gradient scaled to norm ≤ `max_norm`; returns it and the [A] norms before."""
  norms = per_agent_norms(grads)
  scale = jnp.minimum(1.0, max_norm / jnp.maximum(norms, 1e-12))
  shape = lambda g: scale.reshape((1, -1) + (1,) * (g.ndim - 2)).astype(g.dtype)
  return grads.replace(layers=jax.tree.map(lambda g: g * shape(g), grads.layers)), norms


def learning_rate(peak: float, warmup_steps: int, total_steps: int,
                  decay: str = "cosine", final_fraction: float = 0.1) -> optax.Schedule:
  """Linear warm-up to `peak`, then cosine or linear decay to `final_fraction`·peak, or
  constant (`decay="constant"`)."""
  warmup = optax.linear_schedule(0.0 if warmup_steps else peak, peak, max(warmup_steps, 1))
  rest = max(total_steps - warmup_steps, 1)
  if decay == "constant":
    after = optax.constant_schedule(peak)
  elif decay == "linear":
    after = optax.linear_schedule(peak, peak * final_fraction, rest)
  elif decay == "cosine":
    after = optax.cosine_decay_schedule(peak, rest, alpha=final_fraction)
  else:
    raise ValueError(f"decay={decay!r}: use 'cosine', 'linear' or 'constant'")
  return optax.join_schedules([warmup, after], [warmup_steps])


def apply_masked(optimizer: optax.GradientTransformation, grads: Adapters, opt_state: Any,
                 params: Adapters, active: jax.Array) -> tuple[Adapters, Any]:
  """One optimizer step on the agents in `active` ([A] bool); the others keep their weights
  and their optimizer moments exactly (the step counter is shared)."""
  updates, new_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  return where_adapters(active, new_params, params), where_adapters(active, new_state, opt_state)

"""Gradients that touch adapters only, and per-agent selection of updates.

The base parameters are an argument of the loss that is never differentiated: `jax.grad`
builds cotangents only for the trainable tree, so no base-sized gradient or optimizer state
exists. Typical use inside a jitted update::

    def loss_fn(trainable, base, batch, rng):
      lora = trainable["lora"].with_dropout(rng)
      logits, _ = forward(base, batch.tokens, config, lora=lora, adapter_ids=batch.adapter_ids)
      return policy_loss(logits, batch)

    loss, grads = trainable_value_and_grad(loss_fn)({"lora": adapters}, base, batch, rng)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)   # opt_state: adapters only
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from marft_jax.lora.routing import Adapters


def trainable_value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False
                             ) -> Callable[..., Any]:
  """`loss_fn(trainable, frozen, *args)` -> `fn(trainable, frozen, *args) -> (value, grads)`.

  `grads` mirrors `trainable` (adapters, later also critic leaves). `frozen` goes through
  `stop_gradient`, so even an outer transformation (a second `grad`, `jvp`) never
  differentiates the base.
  """
  grad_fn = jax.value_and_grad(loss_fn, argnums=0, has_aux=has_aux)

  def value_and_grad(trainable, frozen, *args):
    return grad_fn(trainable, jax.lax.stop_gradient(frozen), *args)

  return value_and_grad


def where_adapters(take_new: jax.Array, new: Any, old: Any) -> Any:
  """Per adapter i: `new` where `take_new[i]`, else `old`, in every `Adapters` node.

  Works on two matching trees of adapters or of optimizer states (optax keeps its moments as
  `Adapters` trees). With a one-hot `take_new` only one agent moves, as in MARFT's agent-by-agent
  schedule: the others keep their weights and their optimizer moments. Leaves outside
  `Adapters` nodes (e.g. Adam's step count) come from `new`.

  Args:
    take_new: [A] bool.
  """
  take_new = jnp.asarray(take_new, bool)

  def pick(n, o):
    if not isinstance(n, Adapters):
      return n
    if take_new.shape != (n.num_adapters,):  # a [1] mask would broadcast over every adapter
      raise ValueError(f"take_new: shape {take_new.shape}, expected ({n.num_adapters},): one "
                       f"flag per adapter")
    select = lambda x, y: jnp.where(take_new[None, :, None, None], x, y)
    return n.replace(layers=jax.tree.map(select, n.layers, o.layers))

  return jax.tree.map(pick, new, old, is_leaf=lambda x: isinstance(x, Adapters))

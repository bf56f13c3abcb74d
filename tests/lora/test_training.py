"""Gradients reach adapters only: none for the base, none for agents whose tokens are not in
the loss, and per-agent selection of optimizer updates."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
import optax

from marft_jax import lora
from tests.lora.conftest import IDS, TOKENS, nll, nll_value_and_grad, random_adapters


def _dot_output_shapes(jaxpr):
  """Shapes of every dot_general output in a jaxpr and its sub-jaxprs (scan bodies, pjit)."""
  shapes = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes |= _dot_output_shapes(sub)
  return shapes


def test_no_gradient_or_optimizer_state_for_base_params(params):
  adapters = random_adapters(3)
  mask = (IDS >= 0).astype(jnp.float32)
  _, grads = nll_value_and_grad(adapters, params, TOKENS, IDS, mask)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  # Weight gradients are the only dots whose output has a base weight's shape.
  base_shapes = {tuple(x.shape[-2:]) for x in jax.tree.leaves(params) if x.ndim >= 2}
  ours = jax.make_jaxpr(lora.trainable_value_and_grad(nll))(adapters, params, TOKENS, IDS, mask)
  assert not _dot_output_shapes(ours.jaxpr) & base_shapes
  full = jax.make_jaxpr(jax.grad(nll, argnums=1))(adapters, params, TOKENS, IDS, mask)
  assert _dot_output_shapes(full.jaxpr) & base_shapes  # The probe does see weight gradients.
  opt_state = optax.adam(1e-2).init(adapters)
  sizes = [x.size for x in jax.tree.leaves(opt_state)]
  assert sum(sizes) == 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 1  # mu, nu, count


@jax.jit
def _adam_step(adapters, grads):
  opt = optax.adam(1e-2)
  state = opt.init(adapters)
  updates, new_state = opt.update(grads, state, adapters)
  return optax.apply_updates(adapters, updates), state, new_state


def _per_adapter_changed(new, old):
  """[A] bool: does any factor of adapter i differ?"""
  diff = jax.tree.map(lambda x, y: np.asarray(x != y).any(axis=(0, 2, 3)), new.layers, old.layers)
  return np.any(np.stack(jax.tree.leaves(diff)), axis=0)


def test_step_on_agent_0_tokens_changes_only_agent_0(params):
  adapters = random_adapters(3)
  base_before = jax.tree.map(np.array, params)
  _, grads = nll_value_and_grad(adapters, params, TOKENS, IDS, (IDS == 0).astype(jnp.float32))
  stepped, _, _ = _adam_step(adapters, grads)
  np.testing.assert_array_equal(_per_adapter_changed(stepped, adapters), [True, False, False])
  jax.tree.map(np.testing.assert_array_equal, params, base_before)


def test_later_agent_loss_reaches_earlier_agent_through_context_and_where_adapters(params):
  # Agent 1 attends to agent 0's tokens, whose keys and values adapter 0 produced: the exact
  # gradient of agent 1's log-probs moves adapter 0 too. An agent-by-agent schedule keeps the
  # other agents (weights and optimizer moments) with `where_adapters`.
  adapters = random_adapters(3)
  _, grads = nll_value_and_grad(adapters, params, TOKENS, IDS, (IDS == 1).astype(jnp.float32))
  stepped, state, new_state = _adam_step(adapters, grads)
  np.testing.assert_array_equal(_per_adapter_changed(stepped, adapters), [True, True, False])
  only_1 = jnp.asarray([False, True, False])
  kept = lora.where_adapters(only_1, stepped, adapters)
  np.testing.assert_array_equal(_per_adapter_changed(kept, adapters), [False, True, False])
  kept_state = lora.where_adapters(only_1, new_state, state)
  mu, mu_before = kept_state[0].mu, state[0].mu
  np.testing.assert_array_equal(_per_adapter_changed(mu, mu_before), [False, True, False])
  for flags in ([True], [False, True]):  # [1] would broadcast over all 3; [2] is short
    with pytest.raises(ValueError, match=r"take_new: shape \(\d,\), expected \(3,\)"):
      lora.where_adapters(jnp.asarray(flags), stepped, adapters)

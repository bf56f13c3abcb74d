"""Adapter factors are split like their base kernels; a sharded routed training step on 8
virtual devices equals the single-device one."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from marft_jax import lora, sharding
from tests.lora.conftest import IDS, TOKENS, nll, nll_value_and_grad, random_adapters

def test_specs_follow_the_base_kernel_axes(params):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  specs = jax.tree.map(lambda s: s.spec, lora.adapter_shardings(mesh, random_adapters(3)))
  assert specs.layers["q_proj"] == {"a": P(None, None, "fsdp", None),
                                    "b": P(None, None, None, "tensor")}
  assert specs.layers["down_proj"] == {"a": P(None, None, "tensor", None),
                                       "b": P(None, None, None, "fsdp")}
  base = sharding.param_shardings(mesh, params)["layers"]
  for name, spec in specs.layers.items():
    kernel = base[name]["kernel"].spec  # [L, in, out]
    assert (spec["a"][2], spec["b"][3]) == (kernel[1], kernel[2])


def test_sharded_routed_gradients_equal_single_device(params):
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  adapters = random_adapters(3)
  mask = jnp.ones(IDS.shape)
  loss, grads = nll_value_and_grad(adapters, params, TOKENS, IDS, mask)
  adapter_sh = lora.adapter_shardings(mesh, adapters)
  batch = sharding.batch_sharding(mesh, 2)
  sharded_step = jax.jit(lora.trainable_value_and_grad(nll),
                         in_shardings=(adapter_sh, sharding.param_shardings(mesh, params),
                                       batch, batch, batch),
                         out_shardings=(sharding.replicated(mesh), adapter_sh))
  placed = jax.device_put(adapters, adapter_sh)
  sharded_loss, sharded_grads = sharded_step(placed, params, TOKENS, IDS, mask)
  assert placed.layers["gate_proj"]["b"].sharding.spec == P(None, None, None, "tensor")
  assert sharded_grads.layers["o_proj"]["a"].sharding.spec == P(None, None, "tensor", None)
  np.testing.assert_allclose(sharded_loss, loss, atol=1e-5, rtol=0)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0),
               sharded_grads, grads)


def test_grouped_routing_moves_no_activations_between_batch_shards(params):
  # 8 rows of 256 tokens sort in blocks of 4 rows (1024 tokens); with the rows split over 2
  # devices each block lives on one, so the only collectives are the gradient all-reduces.
  tokens = jnp.zeros((8, 256), jnp.int32)
  ids = jnp.asarray(np.repeat(np.random.default_rng(1).integers(-1, 3, (8, 4)), 64, axis=1))
  adapters = random_adapters(3)
  mesh = sharding.make_mesh(data=2)
  batch = sharding.batch_sharding(mesh, 2)
  step = jax.jit(lora.trainable_value_and_grad(nll),
                 in_shardings=(lora.adapter_shardings(mesh, adapters),
                               sharding.param_shardings(mesh, params), batch, batch, batch))
  hlo = step.lower(adapters, params, tokens, ids, jnp.ones(ids.shape)).compile().as_text()
  collectives = re.findall(r"= (.*?) (?:all-reduce|all-gather|all-to-all|collective-permute)"
                           r"(?:-start)?\(", hlo)
  sizes = [np.prod([int(d) for d in dims.split(",") if d])
           for result in collectives for dims in re.findall(r"\w+\[([\d,]*)\]", result)]
  assert collectives and max(sizes) <= max(x.size for x in jax.tree.leaves(adapters))

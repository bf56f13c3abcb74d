"""The memory model against the bytes that the tiny model's arrays actually occupy on each of 8
virtual devices, placed by the library's own sharding rules."""

import jax
import optax
import pytest

from marft_jax import lora, memory, sharding
from marft_jax.models import config as config_lib
from marft_jax.models import transformer
from marft_jax.train import critic as critic_lib


def _bytes_per_device(tree, mesh):
  """The largest total of shard bytes that any one device holds (scalar leaves left out)."""
  per_device = {d: 0 for d in mesh.devices.flat}
  for leaf in jax.tree.leaves(tree):
    if leaf.ndim:
      for shard in leaf.addressable_shards:
        per_device[shard.device] += shard.data.nbytes
  return max(per_device.values())


@pytest.mark.parametrize("architecture,shape", [
    ("qwen2", dict(data=2, fsdp=2, tensor=2)),  # untied head, biases
    ("llama", dict(fsdp=4, tensor=2)),
    ("qwen2", dict(data=8)),
    ("llama", dict(tensor=8)),  # 2 kv heads on 8: the cache's heads stay whole
], ids=["qwen2_2x2x2", "llama_fsdp4_tensor2", "qwen2_data8", "llama_tensor8"])
def test_the_model_matches_the_allocated_arrays(architecture, shape):
  config = config_lib.tiny_config(architecture, vocab_size=384, param_dtype="bfloat16")
  mesh = sharding.make_mesh(**shape)
  lora_config = lora.LoraConfig(rank=4, alpha=8.0, targets="q_proj|v_proj|down_proj")
  num_adapters, rows, slots = 3, 16, 48
  params = transformer.init_params(config, jax.random.key(0))
  params = jax.device_put(params, sharding.param_shardings(mesh, params))
  adapters = lora.init_adapters(lora_config, config, jax.random.key(1), num_adapters)
  adapters = jax.device_put(adapters, lora.adapter_shardings(mesh, adapters))
  critic = critic_lib.init_critic(critic_lib.CriticConfig(mode="shared", hidden=(32, 16)),
                                  config, num_adapters, jax.random.key(2))
  critic = jax.device_put(critic, sharding.replicated(mesh))
  optimizer = optax.adamw(1e-3)
  opt_state = optimizer.init(adapters), optax.adam(1e-3).init(critic)
  opt_state = jax.device_put(opt_state, lora.follow_adapters(mesh, opt_state))
  cache = transformer.init_cache(config, batch=rows, size=slots)
  cache = jax.device_put(cache, sharding.shardings_for(mesh, cache,
                                                       sharding.cache_logical_axes(cache)))

  model = memory.per_device_bytes(
      config, **shape, lora_rank=4, lora_targets=lora_config.target_names(),
      num_adapters=num_adapters, critic_hidden=(32, 16), kv_rows=rows, kv_slots=slots)
  actual = {"params": _bytes_per_device(params, mesh),
            "adapters": _bytes_per_device(adapters, mesh),
            "optimizer": _bytes_per_device(opt_state, mesh),
            "critic": _bytes_per_device(critic, mesh),
            "kv_cache": _bytes_per_device(cache, mesh)}
  assert {k: model[k] for k in actual} == actual
  assert model["total"] == sum(actual.values())

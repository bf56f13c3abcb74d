"""The memory model against the bytes that the tiny model's arrays actually occupy on each of 8
virtual devices, placed by the library's own sharding rules."""

import dataclasses
import itertools

import jax
import optax
import pytest

from marft_jax import lora, memory, sharding
from marft_jax.models import config as config_lib
from marft_jax.models import tiny, transformer
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train import config as train_config
from marft_jax.train import critic as critic_lib


def _bytes_per_device(tree, mesh):
  """The largest total of shard bytes that any one device holds (scalar leaves left out)."""
  per_device = {d: 0 for d in mesh.devices.flat}
  for leaf in jax.tree.leaves(tree):
    if leaf.ndim:
      for shard in leaf.addressable_shards:
        per_device[shard.device] += shard.data.nbytes
  return max(per_device.values())


@pytest.mark.parametrize("architecture,shape,rollout_layout", [
    ("qwen2", dict(data=2, fsdp=2, tensor=2), "auto"),  # untied head, biases
    ("llama", dict(fsdp=4, tensor=2), "decoding"),
    ("qwen2", dict(data=8), "training"),  # the sampler reads the learner's weights
    ("llama", dict(tensor=8), "auto"),  # 2 kv heads on 8: the cache's heads stay whole
], ids=["qwen2_2x2x2", "llama_fsdp4_tensor2", "qwen2_data8", "llama_tensor8"])
def test_the_model_matches_the_allocated_arrays(architecture, shape, rollout_layout):
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

  # The sampler's weights as the trainer makes them (`run_lib.build`), from the placed base.
  run_config = dataclasses.replace(train_config.TrainConfig(), model=train_config.ModelSection(
      rollout_layout=rollout_layout))
  with jax.set_mesh(mesh):
    sampler_params, _ = model_lib.rollout_model(
        model_lib.Model(params, config, tiny.tiny_tokenizer(384)), run_config)
  copied = sampler_params is not params

  model = memory.per_device_bytes(
      config, **shape, lora_rank=4, lora_targets=lora_config.target_names(),
      num_adapters=num_adapters, critic_hidden=(32, 16), kv_rows=rows, kv_slots=slots,
      sampler_copy=rollout_layout != "training")
  assert copied == (rollout_layout != "training")
  actual = {"params": _bytes_per_device(params, mesh),
            "adapters": _bytes_per_device(adapters, mesh),
            "optimizer": _bytes_per_device(opt_state, mesh),
            "critic": _bytes_per_device(critic, mesh),
            "kv_cache": _bytes_per_device(cache, mesh),
            "sampler_params": _bytes_per_device(sampler_params, mesh) if copied else 0}
  assert {k: model[k] for k in actual} == actual
  assert model["total"] == sum(actual.values())


def test_the_7b_table_in_docs_is_what_the_model_says():
  """docs/scaling.md's Qwen2.5-7B table, recomputed from `per_device_bytes` (so that a change
  of the model shows up in the table users size their meshes by)."""
  import pathlib  # noqa: PLC0415

  from marft_jax.models.targets import LINEAR_TARGETS  # noqa: PLC0415
  qwen7b = config_lib.ModelConfig(
      architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
      num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, qkv_bias=True,
      tie_word_embeddings=False, param_dtype="bfloat16", compute_dtype="bfloat16")
  text = (pathlib.Path(__file__).parents[1] / "docs" / "scaling.md").read_text()
  header = "| mesh (data, fsdp, tensor) |"
  lines = text[text.index(header):].splitlines()
  columns = [c.strip() for c in lines[0].strip("|").split("|")][1:]
  keys = {"params": "params", "adapters": "adapters", "optimizer": "optimizer",
          "critic": "critic", "KV cache": "kv_cache", "sampler's copy": "sampler_params",
          "total": "total"}
  assert columns == list(keys)
  rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[2:]))
  assert len(rows) >= 5
  for line in rows:
    cells = [c.strip() for c in line.strip("|").split("|")]
    data, fsdp, tensor = (int(x) for x in cells[0].split(","))
    model = memory.per_device_bytes(
        qwen7b, data=data, fsdp=fsdp, tensor=tensor, lora_rank=16,
        lora_targets=LINEAR_TARGETS, num_adapters=4, critic_hidden=(1024, 512), kv_rows=64,
        kv_slots=2048)
    assert cells[1:] == [f"{model[keys[c]] / 2**30:.2f}" for c in columns], line

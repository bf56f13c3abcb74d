"""Sharded forward on 8 virtual CPU devices equals the single-device forward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from marft_jax import sharding
from marft_jax.models import config as config_lib
from marft_jax.models import transformer

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs


@pytest.fixture(scope="module")
def model():
  config = config_lib.tiny_config("qwen2", vocab_size=128, num_kv_heads=2)
  return config, transformer.init_params(config, jax.random.key(0))


def test_make_mesh_uses_auto_axes_and_checks_device_count():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh(data=4, fsdp=2, tensor=2)


def test_make_mesh_fills_one_axis_with_minus_one_and_refuses_bad_sizes():
  """Before: -1 sliced devices[:-1] into a 7-device mesh, 0 made an empty one, 2.0 failed in
  a slice with a TypeError."""
  assert dict(sharding.make_mesh(data=-1).shape) == {"data": 8, "fsdp": 1, "tensor": 1}
  assert dict(sharding.make_mesh(data=-1, fsdp=2).shape) == {"data": 4, "fsdp": 2, "tensor": 1}
  for size in (0, 2.0, -2):
    with pytest.raises(ValueError, match=re.escape(f"mesh.data={size!r}: use a size >= 1")):
      sharding.make_mesh(data=size)


def test_partition_rules_cover_every_parameter(model):
  config, params = model
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(mesh, params))
  assert specs["embed"] == P("tensor", "fsdp")
  assert specs["layers"]["q_proj"]["kernel"] == P(None, "fsdp", "tensor")
  assert specs["layers"]["q_proj"]["bias"] == P(None, "tensor")
  assert specs["layers"]["down_proj"]["kernel"] == P(None, "tensor", "fsdp")
  assert specs["layers"]["input_norm"] == P(None, None)
  assert specs["lm_head"] == P("fsdp", "tensor")
  # A dimension the mesh does not divide stays replicated instead of failing.
  odd = {"layers": {"k_proj": {"kernel": jnp.zeros((2, 64, 3 * 16))}}}
  mesh3 = sharding.make_mesh(tensor=4)
  spec = sharding.param_shardings(mesh3, odd)["layers"]["k_proj"]["kernel"].spec
  assert spec == P(None, "fsdp", "tensor")  # 48 % 4 == 0
  odd = {"layers": {"k_proj": {"kernel": jnp.zeros((2, 64, 3 * 15))}}}
  assert sharding.param_shardings(mesh3, odd)["layers"]["k_proj"]["kernel"].spec == P(None, "fsdp", None)


@pytest.mark.parametrize("mesh_shape", [dict(data=2, fsdp=2, tensor=2), dict(fsdp=8),
                                        dict(data=4, tensor=2)])
def test_sharded_forward_equals_single_device(model, mesh_shape):
  config, params = model
  mesh = sharding.make_mesh(**mesh_shape)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 128, (8, 10)))
  mask = jnp.asarray(rng.random((8, 10)) > 0.2).at[:, -1].set(True)
  fwd = lambda p, t, m: transformer.forward(p, t, config, mask=m)[0]
  expected = jax.jit(fwd)(params, tokens, mask)
  p_shard = sharding.param_shardings(mesh, params)
  batch = sharding.batch_sharding(mesh, 2)
  sharded_fwd = jax.jit(fwd, in_shardings=(p_shard, batch, batch),
                        out_shardings=sharding.batch_sharding(mesh, 3))
  got = sharded_fwd(jax.device_put(params, p_shard), jax.device_put(tokens, batch),
                    jax.device_put(mask, batch))
  assert len(got.sharding.device_set) == mesh.size
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=0)


def test_sharded_sampler_equals_single_device(model):
  """Greedy and temperature-1 sampling with params and KV cache split over a 2x2x2 mesh."""
  from marft_jax.models import sampler
  config, params = model
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = jax.device_put(params, sharding.param_shardings(mesh, params))
  rng = np.random.default_rng(1)
  prompts = rng.integers(1, 128, (8, 12))
  lens = rng.integers(3, 13, 8)
  def sharded_cache():  # rows over (data, fsdp), kv heads over tensor
    cache = transformer.init_cache(config, batch=8, size=32)
    return jax.device_put(cache, sharding.shardings_for(
        mesh, cache, sharding.cache_logical_axes(cache)))

  for temperature in (0.0, 1.0):
    kwargs = dict(rng=jax.random.key(3), max_new_tokens=10, prompt_lens=lens,
                  temperature=temperature)
    ref = sampler.generate(params, prompts, config, **kwargs)
    got = sampler.generate(sharded, prompts, config, cache=sharded_cache(), **kwargs)
    assert len(got.cache.k.sharding.device_set) == mesh.size
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.mask, ref.mask)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-5)

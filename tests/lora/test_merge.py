"""Merging an adapter into the base equals routing through it; unmerging restores the base."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import lora
from marft_jax.models import transformer
from tests.lora.conftest import CONFIG, random_adapters

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 10)))


@jax.jit
def _forward(params, lora_, ids):
  return transformer.forward(params, TOKENS, CONFIG, lora=lora_, adapter_ids=ids)[0]


def test_merged_forward_equals_routed_and_unmerge_restores(params):
  adapters = random_adapters(3, targets="q_proj|v_proj|o_proj|down_proj")
  merged = lora.merge_adapter(params, adapters, index=2)
  routed = _forward(params, adapters, jnp.full((2,), 2, jnp.int32))
  plain = _forward(merged, None, jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(np.asarray(plain), np.asarray(routed), atol=1e-5, rtol=0)
  restored = lora.unmerge_adapter(merged, adapters, index=2)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0), restored, params)
  # Only target kernels move; every other leaf is the very same array.
  assert restored["embed"] is params["embed"]
  assert restored["layers"]["k_proj"] is params["layers"]["k_proj"]


def test_kernel_delta_is_scale_a_b():
  adapters = random_adapters(2, targets="up_proj")
  w = adapters.layers["up_proj"]
  expected = adapters.scale * np.einsum("lir,lro->lio", w["a"][:, 1], w["b"][:, 1])
  np.testing.assert_allclose(lora.adapter_kernel_deltas(adapters, 1)["up_proj"], expected,
                             atol=1e-6)


@pytest.mark.parametrize("index", [3, -1, 1.0, True])
def test_an_index_that_would_merge_another_adapter_is_refused(params, index):
  """JAX clamps an index of 3 to adapter 2 and wraps -1 to it, which elsewhere means "no
  adapter": each is refused by name instead."""
  adapters = random_adapters(3, targets="q_proj")
  for fn in (lora.merge_adapter, lora.unmerge_adapter):
    with pytest.raises(ValueError, match=re.escape(f"index={index!r}: use an int in [0, 3)")):
      fn(params, adapters, index=index)


def test_merge_in_every_layout_equals_the_training_layout_merge(params):
  """An unrolled or feature-major tree gets each layer's slice of the delta, transposed as its
  kernels are: converting the training-layout merge gives the same tree."""
  from marft_jax.models import layout
  adapters = random_adapters(2, targets="q_proj|up_proj|down_proj")
  expected = lora.merge_adapter(params, adapters, index=1)
  for dst in (layout.DECODING, layout.Layout(scan_layers=False, feature_major=False),
              layout.Layout(scan_layers=True, feature_major=True)):
    moved = layout.convert_params(params, layout.TRAINING, dst)
    merged = lora.merge_adapter(moved, adapters, index=1, layout=dst)
    back = layout.convert_params(merged, dst, layout.TRAINING)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=0), back,
                 expected)
    restored = lora.unmerge_adapter(merged, adapters, index=1, layout=dst)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=0), restored,
                 moved)


@pytest.mark.parametrize("lay, layers, message", [
    ("training", 1, "adapters: q_proj's update has shape (1, 64, 64) but the kernel (2, 64, 64)"),
    ("decoding", 1, "adapters: q_proj has 1 layers but the params hold 2"),
    ("decoding", 3, "adapters: q_proj has 3 layers but the params hold 2"),
])
def test_adapters_of_another_model_are_refused(params, lay, layers, message):
  """Before: a 1-layer update broadcast over both stacked layers; unrolled, layer 1 took the
  clamped delta[1] of a 1-layer set, and a 3-layer set lost its last layer, all silently."""
  from marft_jax.models import layout
  chosen = {"training": layout.TRAINING, "decoding": layout.DECODING}[lay]
  adapters = random_adapters(1, targets="q_proj",
                             model_config=CONFIG.replace(num_layers=layers))
  tree = layout.convert_params(params, layout.TRAINING, chosen)
  for fn in (lora.merge_adapter, lora.unmerge_adapter):
    with pytest.raises(ValueError, match=re.escape(message)):
      fn(tree, adapters, index=0, layout=chosen)

"""LoraConfig validation, PEFT-style initialisation, stacking, and import order."""

import re

import jax
import numpy as np
import pytest

from marft_jax import lora
from marft_jax.models import targets
from tests.lora.conftest import CONFIG, random_adapters


def test_targets_all_linear_names_and_patterns():
  assert lora.LoraConfig().target_names() == targets.LINEAR_TARGETS
  assert lora.LoraConfig(targets=["v_proj", "q_proj"]).target_names() == ("q_proj", "v_proj")
  assert lora.LoraConfig(targets="q_proj|v_proj").target_names() == ("q_proj", "v_proj")
  assert lora.LoraConfig(targets=".*(up|down)_proj").target_names() == ("up_proj", "down_proj")
  hash(lora.LoraConfig(targets=["q_proj"]))  # A list is stored as a tuple: jit-static.


@pytest.mark.parametrize("kwargs,match", [
    (dict(targets=["qproj"]), r"targets=\('qproj',\): unknown \['qproj'\]"),
    (dict(targets="lm_head"), "matches none"),
    (dict(rank=0), "rank=0"),
    (dict(alpha=-1.0), "alpha=-1.0"),
    (dict(dropout_rate=1.0), "dropout_rate=1.0"),
])
def test_config_errors_name_the_key(kwargs, match):
  with pytest.raises(ValueError, match=match):
    lora.LoraConfig(**kwargs)


def test_scale_plain_and_rslora():
  assert lora.LoraConfig(rank=16, alpha=32.0).scale == 2.0
  assert lora.LoraConfig(rank=16, alpha=32.0, use_rslora=True).scale == 8.0


def test_init_is_peft_kaiming_uniform_with_zero_b_and_deterministic():
  config = lora.LoraConfig(rank=8, alpha=16.0, targets="q_proj|down_proj", dropout_rate=0.1)
  adapters = lora.init_adapters(config, CONFIG, jax.random.key(0), num_adapters=3)
  again = lora.init_adapters(config, CONFIG, jax.random.key(0), num_adapters=3)
  jax.tree.map(np.testing.assert_array_equal, adapters, again)
  assert (adapters.scale, adapters.dropout_rate, adapters.num_adapters) == (2.0, 0.1, 3)
  assert sorted(adapters.layers) == ["down_proj", "q_proj"]
  for name, (d_in, d_out) in [("q_proj", (64, 64)), ("down_proj", (128, 64))]:
    a, b = np.asarray(adapters.layers[name]["a"]), np.asarray(adapters.layers[name]["b"])
    assert a.shape == (2, 3, d_in, 8) and b.shape == (2, 3, 8, d_out)
    assert a.dtype == np.float32 and not b.any()
    bound = 1.0 / np.sqrt(d_in)  # kaiming_uniform_(a=√5) on lora_A [R, D_in].
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound
    np.testing.assert_allclose(a.std(), bound / np.sqrt(3.0), rtol=0.05)
    assert not np.allclose(a[:, 0], a[:, 1])  # Adapters start different.


@pytest.mark.parametrize("args, message", [
    ((CONFIG, lora.LoraConfig()), "init_adapters: lora_config must be a LoraConfig, got "
                                  "ModelConfig"),
    ((lora.LoraConfig(), CONFIG, jax.random.key(0), 0), "num_adapters=0: must be a positive int"),
    ((lora.LoraConfig(), CONFIG, jax.random.key(0), -1), "num_adapters=-1: must be a positive int"),
    ((lora.LoraConfig(), CONFIG, jax.random.key(0), 2.5), "num_adapters=2.5: must be a positive"),
])
def test_init_refuses_bad_arguments_by_name(args, message):
  """Before: swapped configs raised AttributeError from deep in the shape table, -1 an MLIR
  error, 2.5 a JAX shape error, and 0 made an empty set."""
  if len(args) == 2:
    args = (*args, jax.random.key(0))
  with pytest.raises(ValueError, match=re.escape(message)):
    lora.init_adapters(*args)


def test_stacking_nothing_is_refused():
  with pytest.raises(ValueError, match="stack_adapters: no adapter sets given"):
    lora.stack_adapters([])


def test_stack_and_select_round_trip():
  adapters = random_adapters(3)
  parts = [lora.select_adapter(adapters, i) for i in range(3)]
  assert parts[1].num_adapters == 1 and parts[1].scale == adapters.scale
  jax.tree.map(np.testing.assert_array_equal, lora.stack_adapters(parts), adapters)
  with pytest.raises(ValueError, match="only identical configs stack"):
    lora.stack_adapters([parts[0], random_adapters(1, targets="q_proj")])
  for index in (3, -1, 1.0):
    with pytest.raises(ValueError, match=re.escape(f"index={index!r}: use an int in [0, 3)")):
      lora.select_adapter(adapters, index)

"""PEFT format: our adapters load in Hugging Face PEFT and PEFT's load in marft_jax, with the
same logits (≤ 1e-4), on tiny transformers checkpoints."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from marft_jax import lora
from marft_jax.models import hf_checkpoint, transformer
from tests.lora.conftest import random_adapters
from tests.models.hf_fixtures import save_tiny_model

TOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 160, (2, 9))


_forward = jax.jit(transformer.forward, static_argnums=2)


def _logits(params, config, lora_, ids):
  return _forward(params, jnp.asarray(TOKENS), config, lora=lora_, adapter_ids=ids)[0]


def _torch_logits(model):
  import torch
  with torch.no_grad():
    return model(input_ids=torch.tensor(TOKENS)).logits.numpy()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  model = save_tiny_model(path, "llama")
  params, config = hf_checkpoint.load_hf_checkpoint(str(path))
  return model, params, config


def test_our_adapters_load_in_peft_with_equal_logits(llama, tmp_path):
  from peft import PeftModel
  model, params, config = llama
  adapters = random_adapters(2, rank=4, model_config=config)
  paths = lora.save_peft_adapters(str(tmp_path), adapters, ["planner", "coder"], "tiny-llama")
  assert sorted(os.listdir(paths[0])) == ["adapter_config.json", "adapter_model.safetensors"]
  with safe_open(os.path.join(paths[1], "adapter_model.safetensors"), "numpy") as f:
    assert f.metadata() == {"format": "pt"}
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    np.testing.assert_array_equal(f.get_tensor(key), adapters.layers["down_proj"]["a"][1, 1].T)
    assert f.get_tensor(key.replace("lora_A", "lora_B")).shape == (64, 4)  # [out, r]
    assert len(f.keys()) == 7 * 2 * 2
  peft_model = PeftModel.from_pretrained(model, paths[0], adapter_name="planner")
  peft_model.load_adapter(paths[1], adapter_name="coder")
  for i, name in enumerate(["planner", "coder"]):
    peft_model.set_adapter(name)
    ours = _logits(params, config, adapters, jnp.full((2,), i, jnp.int32))
    np.testing.assert_allclose(np.asarray(ours), _torch_logits(peft_model), atol=TOL, rtol=0)
  assert not np.allclose(_logits(params, config, None, jnp.zeros((2,), jnp.int32)), ours, atol=1e-2)


def test_peft_created_adapter_loads_in_marft_jax(tmp_path):
  import peft
  model = save_tiny_model(tmp_path / "qwen2", "qwen2")  # Fresh: PEFT wraps models in place.
  params, config = hf_checkpoint.load_hf_checkpoint(str(tmp_path / "qwen2"))
  peft_config = peft.LoraConfig(r=4, lora_alpha=6, use_rslora=True, layers_to_transform=[1],
                                target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                                init_lora_weights=False, task_type="CAUSAL_LM")
  peft_model = peft.get_peft_model(model, peft_config).eval()  # Random A and B.
  peft_model.save_pretrained(str(tmp_path / "adapter"))
  adapters = lora.load_peft_adapter(str(tmp_path / "adapter"), config)
  assert sorted(adapters.layers) == ["down_proj", "q_proj", "up_proj", "v_proj"]
  assert adapters.scale == pytest.approx(6 / 2.0)  # rsLoRA: alpha / sqrt(r).
  assert not np.asarray(adapters.layers["q_proj"]["b"][0]).any()  # Layer 0 not transformed.
  ours = _logits(params, config, adapters, jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(np.asarray(ours), _torch_logits(peft_model), atol=TOL, rtol=0)
  base = _logits(params, config, None, jnp.zeros((2,), jnp.int32))
  assert not np.allclose(ours, base, atol=1e-2)


def test_round_trip_and_load_errors_name_the_file(llama, tmp_path):
  _, _, config = llama
  adapters = random_adapters(2, rank=2, targets="k_proj|o_proj", model_config=config)
  paths = lora.save_peft_adapters(str(tmp_path), adapters, ["a", "b"])
  jax.tree.map(np.testing.assert_array_equal, lora.load_peft_adapters(paths, config), adapters)
  config_file = os.path.join(paths[0], "adapter_config.json")
  saved = json.load(open(config_file))
  assert (saved["r"], saved["lora_alpha"], saved["target_modules"]) == (2, 4.0,
                                                                       ["k_proj", "o_proj"])
  json.dump(dict(saved, use_dora=True), open(config_file, "w"))
  with pytest.raises(ValueError, match=r"adapter_config\.json: use_dora=True"):
    lora.load_peft_adapter(paths[0], config)
  wrong_rank = dict(saved, r=3)
  json.dump(wrong_rank, open(config_file, "w"))
  with pytest.raises(ValueError, match=r"safetensors: tensor .*layers\.0\.self_attn\.k_proj"
                                       r"\.lora_A\.weight' has shape \(2, 64\)"):
    lora.load_peft_adapter(paths[0], config)
  with pytest.raises(ValueError, match="layer the model"):
    lora.load_peft_adapter(paths[0], config.replace(num_layers=1))


def test_lora_gradients_equal_peft(tmp_path):
  """The adapters' gradient of a weighted log-likelihood, one batch mixing two adapters by
  row, against PEFT's torch autograd with each adapter active on its own rows."""
  import torch
  from peft import PeftModel
  model = save_tiny_model(tmp_path / "llama", "llama", seed=1)  # fresh: PEFT wraps in place
  params, config = hf_checkpoint.load_hf_checkpoint(str(tmp_path / "llama"))
  adapters = random_adapters(2, rank=4, model_config=config, seed=1)
  names = ["first", "second"]
  paths = lora.save_peft_adapters(str(tmp_path / "adapters"), adapters, names, "tiny-llama")
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, config.vocab_size, (4, 12))
  ids = np.array([0, 1, 1, 0])
  weight = rng.normal(size=(4, 11)).astype(np.float32)

  def loss(adapters):
    logits, _ = transformer.forward(params, jnp.asarray(tokens), config, lora=adapters,
                                    adapter_ids=jnp.asarray(ids))
    logp = jax.nn.log_softmax(logits[:, :-1])
    return jnp.sum(weight * jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0])

  ours = jax.jit(jax.grad(loss))(adapters).layers
  peft_model = PeftModel.from_pretrained(model, paths[0], adapter_name=names[0],
                                         is_trainable=True)
  peft_model.load_adapter(paths[1], adapter_name=names[1], is_trainable=True)
  checked = 0
  for i, name in enumerate(names):
    peft_model.set_adapter(name)
    rows = ids == i
    logits = peft_model(input_ids=torch.tensor(tokens[rows])).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[rows, 1:, None]))[..., 0]
    peft_model.zero_grad()
    (torch.tensor(weight[rows]) * logp).sum().backward()
    for path, p in peft_model.named_parameters():
      if f".{name}." not in path:
        continue
      layer = int(path.split(".layers.")[1].split(".")[0])
      target = path.split(".lora_")[0].rsplit(".", 1)[1]
      factor = "a" if ".lora_A." in path else "b"
      ref = p.grad.numpy().T  # torch [out, in] -> ours [in, out]
      got = np.asarray(ours[target][factor][layer, i])
      np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max(), err_msg=path)
      assert np.abs(ref).max() > 1e-3, path
      checked += 1
  assert checked == 2 * 2 * 7 * config.num_layers

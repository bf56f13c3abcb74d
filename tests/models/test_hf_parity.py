"""Logits of our decoder against transformers' torch model on tiny random checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from marft_jax.models import hf_checkpoint, transformer
from tests.models.hf_fixtures import save_tiny_model

TOL = 1e-4


def _torch_logits(model, tokens, mask):
  with torch.no_grad():
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(positions))
  return out.logits.numpy()


@pytest.mark.parametrize("architecture,overrides", [
    ("llama", {}),
    ("qwen2", {}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
])
def test_logits_match_transformers_with_left_padding(tmp_path, architecture, overrides):
  model = save_tiny_model(tmp_path, architecture, **overrides)
  params, config = hf_checkpoint.load_hf_checkpoint(str(tmp_path))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 160, size=(3, 12))
  mask = np.ones((3, 12), np.int64)
  mask[1, :5] = 0  # left padding
  mask[2, :1] = 0
  ours, _ = jax.jit(transformer.forward, static_argnums=2)(
      params, jnp.asarray(tokens), config, mask=jnp.asarray(mask, bool))
  ref = _torch_logits(model, tokens, mask)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(ours)[valid], ref[valid], atol=TOL, rtol=0)


def test_missing_tensor_error_names_file_and_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  save_tiny_model(tmp_path, "llama")
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"model\.safetensors: 1 tensor\(s\) the config needs are "
                                       r"missing: 'model\.layers\.1\.mlp\.up_proj\.weight'$"):
    hf_checkpoint.load_hf_checkpoint(str(tmp_path))


def test_shape_mismatch_and_bad_architecture_errors(tmp_path):
  import json
  save_tiny_model(tmp_path, "llama")
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 100
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape"):
    hf_checkpoint.load_hf_checkpoint(str(tmp_path))
  cfg["model_type"] = "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"config\.json.*gpt2.*not supported"):
    hf_checkpoint.load_hf_checkpoint(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_checkpoint.load_hf_checkpoint(str(tmp_path / "nowhere"))

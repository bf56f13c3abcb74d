"""Loading Hugging Face checkpoints (`config.json` + `*.safetensors`) without torch.

The mapping between Hugging Face tensor names and our parameter tree lives here only; the
GGUF loader and the PEFT adapter export reuse it.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from marft_jax.models.config import ModelConfig
from marft_jax.models.transformer import LINEAR_TARGETS, Params, linear_shapes

# Our target name -> the module path inside a Hugging Face decoder layer.
HF_LAYER_MODULES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
HF_LAYER_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}


def hf_module_path(target: str, layer: int) -> str:
  """`("q_proj", 3)` -> `"model.layers.3.self_attn.q_proj"`."""
  return f"model.layers.{layer}.{HF_LAYER_MODULES[target]}"


def params_from_hf_tensors(config: ModelConfig, get: Callable[[str], np.ndarray],
                           source: str) -> Params:
  """Builds our parameter tree from Hugging Face tensors (torch layout, `[out, in]`).

  Args:
    config: the model config the tensors must match.
    get: name -> array; raises KeyError for a missing tensor.
    source: file or folder named in errors.
  Raises:
    ValueError naming `source` and the tensor when one is missing or has the wrong shape.
  """
  dtype = jnp.dtype(config.param_dtype)

  def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
      array = np.asarray(get(name))
    except KeyError:
      raise ValueError(f"{source}: tensor {name!r} is missing") from None
    if array.shape != shape:
      raise ValueError(f"{source}: tensor {name!r} has shape {array.shape}, "
                       f"the config implies {shape}")
    return array.astype(np.float32)

  def stacked(fn) -> jnp.ndarray:
    return jnp.asarray(np.stack([fn(i) for i in range(config.num_layers)]), dtype)

  D, V = config.hidden_size, config.vocab_size
  layers = {ours: stacked(lambda i, hf=hf: tensor(f"model.layers.{i}.{hf}.weight", (D,)))
            for ours, hf in HF_LAYER_NORMS.items()}
  for target, (fan_in, fan_out) in linear_shapes(config).items():
    prefix = lambda i, t=target: hf_module_path(t, i)
    layers[target] = {"kernel": stacked(
        lambda i, p=prefix, o=fan_out, n=fan_in: tensor(f"{p(i)}.weight", (o, n)).T)}
    if config.qkv_bias and target in ("q_proj", "k_proj", "v_proj"):
      layers[target]["bias"] = stacked(lambda i, p=prefix, o=fan_out: tensor(f"{p(i)}.bias", (o,)))
  params = {"embed": jnp.asarray(tensor("model.embed_tokens.weight", (V, D)), dtype),
            "layers": layers,
            "final_norm": jnp.asarray(tensor("model.norm.weight", (D,)), dtype)}
  if not config.tie_word_embeddings:
    params["lm_head"] = jnp.asarray(tensor("lm_head.weight", (V, D)).T, dtype)
  return params


def read_hf_config(path: str) -> dict:
  """Parses `<path>/config.json`, with errors that name the file."""
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{config_file}: not found (expected a Hugging Face model folder)")
  try:
    with open(config_file) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON at line {e.lineno}: {e.msg}") from None


def _safetensors_index(path: str) -> Mapping[str, str]:
  """Tensor name -> shard file, for a single-file or sharded (index.json) checkpoint."""
  index_file = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_file):
    with open(index_file) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_file}: no 'weight_map' object")
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}
  single = os.path.join(path, "model.safetensors")
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path}: neither model.safetensors nor "
                            "model.safetensors.index.json found")
  from safetensors import safe_open
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def load_hf_checkpoint(path: str, **config_overrides) -> tuple[Params, ModelConfig]:
  """Loads a local Hugging Face Llama/Qwen2 folder into (params, config).

  Reads one tensor at a time through safetensors' NumPy API (no torch).

  Args:
    path: folder with `config.json` and `model.safetensors` (or a sharded index).
    **config_overrides: e.g. `param_dtype="bfloat16"`.
  """
  from safetensors import safe_open
  config = ModelConfig.from_hf_config(read_hf_config(path), os.path.join(path, "config.json"),
                                      **config_overrides)
  index = _safetensors_index(path)
  handles = {}

  def get(name: str) -> np.ndarray:
    shard = index[name]  # KeyError -> "missing" in params_from_hf_tensors.
    if not os.path.isfile(shard):
      raise FileNotFoundError(f"{shard}: shard listed for tensor {name!r} is missing")
    if shard not in handles:
      handles[shard] = safe_open(shard, framework="numpy")
    return handles[shard].get_tensor(name)

  return params_from_hf_tensors(config, get, path), config

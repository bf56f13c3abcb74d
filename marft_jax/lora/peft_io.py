"""Hugging Face PEFT format: one folder per adapter, loadable by `PeftModel.from_pretrained`.

A folder holds `adapter_config.json` and `adapter_model.safetensors` with, for every target
module and layer (torch layout, adapter name stripped as PEFT's `save_pretrained` does)::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [R, D_in]   = a[3, i].T
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [D_out, R]  = b[3, i].T

The safetensors metadata is `{"format": "pt"}` (transformers rejects files without it). Each
file is written under a temporary name and moved into place with `os.replace`, so a reader
never sees a half-written file.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from marft_jax.lora.adapters import stack_adapters
from marft_jax.lora.config import LoraConfig
from marft_jax.lora.routing import Adapters
from marft_jax.models import transformer as model_lib  # Module binding: see config.py.
from marft_jax.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features that change the maths beyond plain LoRA: a file using one is rejected.
_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                "layer_replication", "trainable_token_indices", "target_parameters", "use_qalora")


def peft_key(target: str, layer: int, factor: str) -> str:
  """`("q_proj", 3, "A")` -> `"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"`."""
  # Imported here: `models.transformer` imports this package, and `hf_checkpoint` imports
  # names from `transformer`, so it cannot load while this package initialises.
  from marft_jax.models.hf_checkpoint import hf_module_path
  return f"{_PREFIX}{hf_module_path(target, layer)}.lora_{factor}.weight"


def peft_tensors(adapters: Adapters, index: int = 0) -> dict[str, np.ndarray]:
  """Adapter `index` as PEFT's float32 tensors {key: array}, in torch layout."""
  tensors = {}
  for name, w in adapters.layers.items():
    a, b = np.asarray(w["a"][:, index], np.float32), np.asarray(w["b"][:, index], np.float32)
    for layer in range(a.shape[0]):
      tensors[peft_key(name, layer, "A")] = np.ascontiguousarray(a[layer].T)
      tensors[peft_key(name, layer, "B")] = np.ascontiguousarray(b[layer].T)
  return tensors


def peft_config_dict(adapters: Adapters, base_model_name_or_path: Optional[str] = None) -> dict:
  """The `adapter_config.json` contents PEFT's `LoraConfig` reads back.

  `lora_alpha` is written as `scale · r` with `use_rslora` false: PEFT then applies exactly our
  scale, whether or not it came from rsLoRA.
  """
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
          "base_model_name_or_path": base_model_name_or_path, "r": adapters.rank,
          "lora_alpha": adapters.scale * adapters.rank, "lora_dropout": adapters.dropout_rate,
          "use_rslora": False, "target_modules": sorted(adapters.layers), "bias": "none",
          "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
          "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
          "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def save_peft_adapter(path: str, adapters: Adapters, index: int = 0,
                      base_model_name_or_path: Optional[str] = None) -> None:
  """Writes adapter `index` of `adapters` as a PEFT adapter folder `path` (created if needed)."""
  from safetensors.numpy import save_file
  os.makedirs(path, exist_ok=True)
  tensors = peft_tensors(adapters, index)
  config = peft_config_dict(adapters, base_model_name_or_path)
  weights_file = os.path.join(path, WEIGHTS_FILE)
  save_file(tensors, weights_file + ".tmp", metadata={"format": "pt"})
  os.replace(weights_file + ".tmp", weights_file)
  config_file = os.path.join(path, CONFIG_FILE)
  with open(config_file + ".tmp", "w") as f:
    json.dump(config, f, indent=2)
  os.replace(config_file + ".tmp", config_file)


def save_peft_adapters(root: str, adapters: Adapters, names: Sequence[str],
                       base_model_name_or_path: Optional[str] = None) -> list[str]:
  """One PEFT folder per agent, `root/<names[i]>/` for adapter i; returns the folders."""
  if len(names) != adapters.num_adapters:
    raise ValueError(f"{len(names)} names for {adapters.num_adapters} adapters")
  paths = [os.path.join(root, name) for name in names]
  for i, path in enumerate(paths):
    save_peft_adapter(path, adapters, i, base_model_name_or_path)
  return paths


def load_peft_adapter(path: str, model_config: ModelConfig) -> Adapters:
  """Reads a PEFT LoRA folder (ours or PEFT's own) as an A = 1 adapter set.

  The targets are the modules present in the weights file. Raises ValueError naming the file
  for a feature plain LoRA cannot express, a missing layer or a shape that does not fit.
  """
  config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
  peft_config = _read_peft_config(config_file)
  tensors = _read_tensors(weights_file)
  targets = _targets_in(tensors, model_config.num_layers, weights_file)
  config = LoraConfig(rank=int(peft_config["r"]), alpha=float(peft_config["lora_alpha"]),
                      targets=targets, dropout_rate=float(peft_config.get("lora_dropout", 0.0)),
                      use_rslora=bool(peft_config.get("use_rslora", False)))
  layers_present = peft_config.get("layers_to_transform")
  if isinstance(layers_present, int):
    layers_present = [layers_present]
  layers = {name: _read_target(tensors, name, config.rank, model_config, layers_present,
                               weights_file) for name in targets}
  return Adapters(layers=layers, scale=config.scale, dropout_rate=config.dropout_rate)


def load_peft_adapters(paths: Sequence[str], model_config: ModelConfig) -> Adapters:
  """Stacks several PEFT folders (one per agent, same rank/alpha/targets) on the A axis."""
  return stack_adapters([load_peft_adapter(p, model_config) for p in paths])


def _read_peft_config(config_file: str) -> dict:
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{config_file}: not found (expected a PEFT adapter folder)")
  with open(config_file) as f:
    config = json.load(f)
  if str(config.get("peft_type", "")).upper() != "LORA":
    raise ValueError(f"{config_file}: peft_type={config.get('peft_type')!r}, only 'LORA' loads")
  if config.get("bias", "none") != "none":
    raise ValueError(f"{config_file}: bias={config['bias']!r} is not supported (only 'none')")
  for key in _UNSUPPORTED:
    if config.get(key):
      raise ValueError(f"{config_file}: {key}={config[key]!r} is not supported")
  return config


def _read_tensors(weights_file: str) -> dict[str, np.ndarray]:
  # The flax reader also handles bfloat16 files, which NumPy has no dtype for.
  from safetensors.flax import load_file
  if not os.path.isfile(weights_file):
    raise FileNotFoundError(f"{weights_file}: not found")
  return {k: np.asarray(v, np.float32) for k, v in load_file(weights_file).items()}


def _targets_in(tensors: dict, num_layers: int, weights_file: str) -> tuple[str, ...]:
  """Target names of the keys `base_model.model.model.layers.N.<module>.lora_{A,B}.weight`."""
  from marft_jax.models.hf_checkpoint import HF_LAYER_MODULES  # Lazy: see `peft_key`.
  by_module = {module: name for name, module in HF_LAYER_MODULES.items()}
  found = set()
  for key in tensors:
    parts = key[len(_PREFIX):].split(".")  # model layers N <2-part module> lora_X weight
    if (not key.startswith(_PREFIX) or len(parts) != 7 or parts[:2] != ["model", "layers"]
        or ".".join(parts[3:5]) not in by_module or parts[5] not in ("lora_A", "lora_B")
        or parts[6] != "weight"):
      raise ValueError(f"{weights_file}: tensor {key!r} is not a LoRA factor of a supported "
                       f"linear layer ({sorted(HF_LAYER_MODULES)})")
    if not parts[2].isdigit() or int(parts[2]) >= num_layers:
      raise ValueError(f"{weights_file}: tensor {key!r} names a layer the model "
                       f"({num_layers} layers) does not have")
    found.add(by_module[".".join(parts[3:5])])
  return tuple(sorted(found))


def _read_target(tensors, name, rank, model_config, layers_present, weights_file):
  """{"a": [L, 1, D_in, R], "b": [L, 1, R, D_out]}; layers outside `layers_to_transform` are 0."""
  fan_in, fan_out = model_lib.linear_shapes(model_config)[name]
  a = np.zeros((model_config.num_layers, 1, fan_in, rank), np.float32)
  b = np.zeros((model_config.num_layers, 1, rank, fan_out), np.float32)
  for layer in range(model_config.num_layers):
    if layers_present is not None and layer not in layers_present:
      continue
    a[layer, 0] = _tensor(tensors, peft_key(name, layer, "A"), (rank, fan_in), weights_file).T
    b[layer, 0] = _tensor(tensors, peft_key(name, layer, "B"), (fan_out, rank), weights_file).T
  return {"a": jnp.asarray(a), "b": jnp.asarray(b)}


def _tensor(tensors, key, shape, weights_file):
  if key not in tensors:
    raise ValueError(f"{weights_file}: tensor {key!r} is missing")
  if tensors[key].shape != shape:
    raise ValueError(f"{weights_file}: tensor {key!r} has shape {tensors[key].shape}, "
                     f"the model and rank imply {shape}")
  return tensors[key]

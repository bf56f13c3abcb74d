"""Hugging Face PEFT format: one folder per adapter, loadable by `PeftModel.from_pretrained`.

A folder holds `adapter_config.json` and `adapter_model.safetensors` with, for every target
module and layer (torch layout, adapter name stripped as PEFT's `save_pretrained` does)::

    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   [R, D_in]   = a[3, i].T
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   [D_out, R]  = b[3, i].T

The safetensors metadata is `{"format": "pt"}` (transformers rejects files without it).

Saves replace whole folders, Orbax-style: everything is written into a hidden sibling
`.<name>.tmp-<hex>` and renamed into place, so a folder holds one save's weights and config,
never a mix (`_write_folders_atomically` lists what a crash at each step leaves). Hidden
`.<name>.tmp-*` / `.<name>.old-*` folders are an interrupted save's leftovers, never adapters;
the next save of `<name>` removes them.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import uuid
from typing import Callable, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

from marft_jax.lora.adapters import stack_adapters
from marft_jax.lora.config import LoraConfig
from marft_jax.lora.routing import Adapters, check_adapter_index
from marft_jax.architecture.config import ModelConfig
from marft_jax.architecture.targets import LINEAR, hf_module_path, linear_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# PEFT features that change the maths beyond plain LoRA: a file using one is rejected.
_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                "layer_replication", "trainable_token_indices", "target_parameters", "use_qalora")
_is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a rank.
_is_real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
# adapter_config.json keys we read: what each must hold. `r` and `lora_alpha` are required.
_CONFIG_VALUES = {
    "r": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "lora_alpha": (lambda v: _is_real(v) and math.isfinite(v) and v > 0, "a positive number"),
    "lora_dropout": (lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "layers_to_transform": (lambda v: v is None or _is_int(v) or (
        isinstance(v, list) and all(map(_is_int, v))), "null, an integer or a list of integers"),
}
StrPath = Union[str, "os.PathLike[str]"]


def peft_key(target: str, layer: int, factor: str) -> str:
  """`("q_proj", 3, "A")` -> `"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"`."""
  return f"{_PREFIX}{hf_module_path(target, layer)}.lora_{factor}.weight"


def peft_tensors(adapters: Adapters, index: int = 0) -> dict[str, np.ndarray]:
  """Adapter `index` as PEFT's float32 tensors {key: array}, in torch layout."""
  check_adapter_index(index, adapters.num_adapters)
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


def save_peft_adapter(path: StrPath, adapters: Adapters, index: int = 0,
                      base_model_name_or_path: Optional[str] = None) -> None:
  """Writes adapter `index` of `adapters` as the PEFT adapter folder `path`, atomically.

  The whole folder is replaced, so `path` must be absent, empty or an adapter folder (one with
  `adapter_config.json` or `adapter_model.safetensors`); anything else is refused, not deleted.
  On an exception `path` keeps its previous contents; `_write_folders_atomically` says what a
  crash leaves.
  """
  check_adapter_index(index, adapters.num_adapters)
  _write_folders_atomically({path: functools.partial(_write_adapter, adapters=adapters,
                                                     index=index, base=base_model_name_or_path)})


def save_peft_adapters(root: StrPath, adapters: Adapters, names: Sequence[str],
                       base_model_name_or_path: Optional[str] = None) -> list[str]:
  """One PEFT folder per agent, `root/<names[i]>/` for adapter i; returns the folders.

  All or none: every folder is written to a temporary sibling first and swapped in only once
  all are written; an exception at any step leaves every agent's folder as it was. A crash
  (process killed) while swapping can leave the first agents new and the rest old, each folder
  complete (see `_write_folders_atomically`).
  """
  _check_names(names, adapters.num_adapters)
  paths = [os.path.join(os.fspath(root), name) for name in names]
  _write_folders_atomically({path: functools.partial(_write_adapter, adapters=adapters, index=i,
                                                     base=base_model_name_or_path)
                             for i, path in enumerate(paths)})
  return paths


def load_peft_adapter(path: StrPath, model_config: ModelConfig) -> Adapters:
  """Reads a PEFT LoRA folder (ours or PEFT's own) as an A = 1 adapter set.

  The targets are the modules present in the weights file. Raises ValueError naming the file
  (and key or tensor) for a config that is not valid JSON or lacks a valid `r` or `lora_alpha`,
  an unreadable weights file, a feature plain LoRA cannot express, a missing layer or a shape
  that does not fit.
  """
  peft_config, weights_file = check_peft_folder(path)
  tensors = _read_tensors(weights_file)
  config = _lora_config(peft_config, _targets_in(tensors, weights_file, model_config.num_layers))
  layers_present = peft_config.get("layers_to_transform")
  if isinstance(layers_present, int):
    layers_present = [layers_present]
  layers = {name: _read_target(tensors, name, config.rank, model_config, layers_present,
                               weights_file) for name in config.targets}
  return Adapters(layers=layers, scale=config.scale, dropout_rate=config.dropout_rate)


def check_peft_folder(path: StrPath) -> tuple[dict, str]:
  """(the checked adapter config, the weights file's path) of a PEFT LoRA folder, without
  reading its tensors: a launch checks the folders it will load before the model loads.

  Raises FileNotFoundError or ValueError naming the file, as `load_peft_adapter` does.
  """
  folder = os.fspath(path)
  if os.path.isfile(folder):
    raise ValueError(f"{folder}: a file, not a PEFT adapter folder")
  config = _read_peft_config(os.path.join(folder, CONFIG_FILE))
  weights_file = os.path.join(folder, WEIGHTS_FILE)
  if not os.path.isfile(weights_file):
    raise FileNotFoundError(f"{weights_file}: not found")
  return config, weights_file


def read_peft_lora_config(path: StrPath) -> LoraConfig:
  """The `LoraConfig` of a PEFT LoRA folder (rank, alpha, rsLoRA and dropout from its config,
  the targets from its weights file's tensor names), reading no tensor: what a run checks an
  `init_from` folder against before the model loads. Raises as `check_peft_folder` does, and
  ValueError naming the weights file for one whose header does not parse."""
  from safetensors import SafetensorError, safe_open
  peft_config, weights_file = check_peft_folder(path)
  try:
    with safe_open(weights_file, framework="numpy") as f:
      names = list(f.keys())
  except SafetensorError as e:
    raise ValueError(f"{weights_file}: not a valid safetensors file (truncated or corrupt): "
                     f"{e}") from e
  return _lora_config(peft_config, _targets_in(names, weights_file))


def _lora_config(peft_config: dict, targets: tuple[str, ...]) -> LoraConfig:
  return LoraConfig(rank=peft_config["r"], alpha=float(peft_config["lora_alpha"]),
                    targets=targets, dropout_rate=float(peft_config.get("lora_dropout", 0.0)),
                    use_rslora=bool(peft_config.get("use_rslora", False)))


def load_peft_adapters(paths: Sequence[StrPath], model_config: ModelConfig) -> Adapters:
  """Stacks several PEFT folders (one per agent, same rank/alpha/targets) on the A axis."""
  return stack_adapters([load_peft_adapter(p, model_config) for p in paths])


def _read_peft_config(config_file: str) -> dict:
  if not os.path.isfile(config_file):
    folder = os.path.dirname(config_file)
    moved = [p for p in _leftovers(folder) if ".old-" in os.path.basename(p)]
    hint = (f"; an interrupted save moved the previous adapter to {moved[0]} (the next save of "
            f"{folder} puts it back)" if moved and not os.path.exists(folder) else "")
    raise FileNotFoundError(f"{config_file}: not found (expected a PEFT adapter folder){hint}")
  try:
    with open(config_file) as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_file}: invalid JSON at line {e.lineno}, column {e.colno}: "
                     f"{e.msg}") from None
  if not isinstance(config, dict):
    raise ValueError(f"{config_file}: holds a JSON {type(config).__name__}, not an object")
  for key, (valid, expected) in _CONFIG_VALUES.items():
    if key in ("r", "lora_alpha") and key not in config:
      raise ValueError(f"{config_file}: missing key {key!r} ({expected})")
    if key in config and not valid(config[key]):
      raise ValueError(f"{config_file}: {key}={config[key]!r}, expected {expected}")
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
  from safetensors import SafetensorError
  from safetensors.flax import load_file
  try:
    loaded = load_file(weights_file)
  except SafetensorError as e:
    raise ValueError(f"{weights_file}: not a valid safetensors file (truncated or corrupt): "
                     f"{e}") from e
  return {k: np.asarray(v, np.float32) for k, v in loaded.items()}


def _targets_in(keys, weights_file: str, num_layers: Optional[int] = None) -> tuple[str, ...]:
  """Target names of the tensor names `base_model.model.model.layers.N.<module>.lora_{A,B}
  .weight` (N checked against `num_layers` when given)."""
  by_module = {linear.hf_module: name for name, linear in LINEAR.items()}
  found = set()
  for key in keys:
    parts = key[len(_PREFIX):].split(".")  # model layers N <2-part module> lora_X weight
    if (not key.startswith(_PREFIX) or len(parts) != 7 or parts[:2] != ["model", "layers"]
        or not parts[2].isdigit() or ".".join(parts[3:5]) not in by_module
        or parts[5] not in ("lora_A", "lora_B") or parts[6] != "weight"):
      raise ValueError(f"{weights_file}: tensor {key!r} is not a LoRA factor of a supported "
                       f"linear layer ({sorted(LINEAR)})")
    if num_layers is not None and int(parts[2]) >= num_layers:
      raise ValueError(f"{weights_file}: tensor {key!r} names a layer the model "
                       f"({num_layers} layers) does not have")
    found.add(by_module[".".join(parts[3:5])])
  return tuple(sorted(found))


def _read_target(tensors, name, rank, model_config, layers_present, weights_file):
  """{"a": [L, 1, D_in, R], "b": [L, 1, R, D_out]}; layers outside `layers_to_transform` are 0."""
  fan_in, fan_out = linear_shapes(model_config)[name]
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


def _check_names(names: Sequence[str], num_adapters: int) -> None:
  if isinstance(names, str) or len(names) != num_adapters:
    raise ValueError(f"names={names!r}: give one name per adapter ({num_adapters})")
  for name in names:
    # A leading dot is refused so that no agent folder can look like a save's leftovers.
    if (not isinstance(name, str) or not name or name.startswith(".")
        or any(c in name for c in ("/", "\\", "\0"))):
      raise ValueError(f"names: {name!r} is not a plain folder name (non-empty, no path "
                       f"separator, not starting with '.')")
  repeated = sorted({name for name in names if list(names).count(name) > 1})
  if repeated:
    raise ValueError(f"names: {repeated} appear more than once")


def _write_adapter(folder: str, adapters: Adapters, index: int, base: Optional[str]) -> None:
  from safetensors.numpy import save_file
  save_file(peft_tensors(adapters, index), os.path.join(folder, WEIGHTS_FILE),
            metadata={"format": "pt"})
  with open(os.path.join(folder, CONFIG_FILE), "w") as f:
    json.dump(peft_config_dict(adapters, base), f, indent=2)


def _write_folders_atomically(writers: dict[StrPath, Callable[[str], None]]) -> None:
  """Creates or replaces each folder `path` with what `writers[path](dir)` writes into an empty
  `dir`: on return every folder is new; on an exception every folder is as it was.

  Steps, and what a crash (process killed, power lost) during each leaves at a target `t`:
    1. Leftovers of an interrupted save of `t` are cleared (`_prepare_target`).
    2. Stage: each folder is written into a sibling `.<name>.tmp-<hex>`; its files and itself
       are fsynced. A crash leaves every `t` as it was (plus the temp folders).
    3. Swap, folder by folder: `t` (if it exists) is renamed to `.<name>.old-<hex>`, then the
       temp folder to `t`. A crash between these two renames leaves `t` absent and its old
       contents complete in `.<name>.old-<hex>`, which the next save of `t` renames back
       before doing anything else. Otherwise each `t` holds its old or its new folder, complete:
       the folders before the crash point new, the rest old.
    4. The parents are fsynced (the renames are durable from here on), then the `.old-` folders
       deleted (errors ignored: the next save deletes what is left).
  An exception in steps 2-3 or the fsync renames the swapped folders back and deletes the temp
  folders before propagating (only a failure of those renames themselves leaves a state as a
  crash would, which the next save clears). Saves of one folder must not run concurrently: each
  clears the other's temp folders.
  """
  targets = [os.path.abspath(os.fspath(path)) for path in writers]
  for target in targets:
    _prepare_target(target)
  token = uuid.uuid4().hex[:8]
  staged, swapped = [], []  # (target, temp folder); (target, set-aside old folder or None)
  try:
    for target, write in zip(targets, writers.values()):
      temp = _sibling(target, "tmp", token)
      staged.append((target, temp))
      os.mkdir(temp)
      write(temp)
      for entry in os.listdir(temp):
        _fsync(os.path.join(temp, entry))
      _fsync(temp)
    for target, temp in staged:
      old = _sibling(target, "old", token) if os.path.exists(target) else None
      if old:
        os.replace(target, old)
      swapped.append((target, old))
      os.replace(temp, target)
    for parent in sorted({os.path.dirname(target) for target in targets}):
      _fsync(parent)
  except BaseException:  # KeyboardInterrupt too: a half-swapped set must be undone.
    for (target, old), (_, temp) in reversed(list(zip(swapped, staged))):
      if not os.path.exists(temp):  # The new folder is at `target`: move it back out.
        os.replace(target, temp)
      if old:
        os.replace(old, target)
    for _, temp in staged:
      shutil.rmtree(temp, ignore_errors=True)
    raise
  for _, old in swapped:
    if old:
      shutil.rmtree(old, ignore_errors=True)


def _prepare_target(target: str) -> None:
  """Undoes what an interrupted save of `target` left, then refuses a target that a save may
  not replace (a file, or a folder holding something other than an adapter)."""
  parent, name = os.path.split(target)
  if not name:
    raise ValueError(f"{target}: not a folder path a save can replace")
  os.makedirs(parent, exist_ok=True)
  for leftover in _leftovers(target):
    if ".old-" in os.path.basename(leftover) and not os.path.exists(target):
      os.replace(leftover, target)  # A crash between the two renames of a swap.
    else:
      shutil.rmtree(leftover, ignore_errors=True)
  if os.path.lexists(target) and not (os.path.isdir(target) and (
      not os.listdir(target) or {CONFIG_FILE, WEIGHTS_FILE} & set(os.listdir(target)))):
    raise ValueError(f"{target}: exists and is not a PEFT adapter folder (no {CONFIG_FILE} "
                     f"or {WEIGHTS_FILE}); refusing to replace it")


def _leftovers(target: str) -> list[str]:
  """The temp and set-aside folders interrupted saves of `target` left, sorted."""
  parent, name = os.path.split(os.path.abspath(target))
  if not os.path.isdir(parent):
    return []
  prefixes = (f".{name}.tmp-", f".{name}.old-")
  return [os.path.join(parent, e) for e in sorted(os.listdir(parent)) if e.startswith(prefixes)]


def _sibling(target: str, kind: str, token: str) -> str:
  parent, name = os.path.split(target)
  return os.path.join(parent, f".{name}.{kind}-{token}")


def _fsync(path: str) -> None:
  """Flushes a file's data, or a folder's entries (renames), to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)

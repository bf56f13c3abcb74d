"""Loading Hugging Face checkpoints (`config.json` + `*.safetensors`) without torch.

The mapping between Hugging Face tensor names and our parameter tree lives here only; the
GGUF loader and the PEFT adapter export reuse it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Callable, Iterable, Union

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax.models.config import ModelConfig
from marft_jax.models.targets import GLOBALS, LINEARS, NORMS, hf_module_path

Params = dict
# Buffers some older exports saved that carry no weights (recomputed from `rope_theta`).
_IGNORED_TENSORS = re.compile(r"\.rotary_emb\.inv_freq$")
_LAYER_INDEX = re.compile(r"^(?:model\.layers|blk)\.(\d+)\.")  # Hugging Face or GGUF names
_log = logging.getLogger(__name__)


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Name -> shape (torch layout, `[out, in]`) of every tensor a checkpoint of `config` holds.

  Tied embeddings: no `lm_head.weight`.
  """
  D, V = config.hidden_size, config.vocab_size
  shapes = {GLOBALS["embed"][0]: (V, D)}
  for i in range(config.num_layers):
    for norm in NORMS:
      shapes[f"model.layers.{i}.{norm.hf_module}.weight"] = (D,)
    for linear in LINEARS:
      fan_in, fan_out = linear.shape(config)
      shapes[f"{hf_module_path(linear.name, i)}.weight"] = (fan_out, fan_in)
      if config.qkv_bias and linear.qkv:
        shapes[f"{hf_module_path(linear.name, i)}.bias"] = (fan_out,)
  shapes[GLOBALS["final_norm"][0]] = (D,)
  if not config.tie_word_embeddings:
    shapes[GLOBALS["lm_head"][0]] = (V, D)
  return shapes


def check_tensor_names(expected: Iterable[str], present: Iterable[str], source: str,
                       num_layers: int, fewer_layers_requested: bool = False) -> None:
  """Refuses a file whose tensors are not exactly the ones the model reads.

  A tensor the config needs but the file lacks, or one the file has but the model would not
  read (a layer count below the file's, a renamed or unsupported tensor), is an error: loading
  would give a different model than the file describes. With `fewer_layers_requested` (the
  caller passed `num_layers=` explicitly) the tensors of layers `>= num_layers` are expected to
  be left out; that is logged at INFO level, and any other unused tensor is still an error.

  Args:
    expected: the names the model reads, in the file's naming (Hugging Face or GGUF).
    present: every tensor name in the file(s).
    source: the file or folder, named in errors.
    num_layers: the config's layer count.
    fewer_layers_requested: whether `num_layers` was set on purpose, below the file's count.
  Raises:
    ValueError naming `source`, the count and the first few missing or unused tensors.
  """
  expected, present = list(expected), list(present)
  expected_set, present_set = set(expected), set(present)
  missing = [name for name in expected if name not in present_set]
  if missing:
    raise ValueError(f"{source}: {len(missing)} tensor(s) the config needs are missing: "
                     f"{_first_few(missing)}")
  unused = [name for name in present
            if name not in expected_set and not _IGNORED_TENSORS.search(name)]
  deeper = [name for name in unused
            if (m := _LAYER_INDEX.match(name)) and int(m.group(1)) >= num_layers]
  hint = ""
  if deeper and fewer_layers_requested:
    _log.info("%s: num_layers=%d requested: leaving out the %d tensors of deeper layers",
              source, num_layers, len(deeper))
    left_out = set(deeper)
    unused = [name for name in unused if name not in left_out]
  elif deeper:
    hint = (f"; the file has layers beyond the config's num_layers={num_layers} (pass "
            f"num_layers={num_layers} explicitly to load only the first {num_layers})")
  if unused:
    raise ValueError(f"{source}: {len(unused)} tensor(s) in the file would be left unused: "
                     f"{_first_few(unused)}{hint}")


def _first_few(names: list[str], count: int = 5) -> str:
  shown = ", ".join(repr(name) for name in names[:count])
  return shown + (f" and {len(names) - count} more" if len(names) > count else "")


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
  shapes = hf_tensor_shapes(config)

  def tensor(name: str) -> np.ndarray:
    try:
      array = np.asarray(get(name))
    except KeyError:
      raise ValueError(f"{source}: tensor {name!r} is missing") from None
    if array.shape != shapes[name]:
      raise ValueError(f"{source}: tensor {name!r} has shape {array.shape}, "
                       f"the config implies {shapes[name]}")
    return array.astype(np.float32)

  def stacked(fn) -> jnp.ndarray:
    return jnp.asarray(np.stack([fn(i) for i in range(config.num_layers)]), dtype)

  layers = {norm.name: stacked(lambda i, n=norm: tensor(f"model.layers.{i}.{n.hf_module}.weight"))
            for norm in NORMS}
  for linear in LINEARS:
    path = lambda i, name=linear.name: hf_module_path(name, i)
    layers[linear.name] = {"kernel": stacked(lambda i, p=path: tensor(f"{p(i)}.weight").T)}
    if config.qkv_bias and linear.qkv:
      layers[linear.name]["bias"] = stacked(lambda i, p=path: tensor(f"{p(i)}.bias"))
  params = {"embed": jnp.asarray(tensor(GLOBALS["embed"][0]), dtype), "layers": layers,
            "final_norm": jnp.asarray(tensor(GLOBALS["final_norm"][0]), dtype)}
  if not config.tie_word_embeddings:
    params["lm_head"] = jnp.asarray(tensor(GLOBALS["lm_head"][0]).T, dtype)
  return params


def hf_tensors(params: Params, config: ModelConfig) -> dict[str, np.ndarray]:
  """The inverse of `params_from_hf_tensors`: Hugging Face tensors (torch layout `[out, in]`),
  f32, e.g. to save a checkpoint or to fill a transformers model with the same weights."""
  f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  layers = jax.tree.map(np.asarray, params["layers"])  # one transfer, not one per layer
  out = {GLOBALS["embed"][0]: f32(params["embed"]),
         GLOBALS["final_norm"][0]: f32(params["final_norm"])}
  for i in range(config.num_layers):
    for norm in NORMS:
      out[f"model.layers.{i}.{norm.hf_module}.weight"] = f32(layers[norm.name][i])
    for linear in LINEARS:
      p, path = layers[linear.name], hf_module_path(linear.name, i)
      out[f"{path}.weight"] = f32(p["kernel"][i].T)
      if "bias" in p:
        out[f"{path}.bias"] = f32(p["bias"][i])
  if "lm_head" in params:
    out[GLOBALS["lm_head"][0]] = f32(params["lm_head"].T)
  return out


def hf_config_dict(config: ModelConfig) -> dict:
  """The inverse of `ModelConfig.from_hf_config`: `config.json` contents that transformers and
  `from_hf_config` read back."""
  return {"model_type": config.architecture,
          "architectures": ["LlamaForCausalLM" if config.architecture == "llama"
                            else "Qwen2ForCausalLM"],
          "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
          "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
          "head_dim": config.head_dim, "rope_theta": config.rope_theta,
          "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
          "tie_word_embeddings": config.tie_word_embeddings,
          "attention_bias": config.qkv_bias,
          "max_position_embeddings": config.max_position_embeddings,
          "torch_dtype": "float32"}


def read_hf_config(path: Union[str, os.PathLike]) -> dict:
  """Parses `<path>/config.json`, with errors that name the file."""
  config_file = os.path.join(path, "config.json")
  if not os.path.isfile(config_file):
    raise FileNotFoundError(f"{config_file}: not found (expected a Hugging Face model folder)")
  config = _read_json(config_file)
  if not isinstance(config, dict):
    raise ValueError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
  return config


def _read_json(file: str):
  try:
    with open(file) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file}: invalid JSON at line {e.lineno}: {e.msg}") from None
  except UnicodeDecodeError as e:
    raise ValueError(f"{file}: not a text file ({e.reason})") from None


def _safetensors_index(path: str) -> tuple[dict[str, str], str]:
  """Tensor name -> shard file, for a single-file or sharded (index.json) checkpoint, and the
  file that lists the names (the index, or the single file).

  Raises:
    ValueError / FileNotFoundError naming the index file (and the shard) for malformed JSON, a
    `weight_map` that is not an object of file names, or a listed shard that does not exist.
  """
  index_file = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index_file):
    index = _read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index_file}: no 'weight_map' object")
    for name, shard in weight_map.items():
      if not isinstance(shard, str):
        raise ValueError(f"{index_file}: weight_map[{name!r}]={shard!r}: must be a file name")
      if not os.path.isfile(os.path.join(path, shard)):
        raise FileNotFoundError(f"{index_file}: shard {shard!r} (listed for tensor {name!r}) "
                                "is missing")
    return {name: os.path.join(path, shard) for name, shard in weight_map.items()}, index_file
  single = os.path.join(path, "model.safetensors")
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path}: neither model.safetensors nor "
                            "model.safetensors.index.json found")
  return {name: single for name in _open_safetensors(single).keys()}, single


def _open_safetensors(file: str):
  """`safe_open(file)` (NumPy); a truncated or garbage file is a ValueError naming it."""
  from safetensors import SafetensorError, safe_open
  try:
    return safe_open(file, framework="numpy")
  except (SafetensorError, OSError) as e:
    raise ValueError(f"{file}: not a readable safetensors file, truncated or corrupt "
                     f"({e})") from None


def load_hf_checkpoint(path: Union[str, os.PathLike],
                       **config_overrides) -> tuple[Params, ModelConfig]:
  """Loads a local Hugging Face Llama/Qwen2 folder into (params, config).

  Reads one tensor at a time through safetensors' NumPy API (no torch). Every tensor in the
  files must be one the model reads, and the other way round (`check_tensor_names`); a tied
  `lm_head.weight` that is stored anyway must equal the embedding.

  Args:
    path: folder with `config.json` and `model.safetensors` (or a sharded index).
    **config_overrides: e.g. `param_dtype="bfloat16"`; `num_layers=` below the file's count
      loads the first layers only (on purpose; logged).
  Raises:
    FileNotFoundError / ValueError naming the file (and the shard, key or tensor).
  """
  from safetensors import SafetensorError
  path = os.fspath(path)
  config = ModelConfig.from_hf_config(read_hf_config(path), os.path.join(path, "config.json"),
                                      **config_overrides)
  index, listing = _safetensors_index(path)
  handles = {shard: _open_safetensors(shard) for shard in sorted(set(index.values()))}
  expected = list(hf_tensor_shapes(config))
  tied_head = config.tie_word_embeddings and "lm_head.weight" in index
  if tied_head:
    expected.append("lm_head.weight")  # some exports store the tied head: compared below
  check_tensor_names(expected, index, listing, config.num_layers,
                     "num_layers" in config_overrides)

  def get(name: str) -> np.ndarray:
    try:
      return handles[index[name]].get_tensor(name)
    except SafetensorError as e:
      raise ValueError(f"{index[name]}: cannot read tensor {name!r} ({e})") from None

  params = params_from_hf_tensors(config, get, path)
  if tied_head and not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
    raise ValueError(f"{listing}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                     "but config.json ties them (tie_word_embeddings=true)")
  return params, config

"""Loading a llama.cpp GGUF file (Llama or Qwen2 architecture) without torch.

The file's metadata becomes a Hugging Face style config dict (`hf_config_from_gguf`), every
tensor is dequantized to f32 with `gguf.quants.dequantize` (NumPy; the same arithmetic that
transformers' GGUF loader uses, so the weights are bit-identical), renamed to its Hugging Face
name and handed to `hf_checkpoint.params_from_hf_tensors`, which owns the layout of our tree.

Two things differ from a Hugging Face checkpoint:

* Names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, and so on
  (both names of every tensor come from the one table in `targets.py`).
* RoPE row order (Llama only): llama.cpp's converter permutes the rows of `attn_q` and `attn_k`
  so that each head's rotary pairs are adjacent (GPT-J style, `(x0, x1), (x2, x3), ...`) instead
  of half a head apart (GPT-NeoX style, `(x0, x_{E/2}), ...`) as transformers and we rotate.
  `unpermute_rope_rows` undoes it, with the query-head count for `attn_q` and the kv-head count
  for `attn_k`. Qwen2 files are not permuted (llama.cpp runs Qwen2 in NeoX order).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence, Union

import gguf
import numpy as np

from marft_jax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from marft_jax.models.hf_checkpoint import (Params, check_tensor_names, hf_tensor_shapes,
                                            params_from_hf_tensors)
from marft_jax.models.targets import GLOBALS, LINEARS, NORMS, hf_module_path
from marft_jax.validation import check_positive_int, check_positive_number

GGUFSource = Union[str, os.PathLike, gguf.GGUFReader]


def open_gguf(path: Union[str, os.PathLike]) -> gguf.GGUFReader:
  """Opens (memory-maps) a GGUF file and checks every tensor's extent; errors name the file.

  Raises:
    FileNotFoundError for a missing file; ValueError naming the file for one that is not GGUF or
    is truncated or corrupt (naming the tensor when a tensor's bytes are the problem).
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: GGUF file not found")
  try:
    return _CheckedReader(path)
  except _ExtentError:
    raise
  except (ValueError, OSError, IndexError, KeyError) as e:
    raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from None


class _ExtentError(ValueError):
  """A tensor whose bytes do not lie inside the file (already names file and tensor)."""


def check_tensor_extents(extents: Iterable[tuple[str, int, Sequence[int], int]],
                         file_size: int, source: str) -> None:
  """Refuses a tensor whose bytes run past the end of the file or into the next tensor.

  A tensor of ggml type `t` and ggml shape `ne` (fastest axis first) takes
  `prod(ne) / block_size(t) * type_size(t)` bytes (gguf's `GGML_QUANT_SIZES`) from its offset.
  gguf itself slices that many bytes from its memory map without checking: a short file then
  fails with an unnamed reshape error, and a tensor whose type or shape was edited upwards reads
  the bytes of the tensor after it.

  Args:
    extents: per tensor, (name, ggml type id, ne, absolute byte offset of its data).
    file_size: bytes in the file.
    source: the file, named in errors.
  Raises:
    ValueError "{source}: truncated: tensor ..." past the end of the file, or "{source}: corrupt:
    tensor ..." for an unknown type, a row length the type's block size does not divide, or
    bytes that overlap the next tensor's.
  """
  spans = []
  for name, type_id, ne, start in extents:
    ne = [int(n) for n in ne]
    sizes = gguf.GGML_QUANT_SIZES.get(_quant_type(type_id))
    if sizes is None:
      raise _ExtentError(f"{source}: corrupt: tensor {name!r} has unknown ggml type {type_id}")
    block, type_size = sizes
    if ne and ne[0] % block:
      raise _ExtentError(f"{source}: corrupt: tensor {name!r} has rows of {ne[0]} values, not a "
                         f"multiple of its type's block of {block}")
    spans.append((start, start + math.prod(ne) // block * type_size, name))
  spans.sort()
  for (start, end, name), following in zip(spans, spans[1:] + [None]):
    what = f"tensor {name!r} (bytes {start}..{end})"
    if end > file_size:
      raise _ExtentError(f"{source}: truncated: {what} runs past the end of the file "
                         f"({file_size} bytes)")
    if following is not None and end > following[0]:
      raise _ExtentError(f"{source}: corrupt: {what} runs into tensor {following[2]!r} "
                         f"(from byte {following[0]})")


def _quant_type(type_id: int):
  try:
    return gguf.GGMLQuantizationType(int(type_id))
  except ValueError:
    return None


class _CheckedReader(gguf.GGUFReader):
  """`gguf.GGUFReader` that runs `check_tensor_extents` before gguf slices the tensors' data."""

  def _build_tensors(self, start_offs, fields):
    # The parts of gguf's tensor-info field: name length, name, n_dims, ne, type, offset.
    extents = [(bytes(f.parts[1]).decode("utf-8", "replace"), f.parts[4][0], f.parts[3],
                start_offs + int(f.parts[5][0])) for f in fields]
    check_tensor_extents(extents, self.data.size, os.fspath(self.data.filename))
    super()._build_tensors(start_offs, fields)


def _reader_and_source(path_or_reader: GGUFSource) -> tuple[gguf.GGUFReader, str]:
  if isinstance(path_or_reader, (str, os.PathLike)):
    return open_gguf(path_or_reader), os.fspath(path_or_reader)
  return path_or_reader, os.fspath(path_or_reader.data.filename)


def gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  """Every scalar and short-array metadata field, decoded (long token arrays are skipped)."""
  out = {}
  for name, field in reader.fields.items():
    if name.startswith("tokenizer.ggml.") and len(field.data) > 1:
      continue  # tokens, merges, token types: read by the tokenizer when needed.
    out[name] = field.contents()
  return out


def hf_config_from_gguf(metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple],
                        source: str) -> dict:
  """A Hugging Face `config.json`-style dict from GGUF metadata (`{arch}.block_count`, ...).

  Args:
    metadata: as returned by `gguf_metadata`.
    tensor_shapes: name -> NumPy-order shape of every tensor in the file. Tied embeddings: no
      `output.weight`; without `{arch}.vocab_size` the vocabulary is `token_embd`'s row count.
    source: the file, named in errors.
  Raises:
    ValueError naming `source` and the key for an unsupported architecture, a missing key or a
    RoPE variant we do not implement.
  """
  arch = metadata.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"{source}: general.architecture={arch!r} is not supported; "
                     f"supported: {SUPPORTED_ARCHITECTURES}")

  def need(key, check=check_positive_int, default=None):
    full = f"{arch}.{key}"
    if full not in metadata:
      if default is None:
        raise ValueError(f"{source}: missing metadata key {full!r}")
      return default
    check(f"{source}: {full}", metadata[full])
    return metadata[full]

  hidden, heads = need("embedding_length"), need("attention.head_count")
  head_dim = need("attention.key_length", default=hidden // heads)
  rotary = need("rope.dimension_count", default=head_dim)
  if rotary != head_dim:
    raise ValueError(f"{source}: {arch}.rope.dimension_count={rotary} != head dim {head_dim} "
                     "(partial rotary embeddings are not supported)")
  if "rope_freqs.weight" in tensor_shapes:
    raise ValueError(f"{source}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, "
                     "e.g. Llama 3.1 scaling) is not supported")
  hf = {
      "model_type": arch,
      "num_hidden_layers": need("block_count"),
      "hidden_size": hidden,
      "intermediate_size": need("feed_forward_length"),
      "num_attention_heads": heads,
      "num_key_value_heads": need("attention.head_count_kv", default=heads),
      "max_position_embeddings": need("context_length"),
      "head_dim": head_dim,
      "rms_norm_eps": need("attention.layer_norm_rms_epsilon", check_positive_number),
      "rope_theta": need("rope.freq_base", check_positive_number, 10000.0),
      "tie_word_embeddings": "output.weight" not in tensor_shapes,
      "vocab_size": need("vocab_size", default=tensor_shapes.get("token_embd.weight", (None,))[0]),
  }
  scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
  if scaling == "linear":
    hf["rope_scaling"] = {"rope_type": "linear",
                          "factor": metadata[f"{arch}.rope.scaling.factor"]}
  elif scaling != "none":
    raise ValueError(f"{source}: {arch}.rope.scaling.type={scaling!r} is not supported; "
                     "supported: 'none', 'linear'")
  return hf


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's `permute` of a q/k projection: GGUF row order -> Hugging Face order.

  llama.cpp writes `w.reshape(n_head, 2, E // 2, D).swapaxes(1, 2)` (so row `2j + c` of a head
  holds Hugging Face row `c * E/2 + j`); this is its inverse.

  Args:
    w: [n_head * E, D] torch layout (`[out, in]`).
    n_head: query heads for `attn_q`, kv heads for `attn_k`.
  """
  d_out, d_in = w.shape
  return w.reshape(n_head, d_out // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def _hf_to_gguf_names(num_layers: int) -> dict[str, str]:
  """Hugging Face tensor name -> GGUF tensor name, for every tensor a Llama/Qwen2 model has."""
  names = {hf: gguf_name for hf, gguf_name, _ in GLOBALS.values()}
  for i in range(num_layers):
    for norm in NORMS:
      names[f"model.layers.{i}.{norm.hf_module}.weight"] = f"blk.{i}.{norm.gguf_name}.weight"
    for linear in LINEARS:
      for kind in ("weight", "bias"):
        names[f"{hf_module_path(linear.name, i)}.{kind}"] = f"blk.{i}.{linear.gguf_name}.{kind}"
  return names


def _numpy_shape(tensor) -> tuple[int, ...]:
  """NumPy order: the reverse of ggml's `ne` order (`[in, out]` there is `[out, in]` here)."""
  return tuple(int(n) for n in reversed(tensor.shape))


def _dequantize(tensor) -> np.ndarray:
  """One GGUF tensor as f32 in NumPy order."""
  w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  return np.asarray(w, np.float32).reshape(_numpy_shape(tensor))


def load_gguf_checkpoint(path: GGUFSource, **config_overrides) -> tuple[Params, ModelConfig]:
  """Loads a Llama/Qwen2 GGUF file (any quantization `gguf` can dequantize) into (params, config).

  Tensors are dequantized one at a time, in NumPy (no torch), then cast to `param_dtype`. The
  file's tensors must be exactly the ones the model reads (`hf_checkpoint.check_tensor_names`):
  a `block_count` below the file's layers, or a tensor we do not implement, is an error.

  Args:
    path: the `.gguf` file, or an open `gguf.GGUFReader` (to share one parse of the file with
      `tokenizer.gguf_tokenizer`).
    **config_overrides: `ModelConfig` fields to set, e.g. `param_dtype="bfloat16"`; `num_layers=`
      below the file's count loads the first layers only (on purpose; logged).
  Raises:
    FileNotFoundError for a missing file; ValueError naming the file (and the tensor, by its
    GGUF name) for an unsupported architecture, a truncated or corrupt file, a missing or
    unused tensor, or a tensor whose shape disagrees with the metadata.
  """
  reader, source = _reader_and_source(path)
  tensors = {t.name: t for t in reader.tensors}
  if not isinstance(reader, _CheckedReader):  # opened by the caller: check it here
    check_tensor_extents([(t.name, t.tensor_type, t.shape, t.data_offset) for t in reader.tensors],
                         reader.data.size, source)
  shapes = {name: _numpy_shape(t) for name, t in tensors.items()}
  hf = hf_config_from_gguf(gguf_metadata(reader), shapes, source)
  config = ModelConfig.from_hf_config(hf, source, **config_overrides)
  names = _hf_to_gguf_names(config.num_layers)
  check_tensor_names([names[n] for n in hf_tensor_shapes(config)], tensors, source,
                     config.num_layers, "num_layers" in config_overrides)
  permute = config.architecture == "llama"
  rope_heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}

  def get(hf_name: str) -> np.ndarray:
    gguf_name = names.get(hf_name, hf_name)
    if gguf_name not in tensors:
      raise KeyError(hf_name)
    w = _dequantize(tensors[gguf_name])
    kind = gguf_name.split(".")[-2]
    if permute and kind in rope_heads and w.ndim == 2:
      n_head = rope_heads[kind]
      if w.shape[0] == n_head * config.head_dim:  # else the shape check below reports it
        w = unpermute_rope_rows(w, n_head)
    return w

  try:
    params = params_from_hf_tensors(config, get, source)
  except ValueError as e:
    match = re.search(r"tensor '([^']+)'", str(e))
    if not match or match.group(1) not in names:
      raise
    raise ValueError(f"{e} (GGUF tensor {names[match.group(1)]!r})") from None
  return params, config

"""`ModelConfig`: the static shape and numerics of a Llama/Qwen2 decoder.

It is a frozen, hashable dataclass so that it can be a static argument of `jax.jit`.
`from_hf_config` reads a Hugging Face `config.json` dict (transformers v4 or v5 layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling; `rope_type` is one of `SUPPORTED_ROPE_TYPES`."""

  rope_type: str = "default"
  factor: float = 1.0
  # Llama-3 only: wavelengths between the two bounds are interpolated smoothly.
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer (Llama family, or Qwen2 with `qkv_bias=True`).

  Shape letters used across the models package: B batch, T time, S cache slots,
  V vocab, D model width, F MLP width, H query heads, K kv heads, G = H // K,
  E head dim (`head_dim`), L layers.
  """

  architecture: str  # "llama" or "qwen2"; informational, the fields below decide.
  vocab_size: int  # V
  hidden_size: int  # D
  intermediate_size: int  # F
  num_layers: int  # L
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # E
  # Positions the model was trained for (RoPE positions, i.e. its context length): the sampler
  # refuses a prompt plus new tokens longer than this. HF `max_position_embeddings`, GGUF
  # `{arch}.context_length`.
  max_position_embeddings: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False  # Qwen2: biases on q, k, v (not on o).
  param_dtype: str = "float32"  # storage dtype of weights: "float32" or "bfloat16".
  compute_dtype: str = "float32"  # activations and matmuls; norms, softmax, logits stay f32.

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"model_type={self.architecture!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_attention_heads={self.num_heads} is not a multiple of "
          f"num_key_value_heads={self.num_kv_heads}")
    if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling.rope_type={self.rope_scaling.rope_type!r} is not supported; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")
    if (not isinstance(self.max_position_embeddings, int) or isinstance(
        self.max_position_embeddings, bool) or self.max_position_embeddings <= 0):
      raise ValueError(f"max_position_embeddings={self.max_position_embeddings!r}: "
                       "must be a positive int")
    for key in ("param_dtype", "compute_dtype"):
      if getattr(self, key) not in ("float32", "bfloat16"):
        raise ValueError(f"{key}={getattr(self, key)!r}: use 'float32' or 'bfloat16'")

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.compute_dtype)

  @property
  def num_groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], source: str = "config.json",
                     **overrides) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict.

    Args:
      hf: the parsed JSON.
      source: where it came from, named in error messages.
      **overrides: fields to set on top (e.g. `param_dtype="bfloat16"`).
    Raises:
      ValueError naming `source` and the offending key.
    """
    def need(key):
      if key not in hf:
        raise ValueError(f"{source}: missing key {key!r}")
      return hf[key]

    arch = need("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"{source}: model_type={arch!r} is not supported; "
                       f"supported: {SUPPORTED_ARCHITECTURES}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias", False):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    if arch == "qwen2" and hf.get("use_sliding_window", False):
      # Every released Qwen2/2.5 checkpoint ships with it off; attending fully would be wrong.
      raise ValueError(f"{source}: use_sliding_window=true is not supported")
    num_heads = need("num_attention_heads")
    hidden = need("hidden_size")
    rope_theta, scaling = _read_rope(hf, source)
    fields = dict(
        architecture=arch,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        max_position_embeddings=hf.get("max_position_embeddings",
                                       cls.max_position_embeddings),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
    )
    fields.update(overrides)
    try:
      return cls(**fields)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None


def _read_rope(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling]:
  """Reads theta and scaling from v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`)."""
  params: dict[str, Any] = dict(hf.get("rope_scaling") or {})
  params.update(hf.get("rope_parameters") or {})
  theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"{source}: rope_scaling.rope_type={rope_type!r} is not supported; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")
  defaults = RopeScaling()
  scaling = RopeScaling(
      rope_type=rope_type,
      factor=float(params.get("factor", defaults.factor)),
      low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
      high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
      original_max_position_embeddings=int(params.get(
          "original_max_position_embeddings", defaults.original_max_position_embeddings)),
  )
  return theta, scaling


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
  """A ≈0.2 M-parameter config for unit tests."""
  fields = dict(architecture=architecture, vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                qkv_bias=architecture == "qwen2", tie_word_embeddings=architecture == "llama",
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
  fields.update(overrides)
  return ModelConfig(**fields)

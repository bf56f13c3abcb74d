"""`ModelConfig`: the static shape and numerics of a Llama/Qwen2 decoder.

It is a frozen, hashable dataclass so that it can be a static argument of `jax.jit`.
`from_hf_config` reads a Hugging Face `config.json` dict (transformers v4 or v5 layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from marft_jax.architecture.layout import TRAINING, Layout
from marft_jax.validation import check_bool, check_positive_int, check_positive_number

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

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"rope_scaling.rope_type={self.rope_type!r} is not supported; "
                       f"supported: {SUPPORTED_ROPE_TYPES}")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
      check_positive_number(f"rope_scaling.{key}", getattr(self, key))
    check_positive_int("rope_scaling.original_max_position_embeddings",
                       self.original_max_position_embeddings)
    if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}")


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
  # Below f32 (bf16): a linear layer with a LoRA adapter accumulates its matmul in f32, adds
  # the adapter's update (x @ a in f32 from bf16 operands, then @ b in f32) in f32, and rounds
  # the sum once, on every path: the token-major fused matmul (`lora.fused`) always has;
  # this makes the routed path (feature-major layers: the CPU sampler's; the learner's under
  # LoRA dropout; groups `fused.use_fused` leaves apart) do the same. False: the routed path
  # rounds the factors, x @ a and the update to bf16 and adds them to a bf16 base output
  # (the code before 2026-11-29). No effect in f32.
  lora_update_f32: bool = True
  # How params and KV cache are stored and the layers run (layout.py): the training layout by
  # default, `layout.decoding()` for generation. It never changes the maths.
  layout: Layout = TRAINING

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"model_type={self.architecture!r} is not supported; "
                       f"supported: {SUPPORTED_ARCHITECTURES}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings"):
      check_positive_int(key, getattr(self, key))
    for key in ("rope_theta", "rms_norm_eps"):
      check_positive_number(key, getattr(self, key))
    for key in ("tie_word_embeddings", "qkv_bias", "lora_update_f32"):
      check_bool(key, getattr(self, key))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_attention_heads={self.num_heads} is not a multiple of "
          f"num_key_value_heads={self.num_kv_heads}")
    if not isinstance(self.layout, Layout):
      raise ValueError(f"layout={self.layout!r}: must be a models.layout.Layout")
    if not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling={self.rope_scaling!r}: must be a RopeScaling")
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

    Absent optional keys take transformers' defaults (`num_key_value_heads`: the query heads,
    `head_dim`: `hidden_size // num_attention_heads`, ...); present ones must be valid: a size
    is a positive int (not `"64"`, `64.0` or `0`), a rate a finite positive number, a flag a bool.

    Args:
      hf: the parsed JSON.
      source: where it came from, named in error messages.
      **overrides: fields to set on top (e.g. `param_dtype="bfloat16"`).
    Raises:
      ValueError naming `source` and the offending key (`config.json: num_key_value_heads=0:
      must be a positive int`).
    """
    def get(key, check=check_positive_int, default=None):
      value = hf.get(key)
      if value is None:
        if default is None:
          raise ValueError(f"{source}: missing key {key!r}")
        return default
      check(f"{source}: {key}", value)
      return value

    arch = hf.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"{source}: model_type={arch!r} is not supported; "
                       f"supported: {SUPPORTED_ARCHITECTURES}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if get("mlp_bias", check_bool, False):
      raise ValueError(f"{source}: mlp_bias=true is not supported")
    if arch == "qwen2" and get("use_sliding_window", check_bool, False):
      # Every released Qwen2/2.5 checkpoint ships with it off; attending fully would be wrong.
      raise ValueError(f"{source}: use_sliding_window=true is not supported")
    num_heads = get("num_attention_heads")
    hidden = get("hidden_size")
    rope_theta, scaling = _read_rope(hf, source)
    fields = dict(
        architecture=arch,
        vocab_size=get("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size"),
        num_layers=get("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=get("num_key_value_heads", default=num_heads),
        head_dim=get("head_dim", default=hidden // num_heads),
        max_position_embeddings=get("max_position_embeddings",
                                    default=cls.max_position_embeddings),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=get("rms_norm_eps", check_positive_number, 1e-6),
        tie_word_embeddings=get("tie_word_embeddings", check_bool, False),
        qkv_bias=arch == "qwen2" or get("attention_bias", check_bool, False),
    )
    fields.update(overrides)
    try:
      return cls(**fields)
    except ValueError as e:
      raise ValueError(f"{source}: {e}") from None


def _read_rope(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling]:
  """Reads theta and scaling from v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`)."""
  params: dict[str, tuple[str, Any]] = {}  # name -> (the key it came from, value)
  for key in ("rope_scaling", "rope_parameters"):
    value = hf.get(key) or {}
    if not isinstance(value, Mapping):
      raise ValueError(f"{source}: {key}={value!r}: must be an object")
    params.update({name: (f"{key}.{name}", v) for name, v in value.items()})
  theta_key, theta = params.pop("rope_theta", ("rope_theta", hf.get("rope_theta", 10000.0)))
  check_positive_number(f"{source}: {theta_key}", theta)
  _, rope_type = params.get("rope_type", params.get("type", (None, "default")))
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(f"{source}: rope_scaling.rope_type={rope_type!r} is not supported; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")
  checks = {"factor": check_positive_number, "low_freq_factor": check_positive_number,
            "high_freq_factor": check_positive_number,
            "original_max_position_embeddings": check_positive_int}
  values = {}
  for name, check in checks.items():
    if name in params:
      key, values[name] = params[name]
      check(f"{source}: {key}", values[name])
  try:
    return float(theta), RopeScaling(rope_type=rope_type, **values)
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
  """A ≈0.2 M-parameter config for unit tests."""
  fields = dict(architecture=architecture, vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                qkv_bias=architecture == "qwen2", tie_word_embeddings=architecture == "llama",
                rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512)
  fields.update(overrides)
  return ModelConfig(**fields)

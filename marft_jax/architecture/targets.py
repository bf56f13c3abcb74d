"""Every named weight of a decoder layer in one table: sizes, checkpoint names, sharding axes.

The parameter initialiser, both checkpoint loaders, LoRA (its targets and PEFT keys), the
sharding rules and the benchmarks all read the names from here, so a new projection (or a
model family that names one differently) is one row.

A linear layer's sizes follow from its logical axes (`feature_size`): "embed" is the model
width D, "heads" the query width H·E, "kv_heads" the key/value width K·E, "mlp" the MLP width
F. This module imports nothing but the config (`marft_jax.architecture`: the layer under
`models`, `lora` and `sharding`).
"""

from __future__ import annotations

import dataclasses

from marft_jax.architecture.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Linear:
  """One projection of a decoder layer (`params["layers"][name]`: a kernel, maybe a bias)."""

  name: str  # our key, e.g. "q_proj"
  hf_module: str  # its module path inside a Hugging Face decoder layer
  gguf_name: str  # its tensor name inside a GGUF block `blk.{i}`
  in_axis: str  # logical axis of its input features (sharding and size)
  out_axis: str  # logical axis of its output features
  qkv: bool = False  # carries a bias when `config.qkv_bias` (Qwen2)

  def shape(self, config: ModelConfig) -> tuple[int, int]:
    """(in, out) features."""
    return feature_size(config, self.in_axis), feature_size(config, self.out_axis)


@dataclasses.dataclass(frozen=True)
class Norm:
  """One RMSNorm weight of a decoder layer (`params["layers"][name]`: [D])."""

  name: str
  hf_module: str
  gguf_name: str


LINEARS = (
    Linear("q_proj", "self_attn.q_proj", "attn_q", "embed", "heads", qkv=True),
    Linear("k_proj", "self_attn.k_proj", "attn_k", "embed", "kv_heads", qkv=True),
    Linear("v_proj", "self_attn.v_proj", "attn_v", "embed", "kv_heads", qkv=True),
    Linear("o_proj", "self_attn.o_proj", "attn_output", "heads", "embed"),
    Linear("gate_proj", "mlp.gate_proj", "ffn_gate", "embed", "mlp"),
    Linear("up_proj", "mlp.up_proj", "ffn_up", "embed", "mlp"),
    Linear("down_proj", "mlp.down_proj", "ffn_down", "mlp", "embed"),
)
NORMS = (
    Norm("input_norm", "input_layernorm", "attn_norm"),
    Norm("post_attention_norm", "post_attention_layernorm", "ffn_norm"),
)
# Tensors outside the layers: our key -> (Hugging Face name, GGUF name, logical axes).
GLOBALS = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight", ("vocab", "embed")),
    "final_norm": ("model.norm.weight", "output_norm.weight", (None,)),
    "lm_head": ("lm_head.weight", "output.weight", ("embed", "vocab")),  # untied models only
}

LINEAR = {linear.name: linear for linear in LINEARS}
LINEAR_TARGETS = tuple(LINEAR)  # the canonical order: q, k, v, o, gate, up, down
ATTENTION_TARGETS = tuple(t.name for t in LINEARS if t.hf_module.startswith("self_attn."))
MLP_TARGETS = tuple(t.name for t in LINEARS if t.hf_module.startswith("mlp."))


def feature_size(config: ModelConfig, axis: str) -> int:
  """The size of a linear layer's feature axis, by its logical name."""
  sizes = {"embed": config.hidden_size, "heads": config.num_heads * config.head_dim,
           "kv_heads": config.num_kv_heads * config.head_dim, "mlp": config.intermediate_size}
  return sizes[axis]


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
  """(in, out) features of every target linear layer, in canonical order."""
  return {linear.name: linear.shape(config) for linear in LINEARS}


def hf_module_path(target: str, layer: int) -> str:
  """`("q_proj", 3)` -> `"model.layers.3.self_attn.q_proj"`."""
  return f"model.layers.{layer}.{LINEAR[target].hf_module}"

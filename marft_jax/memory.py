"""How many bytes a MARFT run keeps on each device: size a mesh before renting it.

  params     the frozen base in its dtype, split by the sharding rules: the model width D over
             fsdp; heads, kv heads, MLP width and vocab over tensor
  adapters   f32 LoRA factors of every adapter (A of them), split like their base kernels
  optimizer  AdamW's two f32 moments per adapter factor (a few scalar counters left out)
  critic     the value head's f32 MLP kernels (replicated) and their two Adam moments
  kv_cache   one agent turn's KV cache: rows x slots, rows split over data x fsdp and kv
             heads over tensor. Agents take turns, so one turn's cache is alive at a time
             (a shared stream keeps one cache per episode that grows turn by turn)
  sampler_params  the sampler's copy of the base in its decoding layout
             (`build.model.rollout_model`: `model.rollout_layout` "auto" converts on CPU, GPU
             and TPU alike), split as `params` is; 0 with `model.rollout_layout="training"`,
             where the sampler reads the learner's weights

A dimension that its mesh axes do not divide is replicated, as in `marft_jax.sharding`.
With `mesh.sampler_devices` = n the learner's devices hold no `sampler_params`
(`sampler_copy=False` sizes them; a held-out evaluation there converts the base for its own
call, a copy and a turn's cache while it runs), and the sampler's n devices hold a whole
copy (replicated, `async_rollout.place_weights`), the adapters' versions and a turn's cache:
size those with data = n.
Not modelled: the update's activations (one minibatch's forward and backward; set
`model.remat` or raise `optimizer.minibatches` if they dominate).
tests/test_memory.py checks every line against the arrays a tiny run actually allocates.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from marft_jax.models.config import ModelConfig
from marft_jax.models.targets import LINEARS


def _split(size: int, ways: int) -> int:
  return size // ways if size % ways == 0 else size


def per_device_bytes(config: ModelConfig, *, data: int = 1, fsdp: int = 1, tensor: int = 1,
                     lora_rank: int, lora_targets: Sequence[str], num_adapters: int,
                     critic_hidden: Sequence[int] = (), critic_heads: int = 1,
                     kv_rows: int = 0, kv_slots: int = 0,
                     sampler_copy: bool = True) -> dict[str, int]:
  """Bytes per device of each part of a run (module docstring), and their "total".

  Args:
    config: the base model (its `param_dtype` for the weights, `dtype` for the cache).
    data, fsdp, tensor: the mesh's sizes.
    lora_rank, lora_targets, num_adapters: R, the adapted projections, A.
    critic_hidden: the critic head's hidden widths (() : no critic); critic_heads: 1, or the
      number of agents with one head each.
    kv_rows, kv_slots: one agent turn's cache: rows (environments x parallel agents) and
      slots (prompt + new tokens, bucketed).
    sampler_copy: the sampler runs its own copy of the base (`model.rollout_layout` "auto"
      or "decoding"); False for "training".
  """
  width = {"embed": fsdp, "heads": tensor, "kv_heads": tensor, "mlp": tensor, "vocab": tensor}
  sizes = {"embed": config.hidden_size, "heads": config.num_heads * config.head_dim,
           "kv_heads": config.num_kv_heads * config.head_dim, "mlp": config.intermediate_size,
           "vocab": config.vocab_size}
  part = lambda axis: _split(sizes[axis], width[axis])
  L, D = config.num_layers, config.hidden_size

  weights = part("vocab") * part("embed") + D + 2 * L * D  # embedding, final and layer norms
  if not config.tie_word_embeddings:
    weights += part("embed") * part("vocab")
  for linear in LINEARS:
    weights += L * part(linear.in_axis) * part(linear.out_axis)
    if linear.qkv and config.qkv_bias:
      weights += L * part(linear.out_axis)
  params = weights * np.dtype(config.param_dtype).itemsize

  targets = {linear.name: linear for linear in LINEARS}
  factors = sum(L * num_adapters * lora_rank * (part(targets[name].in_axis) +
                                                part(targets[name].out_axis))
                for name in lora_targets)
  adapters = 4 * factors

  widths = (D, *critic_hidden, 1) if critic_hidden else ()
  critic = 4 * critic_heads * sum(a * b for a, b in zip(widths[:-1], widths[1:]))

  rows = _split(kv_rows, data * fsdp)
  kv_heads = _split(config.num_kv_heads, tensor)
  kv_cache = (2 * L * rows * kv_heads * config.head_dim * kv_slots *
              np.dtype(config.dtype).itemsize + rows * kv_slots)  # keys, values; valid (bool)

  out = {"params": params, "adapters": adapters, "optimizer": 2 * adapters + 2 * critic,
         "critic": critic, "kv_cache": kv_cache,
         "sampler_params": params if sampler_copy else 0}
  out["total"] = sum(out.values())
  return out

"""Folding one adapter into the base kernels, and taking it back out.

A merged model runs at the base model's cost (no LoRA branch): the fast path for single-agent
inference. Base parameter paths never move; only the target kernels change::

    merged = merge_adapter(params, adapters, index=2)
    merged["layers"]["q_proj"]["kernel"]   # [L, D, H*E] = kernel + scale * a[:, 2] @ b[:, 2]
    unmerge_adapter(merged, adapters, index=2)   # the original kernels, to float rounding
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.lora.routing import Adapters


def adapter_kernel_deltas(adapters: Adapters, index: int) -> dict[str, jax.Array]:
  """ΔW = scale · a[:, index] @ b[:, index] per target: {name: [L, D_in, D_out]} in float32."""
  return {name: adapters.scale * jnp.einsum("lir,lro->lio", w["a"][:, index], w["b"][:, index],
                                            precision=jax.lax.Precision.HIGHEST)
          for name, w in adapters.layers.items()}


def merge_adapter(params: dict, adapters: Adapters, index: int = 0) -> dict:
  """The base tree with adapter `index` added into its target kernels (in the kernels' dtype)."""
  return _shift_kernels(params, adapter_kernel_deltas(adapters, index), sign=1.0)


def unmerge_adapter(params: dict, adapters: Adapters, index: int = 0) -> dict:
  """Inverse of `merge_adapter`: subtracts adapter `index` from the target kernels."""
  return _shift_kernels(params, adapter_kernel_deltas(adapters, index), sign=-1.0)


def _shift_kernels(params, deltas, sign):
  layers = dict(params["layers"])
  for name, delta in deltas.items():
    kernel = layers[name]["kernel"]
    # The sum is formed in float32 so that a bfloat16 base loses only the final rounding.
    shifted = kernel.astype(jnp.float32) + sign * delta
    layers[name] = dict(layers[name], kernel=shifted.astype(kernel.dtype))
  return dict(params, layers=layers)

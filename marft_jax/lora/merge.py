"""Folding one adapter into the base kernels, and taking it back out.

A merged model runs at the base model's cost (no LoRA branch): the fast path for single-agent
inference (the sampler merges a call's one adapter this way, see `sampler.generate`). Base
parameter paths never move; only the target kernels change::

    merged = merge_adapter(params, adapters, index=2)
    merged["layers"]["q_proj"]["kernel"]   # [L, D, H*E] = kernel + scale * a[:, 2] @ b[:, 2]
    unmerge_adapter(merged, adapters, index=2)   # the original kernels, to float rounding

Params in any `layout.Layout` are accepted (pass it): a layer list (unrolled) gets layer l's
slice of the delta, feature-major kernels [out, in] its transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from marft_jax.lora.routing import Adapters, check_adapter_index
from marft_jax.architecture.layout import TRAINING, Layout


def adapter_kernel_deltas(adapters: Adapters, index: int) -> dict[str, jax.Array]:
  """ΔW = scale · a[:, index] @ b[:, index] per target: {name: [L, D_in, D_out]} in float32.
  `index` (a Python int in [0, A)) is checked: a JAX index would clamp to another adapter."""
  check_adapter_index(index, adapters.num_adapters)
  return {name: adapters.scale * jnp.einsum("lir,lro->lio", w["a"][:, index], w["b"][:, index],
                                            precision=jax.lax.Precision.HIGHEST)
          for name, w in adapters.layers.items()}


def merge_adapter(params: dict, adapters: Adapters, index: int = 0,
                  layout: Layout = TRAINING) -> dict:
  """The base tree (in `layout`) with adapter `index` added into its target kernels, in the
  kernels' dtype. A bfloat16 base loses every part of the delta below its rounding: merge
  into float32 weights when the merged model must equal the routed one."""
  return _shift_kernels(params, adapter_kernel_deltas(adapters, index), 1.0, layout)


def unmerge_adapter(params: dict, adapters: Adapters, index: int = 0,
                    layout: Layout = TRAINING) -> dict:
  """Inverse of `merge_adapter`: subtracts adapter `index` from the target kernels."""
  return _shift_kernels(params, adapter_kernel_deltas(adapters, index), -1.0, layout)


def _shift_kernels(params, deltas, sign, layout):
  if layout.feature_major:  # kernels [out, in]
    deltas = {name: jnp.swapaxes(delta, -1, -2) for name, delta in deltas.items()}

  def shift(layer, layer_deltas):
    layer = dict(layer)
    for name, delta in layer_deltas.items():
      kernel = layer[name]["kernel"]
      if jnp.shape(delta) != jnp.shape(kernel):  # a broadcast would merge a wrong model
        raise ValueError(f"adapters: {name}'s update has shape {jnp.shape(delta)} but the "
                         f"kernel {jnp.shape(kernel)}: adapters of another model or layout")
      # The sum is formed in float32 so that a bfloat16 base loses only the final rounding.
      shifted = kernel.astype(jnp.float32) + sign * delta
      layer[name] = dict(layer[name], kernel=shifted.astype(kernel.dtype))
    return layer

  if layout.scan_layers:
    return dict(params, layers=shift(params["layers"], deltas))
  for name, delta in deltas.items():  # delta[i] past the end would clamp to the last layer
    if jnp.shape(delta)[0] != len(params["layers"]):
      raise ValueError(f"adapters: {name} has {jnp.shape(delta)[0]} layers but the params "
                       f"hold {len(params['layers'])}: adapters of another model")
  layers = [shift(layer, {name: delta[i] for name, delta in deltas.items()})
            for i, layer in enumerate(params["layers"])]
  return dict(params, layers=layers)

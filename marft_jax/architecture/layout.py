"""`Layout`: how the decoder's weights are stored and its layers run. The maths never changes.

Two storage choices, measured on SmolLM2-135M decoding on XLA:CPU (2 cores, ms per decode step,
SmolLM2 shape, 192-slot cache; `bench/decode.py` has the end-to-end figures):

  scan_layers    True: weights stacked on a leading [L] axis, one layer compiled and run
                 under `lax.scan` (compiles in ~2 s for any depth; the training default).
                 False: a list of per-layer weights and caches, run by an unrolled Python
                 loop. The scan copies each layer's weights out of the stack before its
                 matmuls (a dynamic slice is not fused into a dot), as much traffic as the
                 matmuls themselves: unrolling took batch 1 from 39 to 29 ms a step and
                 batch 16 from 132 to 108 ms, for a ~10 s longer compile.
  feature_major  False: activations [B, T, D], kernels [in, out] (x @ W).
                 True: activations [D, N] (N = B·T), kernels [out, in] (W @ x). With few
                 tokens a matmul runs faster with the weight on the left; keeping whole
                 layers feature-major (transposing only around attention) took batch 16
                 from 102-108 to 81 ms a step; batch 1 is memory-bound and does not change.
                 Transposing a token-major layer's matmul outputs instead was slower (126).

  remat          True: each layer's activations are recomputed in the backward pass instead
                 of stored (`jax.checkpoint` around the layer: only its input is kept).
                 The update's activation memory drops from every layer's intermediates to
                 one [B, T, D] per layer, for about one more forward of compute. No effect
                 without a gradient (the sampler). For long rows, many rows or big models.
                 Scanned layers only: unrolled, XLA hoisted the recomputation and saved
                 nothing.

Other ingredients of the old decode-only module were measured and dropped: a heads-first,
keys-transposed cache and reading the cache before writing it gave nothing measurable once
the layers were unrolled (within the ±5 % noise of this host).

On a GPU (one NVIDIA H200, JAX 0.11.2, bf16, random weights of the Qwen2.5-1.5B shape, 64-token
prompts + 128 new tokens; docs/scaling.md) unrolled layers decoded 380 tok/s at batch 1 and
6,653 at batch 16 against 238 and 3,777 scanned: 1.6-1.8x, for the same reason as on CPU
(the scan's per-layer weight slices are copies, and decoding is bound by reading weights).
Those runs were token-major (`bench.decode --noscan_layers` keeps the GPU default's
activations); feature-major was not measured there. Token-major is what GPU
matmul libraries and XLA:GPU's fusions are tuned for ([tokens, in] @ [in, out] with the
weight on the right); the weight-on-the-left gain above is an XLA:CPU effect.

`TRAINING` is what the loaders return and what gradients are taken through; `decoding()` is
the platform default for generation, chosen by `jax.default_backend()`:
  cpu      `DECODING` (unrolled, feature-major: the CPU measurements above);
  gpu      `DECODING_ACCELERATOR` (unrolled, token-major: measured, see above);
  tpu      `DECODING_ACCELERATOR` too, unmeasured: a TPU decode step is as bound by reading
           the weights as a GPU's, unrolling removes the per-layer weight slices whatever
           the compiler makes of them, and the matrix units take the token-major
           [tokens, in] @ [in, out] form directly;
  other    `TRAINING` (nothing measured).
Unrolled costs a longer compile (one program per layer) and, beside the training layout's
weights, a second copy of the base (the sampler's, made once per run by `convert_params`).
`convert_params` and `convert_cache` move between any two layouts (copies: do it once).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the decoder's weights (and KV cache) are stored and its layers run."""

  scan_layers: bool = True  # stacked [L, ...] weights under lax.scan; False: unrolled loop
  feature_major: bool = False  # activations [D, N] and kernels [out, in]
  remat: bool = False  # recompute each layer's activations in the backward pass

  def __post_init__(self):
    for key in ("scan_layers", "feature_major", "remat"):
      if not isinstance(getattr(self, key), bool):
        raise ValueError(f"layout.{key}={getattr(self, key)!r}: must be true or false")
    if self.remat and not self.scan_layers:
      # Measured: XLA schedules an unrolled stack's recomputations early, and the compiled
      # backward kept more temporaries than without remat.
      raise ValueError("layout.remat=True needs layout.scan_layers=True (unrolled layers "
                       "are for decoding, which takes no gradient)")


TRAINING = Layout(scan_layers=True, feature_major=False)
DECODING = Layout(scan_layers=False, feature_major=True)
DECODING_ACCELERATOR = Layout(scan_layers=False, feature_major=False)


def decoding() -> Layout:
  """The platform default layout for generation (module docstring): `DECODING` on CPU,
  `DECODING_ACCELERATOR` on GPU and TPU, `TRAINING` on any other backend."""
  backend = jax.default_backend()
  if backend == "cpu":
    return DECODING
  return DECODING_ACCELERATOR if backend in ("gpu", "tpu") else TRAINING


def convert_params(params: dict, src: Layout, dst: Layout) -> dict:
  """The same weights in layout `dst` (a copy, made eagerly; do it once, outside `jit`).

  Only `params["layers"]` and `lm_head` change: the layer list is stacked or split, kernels
  are transposed between [in, out] and [out, in]. Converting back gives the original tree.
  """
  if src == dst:
    return params
  layers = params["layers"]
  if not src.scan_layers:
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  if src.feature_major != dst.feature_major:
    layers = {name: (dict(p, kernel=jnp.swapaxes(p["kernel"], -1, -2)) if isinstance(p, dict)
                     else p) for name, p in layers.items()}
  if not dst.scan_layers:
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    layers = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)]
  out = dict(params, layers=layers)
  if "lm_head" in params and src.feature_major != dst.feature_major:
    out["lm_head"] = params["lm_head"].T
  return jax.block_until_ready(out)


def convert_cache(cache: Any, src: Layout, dst: Layout) -> Any:
  """A `transformer.KVCache` in layout `dst`: its per-layer keys and values stacked or split."""
  if src.scan_layers == dst.scan_layers:
    return cache
  if dst.scan_layers:
    return cache.replace(k=jnp.stack(cache.k), v=jnp.stack(cache.v))
  return cache.replace(k=list(cache.k), v=list(cache.v))


def check_params_layout(params: dict, layout: Layout, config: Any) -> None:
  """Refuses params whose tree does not match `layout` (a layer list vs stacked layers, or a
  kernel the other way round): they would otherwise fail deep inside `jit`, or worse."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)) == layout.scan_layers:
    found = "a list of layers" if isinstance(layers, (list, tuple)) else "stacked layers"
    raise ValueError(f"params hold {found} but config.layout={layout} (convert them with "
                     "layout.convert_params)")
  down = (layers[0] if isinstance(layers, (list, tuple)) else layers)["down_proj"]["kernel"]
  num_layers = len(layers) if isinstance(layers, (list, tuple)) else np.shape(down)[0]
  if num_layers != config.num_layers:
    raise ValueError(f"params hold {num_layers} layers but config.num_layers="
                     f"{config.num_layers}: they belong to another model")
  embed = tuple(np.shape(params["embed"]))
  if embed != (config.vocab_size, config.hidden_size):
    raise ValueError(f"params' embed is {embed} but the config's vocab_size x hidden_size is "
                     f"{(config.vocab_size, config.hidden_size)}: they belong to another model")
  d, f = config.hidden_size, config.intermediate_size
  expected = (d, f) if layout.feature_major else (f, d)
  if d != f and tuple(np.shape(down))[-2:] != expected:
    raise ValueError(f"params' down_proj kernel is {tuple(np.shape(down))[-2:]}, but "
                     f"config.layout={layout} stores it as {expected} (convert_params)")

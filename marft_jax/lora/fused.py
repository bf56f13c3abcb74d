"""LoRA fused into the base model's matmuls: the training path's linear layers.

Linear layers that read the same input (q, k, v; gate, up) and their adapters' down
projections run as one matmul against the concatenated kernels,

    x @ [W_q | W_k | W_v | a_q | a_k | a_v],     a_t = [a_t[0] | ... | a_t[A-1]]  [D_in, A·R]

and each token keeps the R columns of its own adapter (a one-hot mask; none for id -1)
before the up projection `low_t @ b_t`. Every adapter's columns are computed for every token,
so this pays A LoRA down projections, but inside one large matmul: on XLA:CPU the skinny
[N, D_in] @ [D_in, R] products and the per-row gathers of the routed path (`routing.py`) cost
a SmolLM2-135M update a fifth of its time (2 adapters, rank 16, 8 × 256 tokens).

The backward is written by hand (`jax.custom_vjp`) so that the input's gradient is again one
matmul, `[dy_q | dy_k | dy_v | dlow_q | ...] @ [W | a]ᵀ`, and no gradient of the frozen
kernels is formed unless one is asked for.

`use_fused` decides where it pays: the adapters' columns must add at most half to the group's
matmul (2 adapters of rank 16 add 10 % to SmolLM2's q, k, v).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

# The adapters' columns may add at most this share to a fused group's matmul.
MAX_ADDED_SHARE = 0.5


def use_fused(out_widths: Sequence[int], num_adapters: int, rank: int) -> bool:
  """Whether a group of linears with `out_widths` (those with an adapter) should fuse."""
  return num_adapters * rank * len(out_widths) <= MAX_ADDED_SHARE * sum(out_widths)


def adapter_select(adapter_ids: jax.Array, num_adapters: int, time: int,
                   dtype) -> jax.Array:
  """[B·T, A] one-hot of each token's adapter (all zero for -1 or an id out of range).

  Args:
    adapter_ids: [B] per-sequence or [B, T] per-token ids.
  """
  onehot = jax.nn.one_hot(adapter_ids, num_adapters, dtype=dtype)  # out of range: zeros
  if adapter_ids.ndim == 1:
    onehot = jnp.broadcast_to(onehot[:, None], (adapter_ids.shape[0], time, num_adapters))
  return onehot.reshape(-1, num_adapters)


def fused_linears(inputs: Sequence[jax.Array], prologue: Callable[..., jax.Array],
                  kernels: Sequence[jax.Array],
                  factors: Sequence[Optional[tuple[jax.Array, jax.Array]]],
                  select: jax.Array, scale: float) -> tuple[jax.Array, ...]:
  """y_t = x @ W_t + scale · ((x @ a_t[i]) @ b_t[i]), i each token's adapter, for every t.

  x = prologue(*inputs): the cheap element-wise step before the matmul (an RMSNorm, the
  SwiGLU product, or the identity). The backward keeps `inputs` and recomputes x, where
  autodiff would keep x and the prologue's intermediates too: on a scanned stack each kept
  [N, D] is a stacked buffer XLA:CPU zero-fills, writes and reads back.

  Args:
    inputs: the prologue's arguments (token arrays [..., D] and weights).
    prologue: static; `prologue(*inputs)` -> x [..., D_in], N tokens in its leading axes.
    kernels: per linear t, W_t [D_in, D_out_t].
    factors: per linear t, (a [A, D_in, R], b [A, R, D_out_t]) or None (no adapter).
    select: [N, A] each token's adapter as a one-hot row (`adapter_select`).
    scale: the LoRA scale.
  Returns:
    per linear t, [N, D_out_t] in x's dtype.
  """
  return _fused(prologue, scale, tuple(inputs), tuple(kernels), tuple(factors), select)


def _flat_down(a: jax.Array) -> jax.Array:
  """[A, D_in, R] -> [D_in, A·R], adapter-major columns."""
  A, d_in, R = a.shape
  return jnp.transpose(a, (1, 0, 2)).reshape(d_in, A * R)


def _columns(kernels, factors, dtype):
  """The concatenated right-hand side [D_in, Σ D_out + Σ A·R] and each part's width."""
  parts = [w.astype(dtype) for w in kernels]
  parts += [_flat_down(f[0]).astype(dtype) for f in factors if f is not None]
  return jnp.concatenate(parts, axis=1), [p.shape[1] for p in parts]


def _rank(factors) -> int:
  """R, shared by every adapter of a set (0 without any)."""
  return next((f[0].shape[-1] for f in factors if f is not None), 0)


def _token_columns(select, rank, scale, dtype):
  """[N, A·R]: scale on the columns of each token's adapter, 0 elsewhere."""
  return (jnp.repeat(select, rank, axis=1) * scale).astype(dtype)


def _forward(x, kernels, factors, select, scale):
  """(ys, masked low-rank outputs). In a lower precision than f32, the matmul accumulates
  and the adapters' update is added in f32, and each y is rounded once."""
  f32 = jnp.float32
  rhs, widths = _columns(kernels, factors, x.dtype)
  outs = jnp.split(jnp.matmul(x, rhs, preferred_element_type=f32), np.cumsum(widths)[:-1],
                   axis=1)
  ys, lows = outs[:len(kernels)], iter(outs[len(kernels):])
  columns = _token_columns(select, _rank(factors), scale, f32)  # [N, A·R]
  masked = []
  for t, f in enumerate(factors):
    if f is None:
      masked.append(None)
      continue
    b = f[1]
    low = next(lows) * columns
    ys[t] = ys[t] + low @ b.astype(f32).reshape(-1, b.shape[-1])
    masked.append(low.astype(x.dtype))
  return tuple(y.astype(x.dtype) for y in ys), masked


def _backward(x, kernels, factors, select, masked, d_ys, scale, kernel_grads):
  """(d_x, d_kernels, d_factors) of `_forward` at x, given its masked low-rank outputs;
  d_kernels[t] is None unless kernel_grads[t]."""
  columns = _token_columns(select, _rank(factors), scale, x.dtype)
  d_lows = [(dy @ f[1].astype(x.dtype).reshape(-1, f[1].shape[-1]).T) * columns  # [N, A·R]
            for f, dy in zip(factors, d_ys) if f is not None]
  # Every adapter's down projection reads the same x: one [D_in, N] @ [N, Σ A·R] product
  # reads it once (every A·R is equal: one adapter set).
  d_as = iter(jnp.split(x.T @ jnp.concatenate(d_lows, axis=1), len(d_lows), axis=1)
              if d_lows else [])
  d_factors = []
  for f, low, dy in zip(factors, masked, d_ys):
    if f is None:
      d_factors.append(None)
      continue
    a, b = f
    A, d_in, R = a.shape
    d_a = jnp.transpose(next(d_as).reshape(d_in, A, R), (1, 0, 2))
    d_b = (low.T @ dy).reshape(b.shape)
    d_factors.append((d_a.astype(a.dtype), d_b.astype(b.dtype)))
  rhs, _ = _columns(kernels, factors, x.dtype)
  d_x = jnp.concatenate(list(d_ys) + d_lows, axis=1) @ rhs.T
  d_kernels = tuple((x.T @ dy).astype(w.dtype) if wanted else None
                    for w, dy, wanted in zip(kernels, d_ys, kernel_grads))
  return d_x, d_kernels, tuple(d_factors)


def _tokens(prologue, inputs):
  x = prologue(*inputs)
  return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(prologue, scale, inputs, kernels, factors, select):
  return _forward(_tokens(prologue, inputs), kernels, factors, select, scale)[0]


def _fused_fwd(prologue, scale, inputs, kernels, factors, select):
  # With symbolic zeros every argument comes as a CustomVJPPrimal: its value, and whether
  # a gradient is wanted. The frozen kernels' gradients (a weight-sized matmul each) are
  # formed only when they are; which ones is recorded in the residuals' structure.
  wanted = tuple(jnp.zeros((0,)) if k.perturbed else None for k in kernels)
  inputs, kernels, factors, select = jax.tree.map(
      lambda p: p.value, (inputs, kernels, factors, select),
      is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
  ys, masked = _forward(_tokens(prologue, inputs), kernels, factors, select, scale)
  return ys, (inputs, kernels, factors, select, masked, wanted)


def _fused_bwd(prologue, scale, residuals, d_ys):
  inputs, kernels, factors, select, masked, wanted = residuals
  d_ys = [jnp.zeros(d.aval.shape, d.aval.dtype) if isinstance(d, SymbolicZero) else d
          for d in d_ys]
  x, prologue_vjp = jax.vjp(lambda *args: _tokens(prologue, args), *inputs)
  d_x, d_kernels, d_factors = _backward(x, kernels, factors, select, masked, d_ys, scale,
                                        [w is not None for w in wanted])
  return prologue_vjp(d_x), d_kernels, d_factors, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)

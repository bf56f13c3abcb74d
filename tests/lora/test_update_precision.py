"""A bf16 LoRA layer adds its adapter's update in f32 and rounds once, on every path.

`ModelConfig.lora_update_f32` (the default): a linear layer with an adapter, in bf16,
computes y = round_bf16(x @ W + scale · (x @ round_bf16(a)) @ b) + bias, the products of
bf16 operands accumulated in f32. The reference is that formula in float64 from the same
bf16 operands, rounded to bf16 once: the library's f32 accumulation may differ from it by
one rounding at a near tie, so each output is held to one bf16 ulp of it. Generated over the
routes a layer can take (one adapter, per-sequence ids, per-token ids, grouped per-token
ids; ids of -1 for the base), both activation orientations (token-major: the sampler on
accelerators, and the learner's routed layers under LoRA dropout; feature-major: the
sampler on CPU) and the fused training path (`lora.fused`), which must compute the same.
With the setting off (the code before it) the sampler's routed path rounds its factors,
x @ a and the update to bf16, and misses the reference by more (checked on one case).
"""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from marft_jax.lora import fused
from marft_jax.lora.routing import Adapters
from marft_jax.models import layout, transformer
from marft_jax.models.config import tiny_config

BF16 = jnp.bfloat16


def _case(seed, B, T, d_in, d_out, A, R, per_token, bias):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, d_in)), BF16)
  p = {"kernel": jnp.asarray(rng.normal(0, d_in ** -0.5, (d_in, d_out)), BF16)}
  if bias:
    p["bias"] = jnp.asarray(rng.normal(0, 0.1, d_out), BF16)
  adapter = {"a": jnp.asarray(rng.normal(0, 0.3, (A, d_in, R)), jnp.float32),
             "b": jnp.asarray(rng.normal(0, 0.3, (A, R, d_out)), jnp.float32)}
  ids = rng.integers(-1, A, (B, T) if per_token else B).astype(np.int32)
  return x, p, adapter, jnp.asarray(ids)


def _reference(x, p, adapter, ids, scale, magnitude=False):
  """[B, T, D_out] float64: the formula of the module docstring before its final rounding
  (the bias is added after it); `magnitude`: the same sum of the terms' absolute values."""
  f = np.abs if magnitude else (lambda v: v)
  x = f(np.asarray(x, np.float64))
  a = f(np.asarray(jnp.asarray(adapter["a"], BF16), np.float64))  # the down factor in bf16
  b = f(np.asarray(adapter["b"], np.float64))
  ids = np.broadcast_to(np.asarray(ids)[:, None] if np.ndim(ids) == 1 else ids, x.shape[:2])
  y = x @ f(np.asarray(p["kernel"], np.float64))
  for (i, t), k in np.ndenumerate(ids):
    if k >= 0:
      y[i, t] += scale * (x[i, t] @ a[k]) @ b[k]
  return y


def _round_bf16(y64, p):
  y = jnp.asarray(y64.astype(np.float32), BF16)
  return np.asarray(y + p["bias"][None, None] if "bias" in p else y, np.float32)


def _routed(x, p, adapter, ids, scale, feature_major, in_f32=True):
  """`transformer._dense` as a layer of that orientation runs it, [B, T, D_out] f32."""
  lay = layout.DECODING if feature_major else layout.TRAINING
  config = tiny_config(param_dtype="bfloat16", compute_dtype="bfloat16", layout=lay,
                       lora_update_f32=in_f32)
  B, T, _ = x.shape
  call = transformer._Call(positions=jnp.zeros((B, T), jnp.int32), allowed=None, valid=None,
                           adapter_ids=ids, select=None, config=config, lora_scale=scale,
                           lora_delta=Adapters(layers={}, scale=scale).delta_fn(feature_major))
  if not feature_major:
    return np.asarray(transformer._dense(x, p, adapter, call), np.float32)
  kernel = dict(p, kernel=p["kernel"].T)  # [out, in] in the feature-major layouts
  y = transformer._dense(x.reshape(B * T, -1).T, kernel, adapter, call)
  return np.asarray(y.T.reshape(B, T, -1), np.float32)


def _fused(x, p, adapter, ids, scale):
  B, T, _ = x.shape
  select = fused.adapter_select(ids, adapter["a"].shape[0], T, BF16)
  y = fused.fused_linears([x], lambda v: v, [p["kernel"]], [(adapter["a"], adapter["b"])],
                          select, scale)[0].reshape(B, T, -1)
  return np.asarray(y + p["bias"][None, None] if "bias" in p else y, np.float32)


def _ulps(got, want, magnitude=0.0):
  """|got − want| in units of bf16's spacing at want (both bf16 values, as f32), less what
  f32 accumulation may lose where the sum cancels: 2^-20 of its terms' `magnitude`, far
  below bf16's 2^-8."""
  exponent = np.floor(np.log2(np.maximum(np.abs(want), np.finfo(np.float32).tiny)))
  excess = np.maximum(np.abs(got - want) - 2.0 ** -20 * magnitude, 0.0)
  return excess / 2.0 ** (exponent - 7)


@settings(max_examples=24, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), B=st.integers(1, 3), T=st.integers(1, 5),
       d_in=st.sampled_from([8, 24, 64]), d_out=st.sampled_from([8, 40]),
       A=st.integers(1, 3), R=st.integers(1, 4), per_token=st.booleans(), bias=st.booleans(),
       scale=st.sampled_from([0.5, 2.0, 4.0]), feature_major=st.booleans())
def test_a_bf16_lora_layer_rounds_once_on_every_path(seed, B, T, d_in, d_out, A, R, per_token,
                                                     bias, scale, feature_major):
  x, p, adapter, ids = _case(seed, B, T, d_in, d_out, A, R, per_token, bias)
  want = _round_bf16(_reference(x, p, adapter, ids, scale), p)
  magnitude = _reference(x, p, adapter, ids, scale, magnitude=True)
  routed = _routed(x, p, adapter, ids, scale, feature_major)
  assert _ulps(routed, want, magnitude).max() <= 1.0, "routed"
  assert _ulps(_fused(x, p, adapter, ids, scale), want, magnitude).max() <= 1.0, "fused"


def test_without_it_the_routed_update_is_rounded_in_bf16():
  """The setting off: the reference is missed by more than the rounding it allows, in
  either orientation (what the test above would catch if the setting were ignored)."""
  x, p, adapter, ids = _case(0, 3, 5, 64, 40, 2, 4, per_token=True, bias=False)
  want = _round_bf16(_reference(x, p, adapter, ids, 2.0), p)
  for feature_major in (False, True):
    old = _routed(x, p, adapter, ids, 2.0, feature_major, in_f32=False)
    magnitude = _reference(x, p, adapter, ids, 2.0, magnitude=True)
    assert _ulps(old, want, magnitude).max() > 2.0, feature_major
    assert np.mean(old != want) > 0.1, feature_major

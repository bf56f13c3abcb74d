"""LoRA fused into the base matmuls (`lora.fused`): values against a per-token NumPy loop,
gradients against autodiff of the unfused formula, and whole models against the routed path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.lora import fused
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from tests.lora.conftest import random_adapters, random_params

SCALE = 1.5


def _problem(rng, ids):
  """x [N, 6] and three linears (widths 5, 3, 4; the middle one without an adapter)."""
  N, D, A, R = len(ids), 6, 3, 2
  x = rng.normal(size=(N, D)).astype(np.float32)
  norm = (1 + 0.1 * rng.normal(size=D)).astype(np.float32)
  kernels = [rng.normal(size=(D, w)).astype(np.float32) for w in (5, 3, 4)]
  factors = [tuple(rng.normal(size=s).astype(np.float32) for s in [(A, D, R), (A, R, w)])
             for w in (5, 4)]
  return x, norm, kernels, [factors[0], None, factors[1]], A


def _rms(x, w):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w[None, :]


def test_values_equal_a_per_token_loop():
  rng = np.random.default_rng(0)
  ids = np.array([0, 2, -1, 1, 1, 7, 0])  # -1 and 7 (out of range): no adapter
  x, norm, kernels, factors, A = _problem(rng, ids)
  select = fused.adapter_select(jnp.asarray(ids), A, 1, jnp.float32)
  ys = fused.fused_linears((x, norm), _rms, kernels, factors, select, SCALE)
  h = np.asarray(_rms(x, norm))
  for t, (w, f) in enumerate(zip(kernels, factors)):
    expected = h @ w
    for n, i in enumerate(ids):
      if f is not None and 0 <= i < A:
        expected[n] += SCALE * h[n] @ f[0][i] @ f[1][i]
    np.testing.assert_allclose(np.asarray(ys[t]), expected, atol=1e-5, err_msg=str(t))


def test_gradients_equal_autodiff_of_the_unfused_formula():
  """Every input's gradient, frozen kernels and the prologue's weight included."""
  rng = np.random.default_rng(1)
  ids = np.array([0, 2, -1, 1, 1, 0, 2, 2])
  x, norm, kernels, factors, A = _problem(rng, ids)
  select = fused.adapter_select(jnp.asarray(ids), A, 1, jnp.float32)
  weights = [jnp.asarray(rng.normal(size=(len(ids), w)), jnp.float32) for w in (5, 3, 4)]

  def unfused(x, norm, kernels, factors):
    h = _rms(x, norm)
    ys = []
    for w, f in zip(kernels, factors):
      y = h @ w
      if f is not None:
        low = jnp.einsum("nd,adr->nar", h, f[0])  # every adapter's down projection
        y = y + SCALE * jnp.einsum("nar,aro,na->no", low, f[1], select)
      ys.append(y)
    return ys

  def loss(fn):
    return lambda *args: sum(jnp.sum(w * jnp.sin(y)) for w, y in zip(weights, fn(*args)))

  ours = jax.grad(loss(lambda x, n, k, f: fused.fused_linears((x, n), _rms, k, f, select,
                                                              SCALE)), argnums=(0, 1, 2, 3))
  ref = jax.grad(loss(unfused), argnums=(0, 1, 2, 3))
  got, expected = ours(x, norm, kernels, factors), ref(x, norm, kernels, factors)
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, atol=1e-4 * np.abs(e).max()),
               got, expected)
  assert np.abs(expected[3][0][0]).max() > 0.1  # the adapters' gradients are not trivial


def test_use_fused_bounds_the_added_columns():
  assert fused.use_fused([576, 192, 192], num_adapters=2, rank=16)  # SmolLM2 q, k, v: +10 %
  assert fused.use_fused([576, 192, 192], num_adapters=8, rank=16)  # +40 %
  assert not fused.use_fused([576, 192, 192], num_adapters=16, rank=16)  # +80 %
  assert fused.use_fused([1536, 1536], num_adapters=8, rank=16)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("per_token", [False, True])
def test_model_gradients_equal_the_routed_path(architecture, per_token, monkeypatch):
  """Adapters' and base weights' gradients of a whole model, fused against routed (qwen2
  has q, k, v biases; llama a tied embedding), with a base-model row."""
  config = tiny_config(architecture)
  params = random_params(config)
  adapters = random_adapters(2, model_config=config)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 10)))
  ids = jnp.asarray(rng.integers(-1, 2, (3, 10)) if per_token else np.array([1, -1, 0]))
  weight = jnp.asarray(rng.normal(size=(3, 10, config.hidden_size)), jnp.float32)

  def grads():
    def loss(layers, params):
      h, _ = transformer.hidden_states(params, tokens, config,
                                       lora=adapters.replace(layers=layers), adapter_ids=ids)
      return jnp.sum(weight * jnp.sin(h))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(adapters.layers, params)

  fused_value, fused_grads = grads()
  monkeypatch.setattr(fused, "MAX_ADDED_SHARE", 0.0)  # every group takes the routed path
  value, expected = grads()
  np.testing.assert_allclose(fused_value, value, atol=1e-4)  # a sum of ~1000 terms
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, atol=2e-5 * np.abs(e).max()),
               fused_grads, expected)

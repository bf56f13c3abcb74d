"""Training attention's kernels: the hand-written CPU path ("reference") and the fused one
accelerators run (`jax.nn.dot_product_attention`; here with implementation "xla", which runs
on CPU), each against textbook attention in f32, values and gradients, with grouped-query
heads and causal masks with padding on the right, on the left and none (the fused path moves
each row's real tokens first, as it does for cuDNN, whose call differs only in its
`implementation` string; a non-causal mask goes to XLA's as a mask). A padding query
(no key allowed) has no textbook value: it is left out of the comparisons and of the loss,
as the trainer masks it; its output must only be finite.
"""

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.lora import LoraConfig, init_adapters
from marft_jax.models import layers, transformer
from marft_jax.models.config import tiny_config

K, G, T, E = 2, 3, 12, 8
# Real tokens per row: none padded, padded on the right, a hole in the middle, padded on the
# left.
REAL = np.array([[1] * 12, [1] * 7 + [0] * 5, [1] * 4 + [0] * 3 + [1] * 5, [0] * 3 + [1] * 9],
                bool)
B = len(REAL)


def _inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(B, K, G, T, E)), dtype)
  k = jnp.asarray(rng.normal(size=(B, K, T, E)), dtype)
  v = jnp.asarray(rng.normal(size=(B, K, T, E)), dtype)
  allowed = REAL[:, None, :] & np.tril(np.ones((T, T), bool))[None]
  weights = jnp.asarray(rng.normal(size=(B, K, G, T, E)), jnp.float32)  # the loss's
  return q, k, v, jnp.asarray(allowed), jnp.asarray(REAL), weights


def textbook(q, k, v, allowed):
  """softmax(q·kᵀ/√E, masked) · v per query head, kv head = head // G; f32. A row with no
  allowed key gets a uniform softmax (never read)."""
  scores = jnp.einsum("bkgte,bkse->bkgts", q, k) / math.sqrt(q.shape[-1])
  scores = jnp.where(allowed[:, None, None], scores, -1e30)
  return jnp.einsum("bkgts,bkse->bkgte", jax.nn.softmax(scores, axis=-1), v)


def _loss(fn, real, weights):
  """Σ over real queries of out · weights: the trainer's masked loss, in miniature."""
  return lambda q, k, v, allowed: jnp.sum(
      jnp.where(real[:, None, None, :, None], fn(q, k, v, allowed).astype(jnp.float32) * weights,
                0.0))


KERNEL_CASES = [("reference", 0), ("reference", 5), ("xla_fused", 5), ("xla_fused", 0)]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kernel, query_block", KERNEL_CASES)
def test_kernels_equal_textbook_attention_values_and_gradients(kernel, query_block, jit):
  q, k, v, allowed, real, weights = _inputs()
  ours = functools.partial(layers.attention, query_block=query_block, kernel=kernel)
  if jit:
    ours = jax.jit(ours)
  out = ours(q, k, v, allowed)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert np.all(np.isfinite(np.asarray(out)))
  select = np.broadcast_to(np.asarray(real)[:, None, None, :, None], out.shape)
  want = textbook(q, k, v, allowed)
  np.testing.assert_allclose(np.asarray(out)[select], np.asarray(want)[select], atol=1e-5,
                             rtol=1e-5)
  grads = jax.grad(_loss(ours, real, weights), argnums=(0, 1, 2))(q, k, v, allowed)
  want_grads = jax.grad(_loss(textbook, real, weights), argnums=(0, 1, 2))(q, k, v, allowed)
  for name, got, ref in zip("qkv", grads, want_grads):
    assert np.all(np.isfinite(np.asarray(got))), name
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-4,
                               err_msg=f"d{name}")


def _on_nvidia_gpu() -> bool:
  from jax.extend import backend as jex_backend  # pylint: disable=import-outside-toplevel
  return (jax.default_backend() == "gpu"
          and "cuda" in jex_backend.get_backend().platform_version.lower())


@pytest.mark.parametrize("kernel", ["xla_fused", "cudnn"])
def test_fused_kernel_in_bf16_stays_within_bf16_of_the_reference(kernel):
  """Values and gradients of the fused path in bf16 against the reference kernel in bf16 and
  against textbook attention in f32 (the reference's own bf16 error sets the tolerance).

  cuDNN's flash attention (16-bit, head dim a multiple of 8) exists only on NVIDIA GPUs: its
  case is the device check that runs where the suite runs on one (docs/scaling.md)."""
  if kernel == "cudnn" and not _on_nvidia_gpu():
    pytest.skip("cuDNN attention needs an NVIDIA GPU")
  q, k, v, allowed, real, weights = _inputs(jnp.bfloat16)
  fused, ref = (functools.partial(layers.attention, query_block=5, kernel=name)
                for name in (kernel, "reference"))
  out = fused(q, k, v, allowed)
  assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
  select = np.broadcast_to(np.asarray(real)[:, None, None, :, None], q.shape)
  exact = textbook(*(x.astype(jnp.float32) for x in (q, k, v)), allowed)
  for name, got in (("fused", out), ("reference", ref(q, k, v, allowed))):
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(exact))[select]
    assert diff.max() < 3e-2, (name, diff.max())

  grads = {name: jax.grad(_loss(fn, real, weights), argnums=(0, 1, 2))(q, k, v, allowed)
           for name, fn in (("fused", fused), ("reference", ref))}
  exact_grads = jax.grad(_loss(textbook, real, weights), argnums=(0, 1, 2))(
      *(x.astype(jnp.float32) for x in (q, k, v)), allowed)
  for i, axis in enumerate("qkv"):
    want = np.asarray(exact_grads[i])
    scale = float(np.abs(want).max())
    errors = {name: float(np.abs(np.asarray(g[i], np.float32) - want).max()) / scale
              for name, g in grads.items()}
    assert all(np.isfinite(e) for e in errors.values()), (axis, errors)
    # bf16 holds 8 bits of mantissa: both kernels' errors sit near 2^-8 of the gradient's scale.
    assert errors["fused"] < max(2 * errors["reference"], 2e-2), (axis, errors)


def test_the_model_trains_through_the_fused_kernel_as_through_the_reference(monkeypatch):
  """The tiny model's LoRA gradient of a masked loss (right-padded rows, as the trainer
  batches them) is the same through either kernel, in f32."""
  config = tiny_config()
  params = transformer.init_params(config, jax.random.key(0))
  lora = init_adapters(LoraConfig(rank=4, alpha=8.0), config, jax.random.key(1), 2)
  lora = lora.replace(layers=jax.tree.map(lambda x: x + 0.05, lora.layers))  # b ≠ 0
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (3, 16)))
  mask = jnp.asarray(np.arange(16)[None] < np.array([[16], [11], [6]]))
  ids = jnp.asarray([0, 1, 0])

  def grad(kernel):
    monkeypatch.setattr(layers, "self_attention_kernel", lambda *_: kernel)
    def loss(adapter_layers):
      logits, _ = transformer.forward(params, tokens, config, mask=mask,
                                      lora=lora.replace(layers=adapter_layers), adapter_ids=ids)
      logp = jax.nn.log_softmax(logits[:, :-1])
      picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      return -jnp.sum(jnp.where(mask[:, 1:], picked, 0.0))
    return jax.jit(jax.value_and_grad(loss))(lora.layers)

  (ref_loss, ref_grad), (fused_loss, fused_grad) = grad("reference"), grad("xla_fused")
  np.testing.assert_allclose(float(fused_loss), float(ref_loss), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, atol=1e-5 * max(float(np.abs(b).max()), 1.0), rtol=1e-4), fused_grad, ref_grad)


def _gpu(monkeypatch, backend, platform_version):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  from jax.extend import backend as jex_backend
  monkeypatch.setattr(jex_backend, "get_backend",
                      lambda *_: types.SimpleNamespace(platform_version=platform_version))


@pytest.mark.parametrize("backend, version, dtype, head_dim, expected", [
    ("cpu", "cpu", jnp.bfloat16, 64, "reference"),
    ("cpu", "cpu", jnp.float32, 64, "reference"),
    ("gpu", "PJRT C API\ncuda 13000", jnp.bfloat16, 64, "cudnn"),
    ("gpu", "PJRT C API\ncuda 13000", jnp.float16, 128, "cudnn"),
    ("gpu", "PJRT C API\ncuda 13000", jnp.float32, 64, "xla_fused"),  # cuDNN: 16-bit only
    ("gpu", "PJRT C API\ncuda 13000", jnp.bfloat16, 60, "xla_fused"),  # E % 8
    ("gpu", "PJRT C API\ncuda 13000", jnp.bfloat16, 192, "xla_fused"),  # E > 128
    ("gpu", "PJRT C API\nrocm 60000", jnp.bfloat16, 64, "xla_fused"),  # not NVIDIA
    ("tpu", "PJRT C API\ntpu", jnp.bfloat16, 128, "xla_fused"),
])
def test_auto_kernel_follows_the_platform(monkeypatch, backend, version, dtype, head_dim,
                                          expected):
  _gpu(monkeypatch, backend, version)
  assert layers.self_attention_kernel(dtype, head_dim) == expected


def test_an_unknown_kernel_is_refused_by_name():
  q, k, v, allowed, _, _ = _inputs()
  with pytest.raises(ValueError, match="kernel='flash'"):
    layers.attention(q, k, v, allowed, kernel="flash")

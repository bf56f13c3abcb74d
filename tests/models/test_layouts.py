"""One decoder, several ways to run it: every layout computes the same function.

Every pair of values of {Llama, Qwen2} × {f32, bf16} × {tied, untied} (four cases), each
with {no adapters, per-sequence ids, per-token ids} × {fresh cache, continued cache}, compares
the training layout (scanned, token-major) with the decoding layout (unrolled, feature-major) on
  * the logits of a forward that writes a cache (fresh: one 9-token chunk; continued: 5 + 4),
  * the cache each wrote (keys, values, valid slots, index),
  * and through the sampler: sampled tokens, their log-probs and the returned cache (the
    continued case switches every row to another adapter, so the cache mixes agents).
f32 agrees to float rounding. In bf16 each matmul's rounding depends on its orientation, so
the layouts agree to bf16 precision (logits within 2 % relative RMS), and their greedy tokens
are equal up to the first step where the two best logits are within that noise of each
other; both layouts' own sampled log-probs stay within bf16 noise of their teacher-forced ones.
"""

import functools

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.lora.routing import Adapters
from marft_jax.models import layout, sampler, transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.targets import linear_shapes

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs

LAYOUTS = (layout.TRAINING, layout.DECODING)
MODES = ("none", "per_sequence", "per_token")
B, T, N = 3, 9, 12
PROMPTS = np.random.default_rng(0).integers(0, 256, (B, T))
LENS = np.array([9, 4, 7])


def _adapters(config, num_adapters=2, rank=4):
  """Factors normal(0, 0.1), scale 2: each adapter's update is about half its layer's base
  output, so a wrong route moves the logits far beyond the tolerances. Drawn at 0.3 they
  outweighed the base several times, and the model's near-ties amplified every rounding:
  the f32 layouts then differed beyond 1e-5 on some seeds, bf16 beyond 10 %."""
  rng = np.random.default_rng(1)
  layers = {name: {"a": jnp.asarray(rng.normal(0, 0.1, (config.num_layers, num_adapters, i, rank)),
                                    jnp.float32),
                   "b": jnp.asarray(rng.normal(0, 0.1, (config.num_layers, num_adapters, rank, o)),
                                    jnp.float32)}
            for name, (i, o) in linear_shapes(config).items()}
  return Adapters(layers=layers, scale=2.0)


def _ids(mode):
  """(first chunk's ids, continuation's ids) for a LoRA mode: per row, or per token."""
  if mode == "per_sequence":
    return np.array([1, -1, 0]), np.array([0, 1, -1])
  per_token = np.array([[0] * 3 + [1] * 6, [-1] * 9, [1] * 5 + [0] * 4])
  return per_token, per_token[:, ::-1].copy()


@functools.partial(jax.jit, static_argnames="config")
def _forward_all(params, adapters, config):
  """{LoRA mode: (logits, cache)} of the prompts run as a 5-token chunk into a fresh 16-slot
  cache, then a 4-token chunk continuing it, for every LoRA mode: one compile per layout
  (compiling is most of this test's time)."""
  mask = jnp.arange(T)[None] < LENS[:, None]
  out = {}
  for mode in MODES:
    lora = None if mode == "none" else adapters
    ids = None if mode == "none" else jnp.asarray(_ids(mode)[0])
    cache, pieces = transformer.init_cache(config, B, 16), []
    for start, stop in ((0, 5), (5, T)):
      chunk_ids = ids if ids is None or ids.ndim == 1 else ids[:, start:stop]
      logits, cache = transformer.forward(params, jnp.asarray(PROMPTS[:, start:stop]), config,
                                          mask=mask[:, start:stop], cache=cache, lora=lora,
                                          adapter_ids=chunk_ids)
      pieces.append(logits)
    out[mode] = (jnp.concatenate(pieces, axis=1), cache)
  return out


def _random_params(config):
  """Weights normal(0, 0.1), norms 1 + normal(0, 0.1), drawn with NumPy (no per-shape
  compiles of JAX's PRNG)."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: transformer.init_params(config, jax.random.key(0)))
  draw = lambda path, x: jnp.asarray(("norm" in jax.tree_util.keystr(path))
                                     + 0.1 * rng.normal(size=x.shape), x.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def _stacked(cache):
  """A cache in the training layout's storage, as f32 arrays, to compare across layouts."""
  cache = layout.convert_cache(cache, layout.DECODING, layout.TRAINING)
  return jax.tree.map(lambda x: np.asarray(x, np.float32), cache)


def _real_slots(x, valid, slot_axis):
  """Cache keys [L, B, K, E, S] (slot_axis -1) or values [L, B, K, S, E] (-2), with the
  invalid slots zeroed."""
  shape = [1] * x.ndim
  shape[1], shape[slot_axis] = valid.shape
  return np.where(np.asarray(valid).reshape(shape), x, 0.0)


def _assert_close(a, b, bf16, what):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if bf16:
    # bf16 against the f32 model: measured up to 1.4 % relative RMS at these shapes, over
    # five seeds of the weights and adapters (the logits; every mode and layout). Adapters
    # drawn at 0.3 instead of 0.1 (`_adapters`) reached 12 % on one seed.
    rms = np.sqrt(np.mean((a - b) ** 2) / max(np.mean(b ** 2), 1e-12))
    assert rms < 0.04, f"{what}: relative RMS {rms}"
  else:  # f32 rounding, relative to the tensor's scale
    np.testing.assert_allclose(a, b, atol=1e-5 * max(np.abs(b).max(), 1.0), rtol=1e-5,
                               err_msg=what)


def _run_sampler(params, config, lora, ids, greedy):
  kw = dict(temperature=0.0 if greedy else 1.0, lora=lora)
  first = sampler.generate(params, PROMPTS, config, rng=jax.random.key(2), max_new_tokens=N,
                           prompt_lens=LENS, cache_size=96, adapter_ids=ids[0], **kw)
  second = sampler.generate(params, PROMPTS[:, ::-1], config, rng=jax.random.key(3),
                            max_new_tokens=N, prompt_lens=LENS, cache=first.cache,
                            adapter_ids=ids[1], **kw)
  return first, second


# Every pair of values of (architecture, dtype, tied embeddings) meets in one of these four
# cases (a covering array of strength 2). Each case compiles both layouts' forward and sampler,
# so the full 2 × 2 × 2 grid took twice as long for no pairing these lack; the
# architecture-specific parts (Qwen2's q/k/v biases, a tied or separate head) are per-layer
# code that does not interact with a third factor.
PAIRWISE_CASES = [("llama", "float32", True), ("llama", "bfloat16", False),
                  ("qwen2", "float32", False), ("qwen2", "bfloat16", True)]


@pytest.mark.parametrize("arch, dtype, tied", PAIRWISE_CASES,
                         ids=["-".join((a, d, "tied" if t else "untied"))
                              for a, d, t in PAIRWISE_CASES])
def test_layouts_compute_the_same_model(arch, dtype, tied):
  bf16 = dtype == "bfloat16"
  base = tiny_config(arch, tie_word_embeddings=tied, param_dtype=dtype, compute_dtype=dtype)
  params = _random_params(base)
  adapters = _adapters(base)
  configs = [base.replace(layout=lay) for lay in LAYOUTS]
  trees = [layout.convert_params(params, base.layout, lay) for lay in LAYOUTS]

  out_a, out_b = (_forward_all(p, adapters, c) for p, c in zip(trees, configs))
  pairs = [(out_b, out_a)]
  if bf16:
    # The layouts round differently (with LoRA the training layout fuses the adapters into
    # the base matmuls and adds their update in f32), so in bf16 each is held to the f32
    # model on the same weights rather than to the other.
    f32 = base.replace(param_dtype="float32", compute_dtype="float32")
    out_f32 = _forward_all(jax.tree.map(lambda x: x.astype(jnp.float32), params), adapters, f32)
    pairs = [(out_a, out_f32), (out_b, out_f32)]
  real = np.asarray(jnp.arange(T)[None] < LENS[:, None])
  for (got, want), mode in itertools.product(pairs, MODES):
    (logits, cache), (ref_logits, ref_cache) = got[mode], want[mode]
    for case, cols in (("fresh cache", slice(0, 5)), ("continued cache", slice(5, T))):
      _assert_close(np.asarray(logits)[:, cols][real[:, cols]],
                    np.asarray(ref_logits)[:, cols][real[:, cols]], bf16, f"{mode} {case}")
    what = f"{mode} cache"
    a, b = _stacked(ref_cache), _stacked(cache)
    np.testing.assert_array_equal(a.valid, b.valid)
    assert int(a.index) == int(b.index) == T
    # Only the real slots: a padding slot is never attended, and its query's rounding may
    # differ between the fused (training layout) and routed LoRA paths.
    _assert_close(_real_slots(b.k, a.valid, -1), _real_slots(a.k, a.valid, -1), bf16,
                  what + " keys")
    _assert_close(_real_slots(b.v, a.valid, -2), _real_slots(a.v, a.valid, -2), bf16,
                  what + " values")

  # The sampler takes one adapter id per row and call; rows with id -1 run the base model, and
  # the continuation switches every row to another adapter (so the cache mixes agents).
  ids = _ids("per_sequence")
  (a1, a2), (b1, b2) = (_run_sampler(p, c, adapters, ids, greedy=bf16)
                        for p, c in zip(trees, configs))
  if bf16:
    _assert_greedy_tokens_agree((a1, a2), (b1, b2), trees[0], configs[0], adapters, ids)
    return
  for a, b in ((a1, b1), (a2, b2)):
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=2e-5)
  ca, cb = _stacked(a2.cache), _stacked(b2.cache)
  np.testing.assert_array_equal(ca.valid, cb.valid)
  _assert_close(_real_slots(cb.k, ca.valid, -1), _real_slots(ca.k, ca.valid, -1), False,
                "sampler cache keys")
  _assert_close(_real_slots(cb.v, ca.valid, -2), _real_slots(ca.v, ca.valid, -2), False,
                "sampler cache values")


def _assert_greedy_tokens_agree(outs_a, outs_b, params, config, lora, ids):
  """Equal greedy tokens in both calls, except from a step where layout a's two candidates
  are within bf16 noise of each other (a near tie each layout may break its own way)."""
  for row in range(B):
    history, history_ids = [], []
    for call, (a, b) in enumerate(zip(outs_a, outs_b)):
      chunk = PROMPTS[row] if call == 0 else PROMPTS[row, ::-1]
      ta, tb = np.asarray(a.tokens[row]), np.asarray(b.tokens[row])
      n = int(a.lengths[row])
      adapter = int(ids[call][row])
      history += list(chunk[:LENS[row]])
      history_ids += [adapter] * int(LENS[row])
      differ = np.nonzero(ta[:n] != tb[:n])[0]
      if differ.size:
        step = int(differ[0])
        tokens, token_ids = history + list(ta[:step]), history_ids + [adapter] * step
        pad = 64 - len(tokens)  # one padded width: one compile for every near tie
        logits, _ = transformer.forward(
            params, jnp.asarray([tokens + [0] * pad]), config, lora=lora,
            mask=jnp.asarray([[True] * len(tokens) + [False] * pad]),
            adapter_ids=jnp.asarray([token_ids + [-1] * pad]))
        last = np.asarray(logits[0, len(tokens) - 1], np.float32)
        margin = abs(last[ta[step]] - last[tb[step]])
        assert margin < 0.05, f"row {row} call {call} step {step}: logit margin {margin}"
        break  # what follows a near tie is not comparable
      assert int(b.lengths[row]) == n
      history += list(ta[:n])
      history_ids += [adapter] * n


ALL_LAYOUTS = [layout.Layout(scan, fm) for scan in (True, False) for fm in (True, False)]


@pytest.mark.parametrize("dst", ALL_LAYOUTS, ids=str)
def test_converting_params_and_cache_round_trips_exactly(dst):
  config = tiny_config("qwen2", tie_word_embeddings=False)
  params = _random_params(config)
  there = layout.convert_params(params, config.layout, dst)
  back = layout.convert_params(there, dst, config.layout)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  assert isinstance(there["layers"], list) == (not dst.scan_layers)
  cache = transformer.init_cache(config, 2, 8)
  cache = cache.replace(k=cache.k + 1.0, v=cache.v - 1.0)
  round_trip = layout.convert_cache(layout.convert_cache(cache, config.layout, dst), dst,
                                    config.layout)
  jax.tree.map(np.testing.assert_array_equal, round_trip, cache)
  # A cache made in the destination layout has the converted cache's structure.
  made = transformer.init_cache(config.replace(layout=dst), 2, 8)
  converted = layout.convert_cache(cache, config.layout, dst)
  assert jax.tree.structure(made) == jax.tree.structure(converted)
  assert [x.shape for x in jax.tree.leaves(made)] == [x.shape for x in jax.tree.leaves(converted)]


def test_params_in_the_wrong_layout_are_refused_by_name():
  config = tiny_config()
  params = _random_params(config)
  tokens = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="list of layers|stacked layers"):
    transformer.forward(params, tokens, config.replace(layout=layout.DECODING))
  transposed = layout.convert_params(params, config.layout, layout.Layout(True, True))
  with pytest.raises(ValueError, match="down_proj kernel"):
    transformer.forward(transposed, tokens, config)
  with pytest.raises(ValueError, match="layout.scan_layers"):
    layout.Layout(scan_layers="yes")


def test_remat_gives_the_same_gradient_in_less_memory():
  """Rematerialised layers: the adapters' gradient of a loss equals the stored-activations
  one (to float rounding: the recomputed forward is the same maths), and the compiled
  backward keeps fewer bytes of temporaries alive."""
  base = tiny_config(num_layers=4)  # enough layers for the stored activations to dominate
  params = _random_params(base)
  adapters = _adapters(base)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (4, 64)))
  ids = jnp.asarray(np.repeat([[0], [1], [-1], [1]], 64, axis=1))
  probe = jnp.asarray(np.random.default_rng(3).normal(size=(4, 64, base.hidden_size)),
                      jnp.float32)

  def grad_fn(config):
    def loss(layers):
      h, _ = transformer.hidden_states(params, tokens, config,
                                       lora=adapters.replace(layers=layers), adapter_ids=ids)
      return jnp.vdot(probe, h)  # linear in h: no amplification of h's rounding (sin(h) had)
    return jax.jit(jax.grad(loss))

  stored, remat = grad_fn(base), grad_fn(base.replace(layout=layout.Layout(remat=True)))
  # Float rounding relative to each gradient's scale: the two compile the forward apart, and
  # how XLA fuses it depends on the host's vector ISA (2e-5 of the scale seen on one host; a
  # wrong recomputation is off by the order of the gradient itself).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max()),
               remat(adapters.layers), stored(adapters.layers))
  temp = lambda fn: fn.lower(adapters.layers).compile().memory_analysis().temp_size_in_bytes
  assert temp(remat) < 0.8 * temp(stored)
  with pytest.raises(ValueError, match="layout.remat"):
    layout.Layout(remat=1)
  with pytest.raises(ValueError, match="layout.remat=True needs layout.scan_layers"):
    layout.Layout(scan_layers=False, remat=True)


@pytest.mark.parametrize("backend, expected", [
    ("cpu", layout.DECODING), ("gpu", layout.DECODING_ACCELERATOR),
    ("tpu", layout.DECODING_ACCELERATOR), ("some_plugin", layout.TRAINING)])
def test_decoding_layout_follows_the_platform(monkeypatch, backend, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  assert layout.decoding() == expected
  # Measured on an H200: unrolled layers, token-major (layout's docstring).
  assert layout.DECODING_ACCELERATOR == layout.Layout(scan_layers=False, feature_major=False)


def test_the_accelerator_decoding_layout_computes_the_same_model():
  """Unrolled token-major layers (the GPU/TPU default) against the training layout, in f32:
  forward logits, cache and sampled tokens with per-row adapters."""
  base = tiny_config("qwen2", tie_word_embeddings=False)
  params, adapters = _random_params(base), _adapters(base)
  configs = [base.replace(layout=lay) for lay in (layout.TRAINING, layout.DECODING_ACCELERATOR)]
  trees = [layout.convert_params(params, base.layout, c.layout) for c in configs]
  want, got = (_forward_all(p, adapters, c) for p, c in zip(trees, configs))
  real = np.asarray(jnp.arange(T)[None] < LENS[:, None])
  for mode in MODES:
    _assert_close(np.asarray(got[mode][0])[real], np.asarray(want[mode][0])[real], False, mode)
    a, b = _stacked(want[mode][1]), _stacked(got[mode][1])
    _assert_close(_real_slots(b.k, a.valid, -1), _real_slots(a.k, a.valid, -1), False, mode)
  ids = _ids("per_sequence")
  (a1, a2), (b1, b2) = (_run_sampler(p, c, adapters, ids, greedy=False)
                        for p, c in zip(trees, configs))
  for a, b in ((a1, b1), (a2, b2)):
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(a.tokens))
    np.testing.assert_allclose(np.asarray(b.logprobs), np.asarray(a.logprobs), atol=2e-5)

"""The KV-cache sampler against uncached greedy decoding, teacher-forced log-probs and NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import compile_stats
from marft_jax.lora.routing import Adapters
from marft_jax.models import (layout, sampler, sampler_plan, targets, token_sampling,
                              transformer)
from marft_jax.models.config import tiny_config

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs

CONFIG = tiny_config()
V = CONFIG.vocab_size
LENS = np.array([11, 4, 7])  # real prompt tokens per row (bucket 16)
N = 12


@pytest.fixture(scope="module")
def params():
  # std 0.1 gives peaked, tie-free next-token distributions at the tiny model's width.
  return transformer.init_params(CONFIG, jax.random.key(0), std=0.1)


@pytest.fixture(scope="module")
def prompts():
  return np.random.default_rng(0).integers(0, V, size=(3, 13))


@jax.jit
def _forward(params, tokens, mask):
  return transformer.forward(params, tokens, CONFIG, mask=mask)[0]


def _padded(rows, width=32):
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for b, row in enumerate(rows):
    tokens[b, :len(row)], mask[b, :len(row)] = row, True
  return jnp.asarray(tokens), jnp.asarray(mask)


def _teacher_forced_logits(params, prompt_rows, out):
  """[B, N, V] logits of a plain forward over prompt + generated, at each generated token."""
  rows = [list(p) + list(np.asarray(t)[np.asarray(m)]) for p, t, m in
          zip(prompt_rows, out.tokens, out.mask)]
  logits = np.asarray(_forward(params, *_padded(rows)))
  n = out.tokens.shape[1]
  at = lambda b, p: np.stack([logits[b, min(p - 1 + i, logits.shape[1] - 1)] for i in range(n)])
  return np.stack([at(b, len(p)) for b, p in enumerate(prompt_rows)])


def _rows(prompts, lens=LENS):
  return [prompts[b, :n] for b, n in enumerate(lens)]


def _generate(params, prompts, lens=LENS, **kw):
  kw = {"max_new_tokens": N, "rng": jax.random.key(7), **kw}
  return sampler.generate(params, prompts, CONFIG, prompt_lens=lens, **kw)


def test_cached_greedy_equals_uncached_greedy(params, prompts):
  out = _generate(params, prompts, temperature=0.0)
  assert out.tokens.shape == (3, 16) and np.all(np.asarray(out.lengths) == N)
  for b, row in enumerate(_rows(prompts)):
    seq = list(row)
    for _ in range(N):  # argmax loop over the full forward, no cache
      logits = _forward(params, *_padded([seq]))
      seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    np.testing.assert_array_equal(np.asarray(out.tokens[b, :N]), seq[len(row):])


def test_temperature_one_logprobs_equal_teacher_forced_log_softmax(params, prompts):
  out = _generate(params, prompts, temperature=1.0)
  ref = jax.nn.log_softmax(_teacher_forced_logits(params, _rows(prompts), out), axis=-1)
  ref = np.take_along_axis(np.asarray(ref), np.asarray(out.tokens)[..., None], -1)[..., 0]
  m = np.asarray(out.mask)
  assert m.sum() == 3 * N
  np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref[m], atol=1e-5, rtol=0)


def _numpy_filtered_log_probs(logits, temperature, top_k, top_p):
  """Reference: sort, keep top-k, keep the smallest prefix with mass ≥ top_p, renormalise."""
  x = logits.astype(np.float64) / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(x.shape, bool)
  kept = order[:top_k] if top_k else order
  p = np.exp(x[kept] - x[kept].max())
  p /= p.sum()
  before = np.cumsum(p) - p
  keep[kept[before < top_p]] = True
  z = np.log(np.sum(np.exp(x[keep] - x.max()))) + x.max()
  return np.where(keep, x - z, -np.inf)


# top_p=1.0 (traced) shares a compile with top_p=0.7: one compile per top_k.
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 1.0), (0.9, 20, 0.7),
                                                    (1.3, None, 0.8)])
def test_filtered_logprobs_equal_numpy_reference(params, prompts, temperature, top_k, top_p):
  out = _generate(params, prompts, temperature=temperature, top_k=top_k, top_p=top_p)
  logits = _teacher_forced_logits(params, _rows(prompts), out)
  m = np.asarray(out.mask)
  for b, i in zip(*np.nonzero(m)):
    ref = _numpy_filtered_log_probs(logits[b, i], temperature, top_k, top_p)
    tok = int(out.tokens[b, i])
    assert np.isfinite(ref[tok]), "sampled a filtered-out token"
    assert abs(float(out.logprobs[b, i]) - ref[tok]) <= 1e-5
    assert np.isfinite(ref).sum() < V  # the filter removed something


def _chi_square_pvalue(tokens, log_probs):
  """Pearson's chi-square test of draws against a distribution (over its support). Tokens
  expected fewer than 5 times are pooled into one cell, as the test's chi-square
  approximation needs: one draw of a token expected 0.017 times alone gave p = 2e-6 for a
  correct sampler (the logits of `default_rng(5006)`), where the pooled test gives 0.1."""
  from scipy import stats
  support = np.isfinite(log_probs)
  counts = np.bincount(np.asarray(tokens), minlength=log_probs.size)
  if counts[~support].sum():
    return 0.0  # drew a token the filter removed
  counts = counts[support]
  expected = np.exp(log_probs[support])
  expected = expected / expected.sum() * counts.sum()
  rare = expected < 5
  if rare.any():
    counts = np.append(counts[~rare], counts[rare].sum())
    expected = np.append(expected[~rare], expected[rare].sum())
  return stats.chisquare(counts, expected).pvalue


@pytest.mark.parametrize("top_k", [None, 6])
def test_sample_tokens_frequencies_follow_filtered_distribution(top_k):
  """Chi-square over 32k draws (64 tokens): at this size sampling at temperature 1.05 instead
  of 1 gives p < 1e-15 (30 draws over 5 logit seeds and 6 keys: at most 5e-16, median
  3e-33), so the p > 1e-4 bar catches a temperature that is off by 5 %. (The p-values of
  correct draws over 8 keys were 0.001-0.99, pooled 0.2-0.3: uniform, no bias.)"""
  logits = np.random.default_rng(1).normal(size=64).astype(np.float32) * 2
  rows = 1 << 15
  tile = lambda x: jnp.tile(jnp.asarray(x, jnp.float32), (rows,) + (1,) * np.ndim(x))
  sample = jax.jit(token_sampling.sample_tokens, static_argnames=("top_k", "greedy"))
  for top_p in (1.0, 0.8):
    ref = _numpy_filtered_log_probs(logits, 1.0, top_k, top_p)
    tok, logprob = sample(jax.random.key(0), tile(logits), tile(1.0), tile(top_p), top_k=top_k)
    np.testing.assert_allclose(np.asarray(logprob), ref[np.asarray(tok)], atol=1e-5)
    assert _chi_square_pvalue(tok, ref) > 1e-4
    if top_k is None and top_p == 1.0:  # the test has the power to see a 5 % temperature error
      hot, _ = sample(jax.random.key(0), tile(logits), tile(1.05), tile(top_p), top_k=top_k)
      assert _chi_square_pvalue(hot, ref) < 1e-10


@pytest.mark.xla_cpu_numbers  # an H200's bf16 kernels put the ratio up to 0.035 from 1
def test_bfloat16_temperature_one_logprobs_make_the_first_ppo_ratio_one():
  """In bf16 the sampler's log-probs (training layout) equal the teacher-forced forward's to
  f32 rounding of the log-softmax, so PPO's first ratio exp(log π − log π_old) is 1."""
  from marft_jax import ppo
  bf16 = CONFIG.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                        transformer.init_params(CONFIG, jax.random.key(0), std=0.1))
  prompts = np.random.default_rng(0).integers(0, V, (3, 10))
  out = sampler.generate(params, prompts, bf16, rng=jax.random.key(1), max_new_tokens=N,
                         temperature=1.0)
  full = np.concatenate([prompts, np.asarray(out.tokens[:, :N])], axis=1)
  logits, _ = transformer.forward(params, jnp.asarray(full), bf16)
  logp, _ = ppo.logprobs_and_entropy(logits[:, 9:-1], jnp.asarray(full[:, 10:]),
                                     with_entropy=False)
  ratio = np.exp(np.asarray(logp) - np.asarray(out.logprobs[:, :N]))
  np.testing.assert_allclose(ratio, 1.0, atol=2e-6, rtol=0)


def test_sample_tokens_greedy_rows_take_the_argmax_with_the_model_logprob():
  logits = jax.random.normal(jax.random.key(5), (4, 300)) * 3
  temperature = jnp.array([0.0, 1.0, 0.0, 0.5])
  tok, logprob = token_sampling.sample_tokens(jax.random.key(6), logits, temperature)
  model = jax.nn.log_softmax(logits, axis=-1)
  for b in (0, 2):
    assert int(tok[b]) == int(jnp.argmax(logits[b]))
    np.testing.assert_allclose(float(logprob[b]), float(model[b, tok[b]]), atol=1e-5)
  np.testing.assert_allclose(float(logprob[1]), float(model[1, tok[1]]), atol=1e-5)
  all_greedy = token_sampling.sample_tokens(jax.random.key(6), logits, temperature, greedy=True)
  np.testing.assert_array_equal(np.asarray(all_greedy[0]), np.argmax(logits, axis=-1))
  np.testing.assert_allclose(np.asarray(all_greedy[1]), np.max(np.asarray(model), axis=-1),
                             atol=1e-5)


def test_padding_never_leaks(params, prompts):
  out = _generate(params, prompts, temperature=1.0)
  # Other rows' contents and lengths change, padding holds other ids: row 0 is unchanged.
  other = prompts.copy()
  other[1:] = np.random.default_rng(5).integers(0, V, size=other[1:].shape)
  changed = _generate(params, other, lens=np.array([11, 9, 2]), temperature=1.0)
  # Row 0 left-padded by 3 (a mask) instead of right-padded.
  shifted = np.zeros_like(prompts)
  shifted[0, 2:13] = prompts[0, :11]
  mask = np.arange(13)[None, :] < LENS[:, None]
  mask[0] = np.arange(13) >= 2
  left = sampler.generate(params, shifted, CONFIG, prompt_mask=mask, max_new_tokens=N,
                          rng=jax.random.key(7))
  for o in (changed, left):
    np.testing.assert_array_equal(np.asarray(o.tokens[0]), np.asarray(out.tokens[0]))
    np.testing.assert_allclose(np.asarray(o.logprobs[0]), np.asarray(out.logprobs[0]), atol=1e-5)


def test_same_key_same_output_different_key_differs(params, prompts):
  a, b = (_generate(params, prompts, temperature=1.0) for _ in range(2))
  c = _generate(params, prompts, temperature=1.0, rng=jax.random.key(8))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  assert np.any(np.asarray(a.tokens) != np.asarray(c.tokens))


def test_stop_tokens_and_max_new_tokens(params, prompts):
  free = np.asarray(_generate(params, prompts, temperature=0.0).tokens)
  eos = free[0, 3]  # row 0 stops at its first eos
  stop_ids = np.array([[-1], [free[1, 5]], [-1]])  # row 1 at its own stop id
  max_new = np.array([N, N, 4])  # row 2 after 4 tokens
  out = _generate(params, prompts, temperature=0.0, eos_ids=[eos], stop_ids=stop_ids,
                  max_new_tokens=max_new)
  first = lambda row, ids: int(np.nonzero(np.isin(row, ids))[0][0]) + 1
  expect = [first(free[0], [eos]), first(free[1], [eos, free[1, 5]]),
            min(4, first(np.append(free[2], eos), [eos]))]
  np.testing.assert_array_equal(np.asarray(out.lengths), expect)
  for b, n in enumerate(expect):
    np.testing.assert_array_equal(np.asarray(out.mask[b]), np.arange(16) < n)
    np.testing.assert_array_equal(np.asarray(out.tokens[b, :n]), free[b, :n])
    assert np.all(np.asarray(out.tokens[b, n:]) == 0)
    assert np.all(np.asarray(out.logprobs[b, n:]) == 0)


def test_continuing_a_cache_equals_one_call_over_the_concatenation(params, prompts):
  first = _generate(params, prompts, temperature=0.0, eos_ids=[int(prompts[0, 0])],
                    max_new_tokens=np.array([5, 9, 3]), cache_size=96)
  g1 = [np.asarray(t)[np.asarray(m)] for t, m in zip(first.tokens, first.mask)]
  chunk = np.random.default_rng(2).integers(0, V, size=(3, 6))
  chunk_lens = np.array([6, 1, 3])
  cont = _generate(params, chunk, lens=chunk_lens, temperature=0.0, cache=first.cache)
  whole = [np.concatenate([p, g, c[:n]]) for p, g, c, n in
           zip(_rows(prompts), g1, chunk, chunk_lens)]
  once = _generate(params, _padded(whole)[0], lens=[len(w) for w in whole], temperature=0.0)
  np.testing.assert_array_equal(np.asarray(cont.tokens), np.asarray(once.tokens))
  np.testing.assert_allclose(np.asarray(cont.logprobs), np.asarray(once.logprobs), atol=1e-5)
  assert cont.cache.size == 96  # continued in place, no new cache


def test_buckets_by_hand():
  quarter = lambda n: sampler_plan.bucket(n, 16, 4)
  assert [quarter(n) for n in (0, 16, 17, 21, 33, 64, 65, 96, 97, 129, 193, 257)] == [
      16, 16, 20, 24, 40, 64, 80, 96, 112, 160, 224, 320]
  assert [sampler_plan.bucket(n, 16) for n in (0, 16, 17, 96, 129)] == [16, 16, 32, 128, 256]
  assert sampler_plan.bucket(5, 4) == 8 and sampler_plan.bucket(3, 4) == 4


def test_new_length_in_same_bucket_does_not_compile_again(params, prompts):
  _generate(params, prompts, lens=np.array([3, 9, 13]), temperature=1.0)
  compiled = sampler._generate_jit._cache_size()
  out = _generate(params, prompts[:, :12], lens=np.array([12, 5, 1]), temperature=0.5,
                  top_p=None, max_new_tokens=np.array([9, 2, 16]))
  assert sampler._generate_jit._cache_size() == compiled
  np.testing.assert_array_equal(np.asarray(out.lengths), [9, 2, 16])


@pytest.mark.parametrize("ahead", [False, True])
def test_compile_ahead_compiles_the_next_prompt_bucket_at_once(params, ahead):
  """`compile_ahead` (the trainer's rollouts): a fresh prompt bucket's first call compiles the
  next bucket up too, so the longer prompts that follow compile nothing; without it (a
  one-off call) only what runs compiles, and the longer prompts compile when they come."""
  rng = np.random.default_rng(1)
  short, long = rng.integers(0, V, (2, 10)), rng.integers(0, V, (2, 20))  # P = 16, then 32
  # top_k makes a call signature that no other test of this process compiles.
  kw = dict(max_new_tokens=3, temperature=1.0, top_k=5 + ahead, compile_ahead=ahead)
  programs = lambda stats: sum(name == "jit(_generate)" for name in stats.names)
  counter = compile_stats.CompileCounter()
  first = _generate(params, short, lens=np.array([10, 7]), **kw)
  compiled_first = programs(counter.delta())
  second = _generate(params, long, lens=np.array([20, 18]), **kw)
  compiled_second = programs(counter.delta())
  assert (compiled_first, compiled_second) == ((2, 0) if ahead else (1, 1))
  assert first.tokens.shape == second.tokens.shape == (2, 16)


def _random_adapters(config, num_adapters=2, rank=4):
  keys = iter(jax.random.split(jax.random.key(11), 16))
  layers = {}
  for name, (d_in, d_out) in targets.linear_shapes(config).items():
    if name in ("q_proj", "v_proj", "down_proj"):
      shape = (config.num_layers, num_adapters)
      layers[name] = {"a": 0.3 * jax.random.normal(next(keys), shape + (d_in, rank)),
                      "b": 0.3 * jax.random.normal(next(keys), shape + (rank, d_out))}
  return Adapters(layers=layers, scale=2.0)


def test_lora_routing_per_sequence_equals_each_row_alone(params, prompts):
  """In the decoding layout (the fast path; tests/models/test_layouts.py ties the layouts)."""
  lora = _random_adapters(CONFIG)
  config = CONFIG.replace(layout=layout.DECODING)
  fast = layout.convert_params(params, CONFIG.layout, config.layout)
  ids = np.array([1, -1, 0])
  gen = lambda **kw: sampler.generate(fast, prompts, config, prompt_lens=LENS, max_new_tokens=N,
                                      rng=jax.random.key(7), temperature=0.0, lora=lora, **kw)
  out = gen(adapter_ids=ids)
  # Each row against a batch where every row uses that row's adapter (-1: the base model).
  for b, adapter in enumerate(ids):
    alone = gen(adapter_ids=np.full(3, adapter))
    np.testing.assert_array_equal(np.asarray(alone.tokens[b]), np.asarray(out.tokens[b]))
    np.testing.assert_allclose(np.asarray(alone.logprobs[b]), np.asarray(out.logprobs[b]),
                               atol=1e-5)
  base = np.asarray(_generate(params, prompts, temperature=0.0).tokens)
  assert np.all(np.any(np.asarray(out.tokens) != base, axis=1) == (ids >= 0))

"""The sampler's two shortcuts against the plain path: a shared prompt prefix encoded once, and
a call's one adapter merged into the weights. Each must give the plain path's samples."""

import jax
import numpy as np
import pytest

from marft_jax.models import layout, sampler, sampler_plan, transformer
from marft_jax.models.config import tiny_config
from tests.models.test_sampler import _random_adapters

CONFIG = tiny_config()
FAST = CONFIG.replace(layout=layout.DECODING)
V = CONFIG.vocab_size
PREFIX = 18  # shared tokens: at least MIN_SHARED_PREFIX, and not a bucket size (20 is)


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CONFIG, jax.random.key(0), std=0.1)


@pytest.fixture(scope="module")
def fast_params(params):
  return layout.convert_params(params, CONFIG.layout, FAST.layout)


def _prompts(lens, seed=0):
  """Right-padded rows that open with the same PREFIX tokens, then differ (len 0: idle)."""
  rng = np.random.default_rng(seed)
  head = rng.integers(0, V, PREFIX)
  tokens = rng.integers(0, V, (len(lens), max(lens)))
  tokens[:, :PREFIX] = head
  return tokens, np.asarray(lens)


def _count_calls(monkeypatch, name):
  """Counts the calls that run `sampler_plan.<name>` (a compile ahead, `.lower`, is not
  one)."""
  calls = []
  original = getattr(sampler_plan, name)
  counted = lambda *a, **k: calls.append(1) or original(*a, **k)
  counted.lower = getattr(original, "lower", None)
  monkeypatch.setattr(sampler_plan, name, counted)
  return calls


def _assert_same(a, b):
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


@pytest.mark.parametrize("config_name", ["training", "decoding"])
def test_a_shared_prefix_encoded_once_samples_as_every_row_encoded(
    params, fast_params, monkeypatch, config_name):
  config, weights = (CONFIG, params) if config_name == "training" else (FAST, fast_params)
  tokens, lens = _prompts([25, 19, 0, 31])  # row 2 sits out
  max_new = np.array([9, 12, 0, 5])
  gen = lambda **kw: sampler.generate(weights, tokens, config, prompt_lens=lens,
                                      max_new_tokens=max_new, rng=jax.random.key(3),
                                      temperature=1.0, eos_ids=[1], cache_size=96, **kw)
  encoded = _count_calls(monkeypatch, "_encode_shared_prefix")
  plain = gen(share_prefix=False)
  assert not encoded
  shared = gen()
  assert len(encoded) == 1
  _assert_same(shared, plain)
  # The idle row holds no context; the others hold their prompt and replies.
  valid = np.asarray(shared.cache.valid).sum(axis=1)
  np.testing.assert_array_equal(valid, np.asarray(plain.cache.valid).sum(axis=1))
  assert valid[2] == 0
  # Both caches continue alike (the next agent's turn).
  chunk = np.random.default_rng(5).integers(0, V, (4, 7))
  more = lambda cache: sampler.generate(weights, chunk, config, prompt_lens=[7, 3, 5, 1],
                                        max_new_tokens=6, rng=jax.random.key(4),
                                        temperature=1.0, cache=cache)
  _assert_same(more(shared.cache), more(plain.cache))


def test_short_or_unshared_prefixes_take_the_plain_path(params, monkeypatch):
  encoded = _count_calls(monkeypatch, "_encode_shared_prefix")
  tokens, _ = _prompts([30, 30])
  gen = lambda t, lens: sampler.generate(params, t, CONFIG, prompt_lens=lens, max_new_tokens=4,
                                         rng=jax.random.key(0))
  gen(tokens, [sampler_plan.MIN_SHARED_PREFIX, 30])  # row 0 keeps one token after 15 shared
  tokens[1, 3] = (tokens[0, 3] + 1) % V  # the rows part after 3 tokens
  gen(tokens, [30, 30])
  assert not encoded


def test_rows_of_different_adapters_never_share_a_prefix(fast_params, monkeypatch):
  """The prefix's keys depend on the adapter: rows with the same tokens through adapters 0 and
  1 each equal a batch of their own adapter, encoded in full."""
  lora = _random_adapters(CONFIG)
  tokens, lens = _prompts([24, 29, 21])
  ids = np.array([0, 1, 0])
  encoded = _count_calls(monkeypatch, "_encode_shared_prefix")
  gen = lambda adapter_ids, **kw: sampler.generate(
      fast_params, tokens, FAST, prompt_lens=lens, max_new_tokens=8, rng=jax.random.key(2),
      temperature=0.0, lora=lora, adapter_ids=adapter_ids, **kw)
  mixed = gen(ids)
  assert not encoded
  for b, adapter in enumerate(ids):
    alone = gen(np.full(3, adapter), share_prefix=False, merge_lora=False)
    np.testing.assert_array_equal(np.asarray(alone.tokens[b]), np.asarray(mixed.tokens[b]))
    np.testing.assert_allclose(np.asarray(alone.logprobs[b]), np.asarray(mixed.logprobs[b]),
                               atol=1e-5)


@pytest.mark.parametrize("config_name", ["training", "decoding"])
def test_one_adapter_merged_into_the_weights_samples_as_routed(
    params, fast_params, monkeypatch, config_name):
  config, weights = (CONFIG, params) if config_name == "training" else (FAST, fast_params)
  lora = _random_adapters(CONFIG)
  tokens, lens = _prompts([25, 19, 0, 31])
  max_new = np.array([9, 12, 0, 5])
  gen = lambda **kw: sampler.generate(
      weights, tokens, config, prompt_lens=lens, max_new_tokens=max_new,
      rng=jax.random.key(3), temperature=1.0, lora=lora, adapter_ids=np.array([1, 1, -1, 1]),
      **kw)
  merged = _count_calls(monkeypatch, "_merged")
  routed = gen(merge_lora=False)
  assert not merged
  _assert_same(gen(), routed)
  assert len(merged) == 1
  # Not the base model's samples: the adapter is in there.
  base = sampler.generate(weights, tokens, config, prompt_lens=lens, max_new_tokens=max_new,
                          rng=jax.random.key(3), temperature=1.0)
  assert np.any(np.asarray(base.tokens) != np.asarray(routed.tokens))


def test_a_busy_base_row_or_bfloat16_weights_keep_the_adapter_routed(params, monkeypatch):
  """Merged weights would give a row routed to the base (id -1) the adapter too; and rounded
  into bfloat16 kernels the delta would be lost."""
  lora = _random_adapters(CONFIG, num_adapters=1)
  tokens, lens = _prompts([25, 19, 31])
  merged = _count_calls(monkeypatch, "_merged")
  ids = np.array([0, -1, 0])
  gen = lambda w, config, adapter_ids: sampler.generate(
      w, tokens, config, prompt_lens=lens, max_new_tokens=8, rng=jax.random.key(1),
      temperature=0.0, lora=lora, adapter_ids=adapter_ids)
  out = gen(params, CONFIG, ids)
  base = gen(params, CONFIG, np.full(3, -1))
  np.testing.assert_array_equal(np.asarray(out.tokens[1]), np.asarray(base.tokens[1]))
  bf16 = CONFIG.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
  gen(jax.tree.map(lambda x: x.astype("bfloat16"), params), bf16, np.zeros(3, int))
  assert not merged


# --- prefixes shared within groups of rows (`prefix_groups`) ---------------------------------


def test_group_prefixes_by_hand():
  """Rows 0, 1 (group 0) share 20 tokens; rows 2-4 (group 1) 25, of which row 4 holds 18 and
  keeps one to sample from: 17; group 2 is one row; group 4's rows are the same tokens on two
  adapters; row 7 (group 0) is idle and counts for nothing; -1 shares nothing. Rows 5 and 6
  as one group part after 5 tokens: fewer than MIN_SHARED_PREFIX, nothing shared."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, V, (10, 40))
  lens = np.array([30, 25, 40, 22, 18, 12, 20, 0, 30, 30])
  tokens[1, :20] = tokens[0, :20]
  tokens[1, 20] = (tokens[0, 20] + 1) % V
  tokens[3:5, :25] = tokens[2, :25]
  tokens[2:5, 25] = [1, 2, 3]
  tokens[9] = tokens[8]
  tokens[6, :5] = tokens[5, :5]
  tokens[6, 5] = (tokens[5, 5] + 1) % V
  ids = np.array([0, 0, 1, 1, 1, 0, 0, 0, 0, 1])
  mask = np.arange(40)[None] < lens[:, None]
  busy = lens > 0
  found = sampler_plan.group_prefixes(tokens, mask, busy,
                                      np.array([0, 0, 1, 1, 1, 2, -1, 0, 4, 4]), ids)
  np.testing.assert_array_equal(found.starts, [20, 20, 17, 17, 17, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(found.heads, [0, 2])
  np.testing.assert_array_equal(found.row_group, [0, 0, 1, 1, 1, -1, -1, -1, -1, -1])
  parting = np.array([-1, -1, -1, -1, -1, 3, 3, -1, -1, -1])
  assert sampler_plan.group_prefixes(tokens, mask, busy, parting, ids) is None
  assert sampler_plan.group_prefixes(tokens, mask, busy, np.full(10, -1), ids) is None


def _grouped_prompts(draw_groups, heads, tails, seed):
  """Right-padded rows: rows of a group open with the group's `heads[g]` tokens, then a tail
  of their own (`tails[r]` tokens; 0: the row sits out)."""
  rng = np.random.default_rng(seed)
  shared = {g: rng.integers(0, V, 40) for g in set(draw_groups)}
  lens = np.array([(heads[g] + t if t else 0) for g, t in zip(draw_groups, tails)])
  tokens = rng.integers(0, V, (len(lens), max(lens.max(), 1)))
  for r, g in enumerate(draw_groups):
    n = min(heads[g], tokens.shape[1])  # a row that sits out may be narrower than its head
    tokens[r, :n] = shared[g][:n]
  return tokens, lens


from hypothesis import given, settings, strategies as st  # noqa: E402


def _check_grouped_against_plain(fast_params, groups, heads, tails, ids):
  """The grouped call equals the plain one (every row's prompt encoded in full), encodes the
  group prefixes once exactly where `group_prefixes` finds one, and both caches continue
  alike; returns what `group_prefixes` found."""
  B = len(groups)
  tokens, lens = _grouped_prompts(list(groups), heads, tails, seed=B)
  lora = _random_adapters(CONFIG)
  max_new = np.where(lens > 0, 6, 0)
  gen = lambda **kw: sampler.generate(fast_params, tokens, FAST, prompt_lens=lens,
                                      max_new_tokens=max_new, rng=jax.random.key(7),
                                      temperature=1.0, eos_ids=[1], cache_size=96, lora=lora,
                                      adapter_ids=ids, merge_lora=False, **kw)
  with pytest.MonkeyPatch.context() as monkeypatch:
    encoded = _count_calls(monkeypatch, "_encode_group_prefixes")
    plain = gen(share_prefix=False)
    grouped = gen(share_prefix=False, prefix_groups=groups)
  mask = np.arange(tokens.shape[1])[None] < lens[:, None]
  expected = sampler_plan.group_prefixes(tokens, mask, lens > 0, np.asarray(groups), ids)
  assert len(encoded) == (expected is not None)
  _assert_same(grouped, plain)
  np.testing.assert_array_equal(np.asarray(grouped.cache.valid).sum(axis=1),
                                np.asarray(plain.cache.valid).sum(axis=1))
  chunk = np.random.default_rng(5).integers(0, V, (B, 5))
  more = lambda cache: sampler.generate(fast_params, chunk, FAST, prompt_lens=np.full(B, 5),
                                        max_new_tokens=4, rng=jax.random.key(4),
                                        temperature=1.0, cache=cache)
  _assert_same(more(grouped.cache), more(plain.cache))
  return expected


def test_two_groups_and_a_lone_row_sample_as_every_row_encoded(fast_params):
  """Groups of 24 and 17 shared tokens on two adapters, the call's longest prompt in a group
  (its chunk reaches the prompt's last column), beside a row that shares nothing."""
  found = _check_grouped_against_plain(
      fast_params, groups=np.array([0, 0, 1, 1, 1, -1]), heads={-1: 9, 0: 24, 1: 17},
      tails=[3, 9, 1, 4, 2, 5], ids=np.array([0, 0, 1, 1, 1, 0]))
  np.testing.assert_array_equal(found.starts, [24, 24, 17, 17, 17, 0])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.data())
def test_rows_sharing_group_prefixes_sample_as_every_row_encoded(fast_params, data):
  """Any layout of groups (ids -1 to 2, rows idle or not, group heads of 0 to 30 tokens, each
  group on one adapter or, for one row, another): as every row encoded in full."""
  B = data.draw(st.integers(3, 8), label="rows")
  groups = np.array(data.draw(st.lists(st.integers(-1, 2), min_size=B, max_size=B),
                              label="groups"))
  heads = data.draw(st.lists(st.sampled_from([0, 8, 16, 17, 24, 30]), min_size=4,
                             max_size=4), label="heads")
  heads = {-1: heads[3], **dict(enumerate(heads[:3]))}
  tails = data.draw(st.lists(st.integers(0, 6), min_size=B, max_size=B), label="tails")
  tails[0] = max(tails[0], 1)  # one row samples
  group_adapter = data.draw(st.lists(st.integers(0, 1), min_size=4, max_size=4), label="ids")
  ids = np.array([group_adapter[g] for g in groups])
  if data.draw(st.booleans(), label="one row on the other adapter"):
    ids[-1] = 1 - ids[-1]
  _check_grouped_against_plain(fast_params, groups, heads, tails, ids)


def test_prefix_groups_of_the_wrong_shape_are_refused(params):
  tokens, lens = _prompts([20, 20])
  with pytest.raises(ValueError, match="prefix_groups"):
    sampler.generate(params, tokens, CONFIG, prompt_lens=lens, max_new_tokens=2,
                     rng=jax.random.key(0), prefix_groups=[0, 0, 0])


def test_the_chunk_after_a_prefix_is_bucketed_from_the_bound_less_that_prefix(params):
  """`prompt_width` bounds the whole prompt; the chunk the loop encodes is what follows the
  prefix encoded apart: P = bucket(bound − prefix) for one prefix of every row (16 columns of
  the 18 shared), and bucket(bound − the shortest group prefix) for group prefixes."""
  tokens, lens = _prompts([25, 19, 31])
  call = sampler_plan.checked(tokens, CONFIG, 4, lens, None, None, None, None, 1.0, None, None,
                              [1], None, None, None)
  bound = 66
  for share, groups, prefix in [(False, None, 0), (True, None, 16),
                                (False, np.array([0, 0, 0]), PREFIX)]:
    sampler_plan.forget_compiled_shapes()  # no reuse of a wider program compiled elsewhere
    route = sampler_plan.route(params, CONFIG, call, None, None, None, False, share, groups)
    assert route.prefix_length == prefix
    shapes, _ = sampler_plan.static_shapes(call, route, CONFIG, None, cache_size=None,
                                           prompt_width=bound, new_tokens=None, rows=None)
    assert shapes.prompt == sampler_plan.prompt_bucket(bound - prefix), (share, groups)
  sampler_plan.forget_compiled_shapes()


def test_calls_with_narrower_group_prefixes_reuse_the_compiled_loop(fast_params):
  """A sampled evaluation's calls hold other problems, so other group-prefix widths: a call
  whose groups share 20 tokens after one whose groups shared 40 runs in the loop program
  compiled for the first (only its prefix encoder compiles), and samples as the plain path."""
  from marft_jax import compile_stats  # noqa: PLC0415
  programs = lambda stats: sum(name == "jit(_generate)" for name in stats.names)
  counter = compile_stats.CompileCounter()
  compiled = []
  for head in (40, 20):
    tokens, lens = _grouped_prompts([0, 0, 1, 1], {0: head, 1: head}, [2, 3, 1, 2], seed=head)
    # top_k 7: a call signature no other test of this process compiles
    gen = lambda **kw: sampler.generate(fast_params, tokens, FAST, prompt_lens=lens,
                                        max_new_tokens=5, rng=jax.random.key(1), top_k=7,
                                        temperature=1.0, eos_ids=[1], prompt_width=head + 4,
                                        **kw)
    grouped = gen(prefix_groups=np.array([0, 0, 1, 1]))
    compiled.append(programs(counter.delta()))
    _assert_same(grouped, gen(share_prefix=False))
    counter.delta()
  assert compiled == [1, 0], compiled

"""Bad sampler and forward arguments are refused by name; edge values give correct numbers.

The references: argmax for vanishing temperatures, one call over the concatenation for a
grown cache, and every routing path (per sequence, per token, sorted, decode layout) for
out-of-range adapter ids under jit.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from marft_jax import lora as lora_lib, validation
from marft_jax.models import layout, sampler, targets, token_sampling, transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.sampling import SamplingConfig

CONFIG = tiny_config(max_position_embeddings=64)
V = CONFIG.vocab_size


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CONFIG, jax.random.key(0), std=0.1)


@pytest.fixture(scope="module")
def adapters():
  rng = np.random.default_rng(0)
  layers = {}
  for name, (d_in, d_out) in targets.linear_shapes(CONFIG).items():
    if name in ("q_proj", "v_proj"):
      layers[name] = {"a": jnp.asarray(rng.normal(0, 0.3, (2, 3, d_in, 4)), jnp.float32),
                      "b": jnp.asarray(rng.normal(0, 0.3, (2, 3, 4, d_out)), jnp.float32)}
  return lora_lib.Adapters(layers=layers, scale=2.0)


PROMPTS = np.random.default_rng(1).integers(0, V, size=(2, 6))


def _generate(params, **kw):
  kw = {"max_new_tokens": 4, "rng": jax.random.key(2), **kw}
  return sampler.generate(params, kw.pop("tokens", PROMPTS), CONFIG, **kw)


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=[1.0, float("nan")]), "temperature"),
    (dict(temperature=[1.0, 1.0, 1.0]), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(tokens=np.array([[1, 2, V]])), "tokens"),
    (dict(tokens=np.array([[-1, 2, 3]])), "tokens"),
    (dict(tokens=np.array([[1.0, 2.0]])), "tokens"),
    (dict(eos_ids=[V]), "eos_ids"),
    (dict(stop_ids=[[3], [-2]]), "stop_ids"),
    (dict(max_new_tokens=-1), re.escape("max_new_tokens=-1: must be in [0, 2147483647]")),
    (dict(max_new_tokens=[3, -2]),
     re.escape("max_new_tokens: entry -2 must be in [0, 2147483647] (1 such entry)")),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(prompt_lens=[7, 2]), re.escape("prompt_lens: entry 7 must be in [0, 6] (1 such entry)")),
    (dict(prompt_lens=[7, 9]), re.escape("prompt_lens: entry 7 must be in [0, 6] (2 such entries)")),
    (dict(prompt_mask=np.ones((2, 5), bool)), "prompt_mask"),
    (dict(max_new_tokens=60), "max_position_embeddings"),  # 6 + 60 > 64
])
def test_bad_arguments_are_refused_by_name(params, kw, name):
  with pytest.raises(ValueError, match=name):
    _generate(params, **kw)


@pytest.mark.parametrize("ids", [[0, 3], [-2, 0], 5])
def test_adapter_ids_out_of_range_are_refused(params, adapters, ids):
  with pytest.raises(ValueError, match="adapter_ids"):
    _generate(params, lora=adapters, adapter_ids=ids)
  with pytest.raises(ValueError, match="adapter_ids"):
    transformer.forward(params, PROMPTS, CONFIG, lora=adapters,
                        adapter_ids=np.broadcast_to(ids, (2,)))


@pytest.mark.parametrize("kw,message", [
    (dict(tokens=PROMPTS[0]), "tokens: shape (6,) has rank 1, expected 2"),
    (dict(mask=np.ones((2, 5), bool)), "mask: shape (2, 5) differs from tokens' (2, 6)"),
    (dict(positions=np.arange(6)), "positions: shape (6,) differs from tokens' (2, 6)"),
])
def test_forward_refuses_a_wrong_shape_naming_it(params, kw, message):
  kw = dict(kw)
  tokens = kw.pop("tokens", PROMPTS)
  for forward in (transformer.forward, jax.jit(transformer.forward, static_argnums=2)):
    with pytest.raises(ValueError, match=re.escape(message)):
      forward(params, tokens, CONFIG, **kw)


def test_padding_off_the_mask_may_hold_any_id(params):
  tokens = np.concatenate([PROMPTS, np.full((2, 3), -7)], axis=1)
  a = _generate(params, tokens=tokens, prompt_lens=[6, 6], temperature=0.0)
  b = _generate(params, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_position_limit_counts_the_cached_tokens(params):
  first = _generate(params, max_new_tokens=20, temperature=0.0)  # 6 + 20 positions
  with pytest.raises(ValueError, match="max_position_embeddings"):
    _generate(params, tokens=PROMPTS, cache=first.cache, max_new_tokens=40)  # 26 + 6 + 40


def test_tiny_temperature_is_stable_and_approaches_greedy():
  # Logits as large as a real model's: dividing before subtracting the max overflows to inf.
  logits = jax.random.normal(jax.random.key(5), (64, 300)) * 30
  for t in (1e-10, 1e-30, 1e-37):  # (f32 denormals flush to 0 on XLA:CPU: greedy)
    tok, logprob = token_sampling.sample_tokens(jax.random.key(6), logits, jnp.full((64,), t))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), axis=-1))
    # Every other token has probability 0 at this temperature: log-prob exactly 0.
    np.testing.assert_array_equal(np.asarray(logprob), 0.0)


def test_tiny_temperature_generation_equals_greedy(params):
  tiny = _generate(params, temperature=1e-10, max_new_tokens=8)
  greedy = _generate(params, temperature=0.0, max_new_tokens=8)
  np.testing.assert_array_equal(np.asarray(tiny.tokens), np.asarray(greedy.tokens))
  assert np.all(np.isfinite(np.asarray(tiny.logprobs)))


def test_top_k_zero_means_off_as_in_transformers(params):
  off = _generate(params, temperature=1.0, top_k=0)
  none = _generate(params, temperature=1.0, top_k=None)
  whole = _generate(params, temperature=1.0, top_k=V)
  for other in (none, whole):
    np.testing.assert_array_equal(np.asarray(off.tokens), np.asarray(other.tokens))
    np.testing.assert_array_equal(np.asarray(off.logprobs), np.asarray(other.logprobs))


def test_sampling_config_uses_the_same_rules():
  with pytest.raises(ValueError, match="temperature"):
    SamplingConfig(temperature=float("nan"))
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    SamplingConfig(max_new_tokens=0)
  assert SamplingConfig(top_k=0, top_p=1.0).generate_kwargs()["top_k"] is None


def test_a_continued_cache_that_is_too_small_grows(params):
  """Continuing a full cache grows it, and the result equals one call over everything."""
  first = _generate(params, temperature=0.0, max_new_tokens=3, cache_size=8)
  assert first.cache.size == 32  # 16-slot prompt chunk + 16 new: the requested 8 is too few
  g1 = [np.asarray(t)[np.asarray(m)] for t, m in zip(first.tokens, first.mask)]
  chunk = np.random.default_rng(3).integers(0, V, size=(2, 20))
  cont = _generate(params, tokens=chunk, temperature=0.0, cache=first.cache)
  assert cont.cache.size > 32
  whole = np.stack([np.concatenate([p, g, c]) for p, g, c in zip(PROMPTS, g1, chunk)])
  once = _generate(params, tokens=whole, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(cont.tokens), np.asarray(once.tokens))
  np.testing.assert_allclose(np.asarray(cont.logprobs), np.asarray(once.logprobs), atol=1e-5)


@pytest.mark.parametrize("cache_config, batch, message", [
    (CONFIG, 3, "cache: keys of 2 layers shaped [(3, 2, 16, 16)]; this model and batch need 2 "
                "of (2, 2, 16, 16) (init_cache(config, 2, 16))"),
    (CONFIG.replace(num_layers=3), 2, "cache: keys of 3 layers shaped [(2, 2, 16, 16)]"),
    (CONFIG.replace(param_dtype="bfloat16", compute_dtype="bfloat16"), 2,
     "cache: keys are bfloat16 but the model computes in float32"),
    (CONFIG.replace(layout=layout.DECODING), 2, "cache: holds a list of layers but "
                                                "config.layout=Layout(scan_layers=True"),
], ids=["batch", "layers", "dtype", "layout"])
def test_forward_refuses_a_cache_made_for_another_call(params, cache_config, batch, message):
  """Before: another batch size failed in a broadcast, a 3-layer cache was read in part
  without a word, a bf16 cache silently rounded the f32 model's keys."""
  cache = transformer.init_cache(cache_config, batch, 16)
  for forward in (transformer.forward, jax.jit(transformer.forward, static_argnums=2)):
    with pytest.raises(ValueError, match=re.escape(message)):
      forward(params, PROMPTS, CONFIG, cache=cache)


@pytest.mark.parametrize("changes, lay, message", [
    (dict(num_layers=3), layout.TRAINING, "params hold 3 layers but config.num_layers=2"),
    (dict(num_layers=3), layout.DECODING, "params hold 3 layers but config.num_layers=2"),
    (dict(vocab_size=300), layout.TRAINING,
     "params' embed is (300, 64) but the config's vocab_size x hidden_size is (256, 64)"),
    (dict(hidden_size=128), layout.TRAINING, "params' embed is (256, 128)"),
], ids=["layers", "layers_unrolled", "vocab", "width"])
def test_forward_refuses_params_of_another_model(changes, lay, message):
  """Before: the unrolled 3-layer params ran all 3 layers and the 300-token vocabulary gave
  300-wide logits, both without a word; the scanned 3 layers failed inside `lax.scan`, and
  the wider model's error blamed the layout."""
  other = layout.convert_params(transformer.init_params(CONFIG.replace(**changes),
                                                       jax.random.key(0)), layout.TRAINING, lay)
  with pytest.raises(ValueError, match=re.escape(message)):
    transformer.forward(other, PROMPTS, CONFIG.replace(layout=lay))


@pytest.mark.parametrize("changes, lay, message", [
    (dict(num_layers=3), layout.DECODING,
     "lora: q_proj.a has shape (3, 2, 64, 4); this model needs (2, 2, 64, 4)"),
    (dict(num_layers=3), layout.TRAINING, "lora: q_proj.a has shape (3, 2, 64, 4)"),
    (dict(hidden_size=128), layout.TRAINING, "lora: q_proj.a has shape (2, 2, 128, 4)"),
    (dict(num_kv_heads=1), layout.TRAINING,
     "lora: k_proj.b has shape (2, 2, 4, 16); this model needs (2, 2, 4, 32)"),
], ids=["layers_unrolled", "layers", "width", "kv_heads"])
def test_forward_refuses_adapters_of_another_model(params, changes, lay, message):
  """Before: 3-layer adapters on the unrolled 2-layer model were read in part without a
  word; the other cases failed inside lax.scan, a concatenation or a broadcast."""
  other = lora_lib.init_adapters(lora_lib.LoraConfig(rank=4), CONFIG.replace(**changes),
                                 jax.random.key(0), 2)
  config = CONFIG.replace(layout=lay)
  tree = layout.convert_params(params, layout.TRAINING, lay)
  for forward in (transformer.forward, jax.jit(transformer.forward, static_argnums=2)):
    with pytest.raises(ValueError, match=re.escape(message)):
      forward(tree, PROMPTS, config, lora=other, adapter_ids=np.array([0, 1]))


def test_continuing_a_cache_with_other_rows_is_refused(params):
  """Before: NumPy's "operands could not be broadcast together with shapes (2,) (3,)"."""
  first = _generate(params, max_new_tokens=2)
  with pytest.raises(ValueError, match=re.escape("cache: holds 2 rows but tokens have 3")):
    _generate(params, tokens=np.zeros((3, 4), np.int32), cache=first.cache)


def test_generate_refuses_adapters_of_another_model(params):
  """One adapter takes the merged fast path: before, a 1-layer set's update was broadcast over
  both layers and sampled from without a word."""
  other = lora_lib.init_adapters(lora_lib.LoraConfig(rank=4), CONFIG.replace(num_layers=1),
                                 jax.random.key(0))
  with pytest.raises(ValueError, match=re.escape("lora: q_proj.a has shape (1, 1, 64, 4); "
                                                 "this model needs (2, 1, 64, 4)")):
    _generate(params, lora=other, adapter_ids=0)


@pytest.mark.parametrize("batch, size, message", [(2, -3, "size=-3: must be >= 0"),
                                                  (-1, 8, "batch=-1: must be >= 0"),
                                                  (2, 8.0, "size=8.0: expected an int")])
def test_init_cache_refuses_bad_sizes_by_name(batch, size, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    transformer.init_cache(CONFIG, batch, size)


def test_forward_refuses_a_cache_write_past_its_end(params):
  cache = transformer.init_cache(CONFIG, 2, 8)
  _, cache = transformer.forward(params, PROMPTS, CONFIG, cache=cache)  # slots 0..5
  with pytest.raises(ValueError, match="cache"):
    transformer.forward(params, PROMPTS, CONFIG, cache=cache)  # slots 6..11 of 8


def test_forward_overflow_is_reported_under_checkify(params):
  fn = jax.jit(checkify.checkify(
      lambda p, t, c: transformer.forward(p, t, CONFIG, cache=c)[0]))
  cache = transformer.init_cache(CONFIG, 2, 8)
  overflowing = cache.replace(index=jnp.asarray(4, jnp.int32))
  fn(params, PROMPTS, overflowing)[0].throw()  # no check traced outside traced_checks()
  with validation.traced_checks():
    err, _ = fn(params, PROMPTS, cache)
    err.throw()  # 6 of 8 slots: fine
    err, _ = fn(params, PROMPTS, overflowing)
  with pytest.raises(Exception, match="overflow"):
    err.throw()


def test_traced_out_of_range_adapter_ids_route_to_the_base_on_every_path(params, adapters):
  """Under jit ids can't be refused: ids ≥ A and < -1 then mean "no adapter" on every route
  and in every layout, and checkify reports them."""
  tokens = jnp.asarray(PROMPTS)
  base = transformer.forward(params, tokens, CONFIG)[0]

  @functools.partial(jax.jit, static_argnames="per_token")
  def routed(ids, per_token):
    ids = jnp.broadcast_to(ids[:, None], tokens.shape) if per_token else ids
    return transformer.forward(params, tokens, CONFIG, lora=adapters, adapter_ids=ids)[0]

  for per_token in (False, True):  # A = 3 takes the sorted per-token path
    out = routed(jnp.asarray([3, -5]), per_token)
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), atol=1e-6)
  one = lora_lib.select_adapter(adapters, 0)  # A = 1: the one-hot per-token path
  out = jax.jit(lambda ids: transformer.forward(params, tokens, CONFIG, lora=one,
                                                adapter_ids=ids)[0])(
      jnp.broadcast_to(jnp.asarray([1, 7])[:, None], tokens.shape))
  np.testing.assert_allclose(np.asarray(out), np.asarray(base), atol=1e-6)
  decoding = CONFIG.replace(layout=layout.DECODING)  # and the fast layout, with a cache
  fast = layout.convert_params(params, CONFIG.layout, decoding.layout)
  dl = jax.jit(lambda ids: transformer.forward(
      fast, tokens, decoding, lora=adapters, adapter_ids=ids,
      cache=transformer.init_cache(decoding, 2, 8))[0])
  np.testing.assert_allclose(np.asarray(dl(jnp.asarray([3, -5]))), np.asarray(base), atol=1e-5)
  checked = jax.jit(checkify.checkify(lambda ids: routed(ids, False)))
  with validation.traced_checks():  # `routed`, jitted before, is traced again with the checks
    checked(jnp.asarray([2, -1]))[0].throw()
    err, _ = checked(jnp.asarray([3, 0]))
  with pytest.raises(Exception, match="adapter_ids"):
    err.throw()

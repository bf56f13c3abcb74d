"""Routing per sequence and per token in one forward against each adapter run on its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax import lora
from marft_jax.lora import routing
from marft_jax.models import transformer
from tests.lora.conftest import CONFIG, random_adapters

T, SEG = 12, 4
# Each row switches adapter every SEG tokens: agent 0 -> 1 -> 0, and agent 1 -> base -> 2.
SEGMENTS = [[0, 1, 0], [1, -1, 2]]
IDS = np.repeat(np.array(SEGMENTS), SEG, axis=1)  # [2, 12]
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, T))


@jax.jit
def _forward(params, tokens, lora_, ids, cache=None):
  return transformer.forward(params, tokens, CONFIG, lora=lora_, adapter_ids=ids, cache=cache)


def _stitched(params, adapters, row):
  """Row `row` segment by segment, each through its adapter alone (A = 1; None for -1),
  continuing one KV cache: what separate per-agent passes that share a context compute."""
  cache = transformer.init_cache(CONFIG, 1, T)
  logits = []
  for s, adapter in enumerate(SEGMENTS[row]):
    alone = None if adapter < 0 else lora.select_adapter(adapters, adapter)
    out, cache = _forward(params, jnp.asarray(TOKENS[row:row + 1, s * SEG:(s + 1) * SEG]),
                          alone, jnp.zeros((1,), jnp.int32), cache)
    logits.append(out)
  return np.concatenate(logits, axis=1)[0]


@pytest.fixture(scope="module")
def adapters():
  return random_adapters(3)


def test_per_token_routing_equals_stitched_single_adapter_passes(params, adapters):
  routed, _ = _forward(params, jnp.asarray(TOKENS), adapters, jnp.asarray(IDS))
  base, _ = _forward(params, jnp.asarray(TOKENS), None, jnp.zeros((2,), jnp.int32))
  assert np.abs(np.asarray(routed - base)).max() > 0.1  # The adapters matter.
  for row in range(2):
    np.testing.assert_allclose(np.asarray(routed[row]), _stitched(params, adapters, row),
                               atol=1e-5, rtol=0)


def test_per_token_routing_with_kv_cache_in_chunks_that_straddle_switches(params, adapters):
  full, _ = _forward(params, jnp.asarray(TOKENS), adapters, jnp.asarray(IDS))
  cache = transformer.init_cache(CONFIG, 2, T)
  chunks = []
  for start in (0, 6):  # Switches at 4 and 8 fall inside the chunks.
    out, cache = _forward(params, jnp.asarray(TOKENS[:, start:start + 6]), adapters,
                          jnp.asarray(IDS[:, start:start + 6]), cache)
    chunks.append(out)
  np.testing.assert_allclose(np.concatenate(chunks, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_per_sequence_routing_equals_each_row_alone(params, adapters):
  tokens, ids = jnp.asarray(TOKENS), jnp.asarray([2, -1])
  routed, _ = _forward(params, tokens, adapters, ids)
  per_token, _ = _forward(params, tokens, adapters, lora.broadcast_adapter_ids(ids, 2, T))
  np.testing.assert_allclose(np.asarray(routed), np.asarray(per_token), atol=1e-5, rtol=0)
  alone, _ = _forward(params, tokens, lora.select_adapter(adapters, 2), jnp.zeros((2,), jnp.int32))
  base, _ = _forward(params, tokens, None, jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(np.asarray(routed[0]), np.asarray(alone[0]), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(routed[1]), np.asarray(base[1]))


def test_zero_b_and_no_adapter_id_give_the_base_model_exactly(params, adapters):
  tokens = jnp.asarray(TOKENS)
  base, _ = _forward(params, tokens, None, jnp.zeros((2,), jnp.int32))
  # B = 0 as `init_adapters` makes it (tested there); A stays random.
  fresh = adapters.replace(layers={n: dict(w, b=jnp.zeros_like(w["b"]))
                                   for n, w in adapters.layers.items()})
  for ids in (jnp.asarray(IDS), jnp.asarray([0, 1])):
    out, _ = _forward(params, tokens, fresh, ids)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base))
  for shape in ((2, T), (2,)):
    ids = jnp.full(shape, lora.NO_ADAPTER, jnp.int32)  # int32, not weak: no recompile.
    out, _ = _forward(params, tokens, adapters, ids)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base))


def test_shared_mode_routes_every_agent_through_adapter_zero(params, adapters):
  shared = lora.select_adapter(adapters, 1)
  ids = lora.adapter_ids_for_agents(IDS, shared=True)
  np.testing.assert_array_equal(np.asarray(ids), np.where(IDS >= 0, 0, -1))
  np.testing.assert_array_equal(np.asarray(lora.adapter_ids_for_agents(IDS, shared=False)), IDS)
  routed, _ = _forward(params, jnp.asarray(TOKENS), shared, ids)
  whole_row, _ = _forward(params, jnp.asarray(TOKENS), shared, jnp.zeros((2,), jnp.int32))
  np.testing.assert_allclose(np.asarray(routed[0]), np.asarray(whole_row[0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("num_adapters", [1, 3])  # One-hot path; sorted (grouped) path.
def test_routed_delta_against_numpy(jit, num_adapters):
  rng = np.random.default_rng(2)
  x = rng.normal(size=(2, 5, 6)).astype(np.float32)
  a = rng.normal(size=(num_adapters, 6, 2)).astype(np.float32)
  b = rng.normal(size=(num_adapters, 2, 4)).astype(np.float32)
  ids = rng.integers(-1, num_adapters, (2, 5))
  expected = np.zeros((2, 5, 4), np.float32)
  for i, j in np.ndindex(2, 5):
    if ids[i, j] >= 0:
      expected[i, j] = 0.5 * x[i, j] @ a[ids[i, j]] @ b[ids[i, j]]
  delta = jax.jit(lora.routed_lora_delta, static_argnums=3) if jit else lora.routed_lora_delta
  np.testing.assert_allclose(delta(x, {"a": a, "b": b}, jnp.asarray(ids), 0.5), expected,
                             atol=1e-5)
  per_row = delta(x, {"a": a, "b": b}, jnp.asarray([num_adapters - 1, -1]), 0.5)
  np.testing.assert_allclose(per_row[0], 0.5 * x[0] @ a[-1] @ b[-1], atol=1e-5)
  np.testing.assert_array_equal(per_row[1], 0.0)


@pytest.mark.parametrize("num_adapters,per_token", [(1, False), (3, False), (3, True)])
def test_feature_major_delta_against_numpy(num_adapters, per_token):
  """Activations [D_in, B·T]: one adapter per sequence stays feature-major, the rest goes
  through the token-major router; both against a NumPy loop, ids -1 and out of range → base."""
  rng = np.random.default_rng(3)
  B, T, D_in, D_out = 3, 4, 6, 5
  x = rng.normal(size=(B, T, D_in)).astype(np.float32)
  a = rng.normal(size=(num_adapters, D_in, 2)).astype(np.float32)
  b = rng.normal(size=(num_adapters, 2, D_out)).astype(np.float32)
  ids = rng.integers(-1, num_adapters + 1, (B, T)) if per_token else np.array([0, -1, num_adapters])
  token_ids = ids if per_token else np.repeat(ids[:, None], T, axis=1)
  expected = np.zeros((B, T, D_out), np.float32)
  for i, j in np.ndindex(B, T):
    if 0 <= token_ids[i, j] < num_adapters:
      expected[i, j] = 0.5 * x[i, j] @ a[token_ids[i, j]] @ b[token_ids[i, j]]
  delta = jax.jit(routing.feature_major_lora_delta, static_argnums=3)(
      jnp.asarray(x.reshape(B * T, D_in).T), {"a": a, "b": b}, jnp.asarray(ids), 0.5)
  np.testing.assert_allclose(np.asarray(delta).T.reshape(B, T, D_out), expected, atol=1e-5)


@pytest.mark.parametrize("ids_kind", ["random", "one_adapter", "all_base", "runs"])
def test_grouped_path_values_and_gradients_equal_one_hot(ids_kind):
  rng = np.random.default_rng(5)
  B, T, A = 3, 37, 4  # 111 tokens: tiles of 16 rows, with padding in several groups.
  x = jnp.asarray(rng.normal(size=(B, T, 8)), jnp.float32)
  a = jnp.asarray(rng.normal(size=(A, 8, 2)), jnp.float32)
  b = jnp.asarray(rng.normal(size=(A, 2, 5)), jnp.float32)
  ids = {"random": rng.integers(-1, A, (B, T)), "one_adapter": np.full((B, T), 2),
         "all_base": np.full((B, T), -1),
         "runs": np.repeat(rng.integers(-1, A, (B, 4)), [9, 10, 9, 9], axis=1)}[ids_kind]
  ids = jnp.asarray(ids, jnp.int32)

  (value, grads), (expected_value, expected) = _sin_loss_and_grads(x, a, b, ids)
  np.testing.assert_allclose(value, expected_value, atol=1e-5)
  for g, e in zip(grads, expected):
    np.testing.assert_allclose(g, e, atol=1e-4)


@jax.jit
def _sin_loss_and_grads(x, a, b, ids):
  """(value, grads w.r.t. x, a, b) of Σ sin(Δy), through the grouped and the one-hot path."""
  def run(path):
    loss = lambda x, a, b: jnp.sum(jnp.sin(path(x, a, b, ids)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, a, b)
  return run(routing._per_token_grouped), run(routing._per_token)


def test_dropout_only_with_a_key_and_matching_its_mask():
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 6)), jnp.float32)
  a, b = jnp.ones((1, 6, 2)), jnp.ones((1, 2, 3))
  ids = jnp.zeros((2, 5), jnp.int32)
  key = jax.random.key(4)
  dropped = lora.routed_lora_delta(x, {"a": a, "b": b, "dropout_key": key}, ids, 1.0, 0.5)
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  expected = jnp.einsum("btd,dr,ro->bto", jnp.where(keep, 2.0 * x, 0.0), a[0], b[0])
  np.testing.assert_allclose(dropped, expected, atol=1e-5)
  no_key = lora.routed_lora_delta(x, {"a": a, "b": b}, ids, 1.0, 0.5)
  np.testing.assert_allclose(no_key, jnp.einsum("btd,dr,ro->bto", x, a[0], b[0]), atol=1e-5)


def test_dropout_in_the_forward_is_deterministic_per_key(params, adapters):
  dropping = adapters.replace(dropout_rate=0.3)
  tokens, ids = jnp.asarray(TOKENS), jnp.asarray(IDS)
  plain, _ = _forward(params, tokens, adapters, ids)
  one, _ = _forward(params, tokens, dropping.with_dropout(jax.random.key(1)), ids)
  again, _ = _forward(params, tokens, dropping.with_dropout(jax.random.key(1)), ids)
  other, _ = _forward(params, tokens, dropping.with_dropout(jax.random.key(2)), ids)
  np.testing.assert_array_equal(np.asarray(one), np.asarray(again))
  assert not np.allclose(one, other) and not np.allclose(one, plain)


def test_adapter_id_shapes():
  assert lora.canonical_adapter_ids(2, 3, 5).shape == (3,)
  assert lora.canonical_adapter_ids(np.zeros((3, 5)), 3, 5).shape == (3, 5)
  np.testing.assert_array_equal(lora.broadcast_adapter_ids([1, -1], 2, 3),
                                [[1, 1, 1], [-1, -1, -1]])
  with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
    lora.canonical_adapter_ids(np.zeros((3, 4)), 3, 5)

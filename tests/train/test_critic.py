"""The critic: the head against NumPy, routing in the action frame against the KV-cache path
(each chunk of the sequence run with one adapter, as the sampler runs agent turns), gradient
isolation, the frozen-base fast path, and refusals by name.

Parameters are drawn with NumPy (compiling JAX's threefry sampler per shape costs seconds).
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from marft_jax import lora, validation
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.models.targets import linear_shapes
from marft_jax.train.critic import (CriticConfig, action_frame_ids, critic_hidden_states,
                                    init_critic, value_fns, values, values_from_hidden)
from marft_jax.train.batching import TrainBatch, padding_fields
from marft_jax.train.update import Extras
from tests.lora.conftest import random_params  # weights and norms off their init values

CONFIG = tiny_config()
LORA_CONFIG = lora.LoraConfig(rank=4, targets="q_proj|v_proj")  # as `random_adapters`
HIDDEN = (32, 16)  # Head widths of the tests (the default (1024, 512) only in the init test).
T = 10
# Row 0: prompt, agent 0's reply, a transition, agent 1's reply. Row 1: agent 1 first.
AGENT_IDS = np.asarray([[-1, -1, 0, 0, 0, -1, -1, 1, 1, 1],
                        [-1, -1, -1, 1, 1, -1, 0, 0, 0, 0]], np.int32)
# The agent deciding at each position (the one that emits the next token), written by hand.
ACTION_IDS = np.asarray([[-1, 0, 0, 0, -1, -1, 1, 1, 1, -1],
                         [-1, -1, 1, 1, -1, 0, 0, 0, 0, -1]], np.int32)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, T)), jnp.int32)


def random_adapters(num_adapters, rank=4, seed=1):
  """Adapters (scale 2, on q_proj and v_proj: cheap to compile) with both factors random, so
  that each changes the model."""
  rng = np.random.default_rng(seed)
  layers = {}
  for name in ("q_proj", "v_proj"):
    d_in, d_out = linear_shapes(CONFIG)[name]
    shape_a = (CONFIG.num_layers, num_adapters, d_in, rank)
    shape_b = (CONFIG.num_layers, num_adapters, rank, d_out)
    layers[name] = {"a": jnp.asarray(rng.normal(0, d_in ** -0.5, shape_a), jnp.float32),
                    "b": jnp.asarray(rng.normal(0, 0.2, shape_b), jnp.float32)}
  return lora.Adapters(layers=layers, scale=2.0)


def random_head(num_heads, seed=2):
  """Kernels [N, in, out], normal(0, 1/√in): values of order 1."""
  rng = np.random.default_rng(seed)
  sizes = (CONFIG.hidden_size,) + HIDDEN + (1,)
  return [jnp.asarray(rng.normal(0, fan_in ** -0.5, (num_heads, fan_in, fan_out)), jnp.float32)
          for fan_in, fan_out in zip(sizes[:-1], sizes[1:])]


def numpy_head(kernels, h):
  """relu(relu(h W1) W2) W3 in float64. kernels: [in, out] each; h: [..., D]."""
  x = np.asarray(h, np.float64)
  for w in kernels[:-1]:
    x = np.maximum(x @ np.asarray(w, np.float64), 0.0)
  return (x @ np.asarray(kernels[-1], np.float64))[..., 0]


def head_n(head, n):
  return [w[n] for w in head]


PARAMS = random_params()
jit_values = jax.jit(values, static_argnums=(3, 4))
jit_hidden_states = jax.jit(transformer.hidden_states, static_argnums=2)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def run_values(request):
  return jit_values if request.param else values


def base_hidden(params=PARAMS, config=CONFIG, **kwargs):
  return np.asarray(transformer.hidden_states(params, TOKENS, config, **kwargs)[0], np.float32)


# --- the head --------------------------------------------------------------------------------


def test_head_equals_numpy_on_transformer_hidden_states(run_values):
  critic = {"head": random_head(1)}
  v = run_values(critic, PARAMS, TOKENS, CONFIG, CriticConfig(hidden=HIDDEN))
  assert v.shape == (2, T) and v.dtype == jnp.float32
  np.testing.assert_allclose(v, numpy_head(head_n(critic["head"], 0), base_hidden()),
                             rtol=1e-5, atol=1e-6)


def test_bf16_base_gives_f32_values_and_gradients():
  config = tiny_config(param_dtype="bfloat16", compute_dtype="bfloat16")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
  critic = {"head": random_head(1)}
  critic_config = CriticConfig(hidden=HIDDEN)
  v = values(critic, params, TOKENS, config, critic_config)  # eager: jit fuses bf16 ops
  assert v.dtype == jnp.float32                                # differently from the reference
  h = base_hidden(params, config)  # bf16 hidden states, then f32 for the head
  np.testing.assert_allclose(v, numpy_head(head_n(critic["head"], 0), h), rtol=1e-5, atol=1e-6)
  grads = jax.jit(jax.grad(lambda c: jnp.sum(values(c, params, TOKENS, config, critic_config))))(
      critic)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_init_shapes_and_dtypes():
  lora_config = lora.LoraConfig(rank=2, targets="q_proj|v_proj")
  cases = {"shared": (1, 1), "per_agent_lora": (1, 3), "per_agent_head": (3, 1)}
  for mode, (num_heads, num_adapters) in cases.items():
    critic_config = CriticConfig(mode=mode, lora=lora_config)
    critic = jax.eval_shape(lambda: init_critic(critic_config, CONFIG, 3, jax.random.key(0)))
    assert [w.shape for w in critic["head"]] == [(num_heads, 64, 1024), (num_heads, 1024, 512),
                                                 (num_heads, 512, 1)]
    assert critic["lora"].num_adapters == num_adapters
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(critic))
  assert "lora" not in init_critic(CriticConfig(), CONFIG, 2, jax.random.key(0))


def test_init_values_start_near_zero():
  critic_config = CriticConfig(mode="per_agent_head")
  critic = init_critic(critic_config, CONFIG, 2, jax.random.key(0))
  v = jit_values(critic, PARAMS, TOKENS, CONFIG, critic_config, agent_ids=AGENT_IDS)
  assert 0 < np.max(np.abs(v)) < 0.05


# --- routing in the action frame -------------------------------------------------------------


def test_action_frame_ids():
  np.testing.assert_array_equal(action_frame_ids(AGENT_IDS), ACTION_IDS)


def test_per_agent_heads_follow_the_agent_of_the_next_token(run_values):
  head = random_head(2)
  critic_config = CriticConfig(mode="per_agent_head", hidden=HIDDEN)
  v = np.asarray(run_values({"head": head}, PARAMS, TOKENS, CONFIG, critic_config,
                            agent_ids=AGENT_IDS))
  h = base_hidden()
  per_head = np.stack([numpy_head(head_n(head, n), h) for n in range(2)], axis=-1)
  expected = np.take_along_axis(per_head, np.maximum(ACTION_IDS, 0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(v, expected, rtol=1e-5, atol=1e-6)
  # Position 6 of row 0 decides agent 1's first token (a transition token in the token frame):
  # valued by agent 1's head, as a critic holding only that head values it.
  only_1 = values({"head": [w[1:] for w in head]}, PARAMS, TOKENS, CONFIG,
                  CriticConfig(hidden=HIDDEN))
  np.testing.assert_allclose(v[0, 6], only_1[0, 6], rtol=1e-6)
  assert abs(per_head[0, 6, 0] - per_head[0, 6, 1]) > 1e-2  # head 0 (AReaL's frame) differs


ADAPTERS = random_adapters(2)


def cached_turns(row, chunks):
  """Hidden states [T, D] of one row, run chunk by chunk through a KV cache, each chunk with
  one of ADAPTERS (-1: the base), as the sampler runs agent turns. chunks: (start, end, id)."""
  cache = transformer.init_cache(CONFIG, 1, T)
  out = []
  for start, end, adapter in chunks:
    one = None if adapter < 0 else lora.select_adapter(ADAPTERS, adapter)
    h, cache = jit_hidden_states(PARAMS, TOKENS[row:row + 1, start:end], CONFIG, cache=cache,
                                 lora=one, adapter_ids=0)
    out.append(np.asarray(h[0]))
  return np.concatenate(out)


def test_per_agent_lora_follows_the_agent_of_the_next_token():
  head = random_head(1)
  critic_config = CriticConfig(mode="per_agent_lora", hidden=HIDDEN, lora=LORA_CONFIG)
  v = jit_values({"head": head, "lora": ADAPTERS}, PARAMS, TOKENS, CONFIG, critic_config,
                 agent_ids=AGENT_IDS)
  # Row 0 by turns: position 0 decides a prompt token, 1-3 agent 0's tokens, 4-5 transition
  # tokens, 6-8 agent 1's, and 9 nothing. (Row 1's routing is the same function of its ids.)
  h = cached_turns(0, ((0, 1, -1), (1, 4, 0), (4, 6, -1), (6, 9, 1), (9, 10, -1)))
  np.testing.assert_allclose(v[0], numpy_head(head_n(head, 0), h), rtol=1e-4, atol=1e-5)
  # The token-frame routing (AReaL's) values position 6 (agent 1's first decision) with the base.
  areal = jit_hidden_states(PARAMS, TOKENS, CONFIG, lora=ADAPTERS, adapter_ids=AGENT_IDS)
  areal_v = numpy_head(head_n(head, 0), np.asarray(areal[0]))
  assert abs(areal_v[0, 6] - v[0, 6]) > 1e-3


def test_shared_lora_applies_at_every_position(run_values):
  adapters, head = random_adapters(1), random_head(1)
  critic_config = CriticConfig(hidden=HIDDEN, lora=LORA_CONFIG)
  v = run_values({"head": head, "lora": adapters}, PARAMS, TOKENS, CONFIG, critic_config)
  h = base_hidden(lora=adapters, adapter_ids=np.zeros((2, T), np.int32))
  np.testing.assert_allclose(v, numpy_head(head_n(head, 0), h), rtol=1e-5, atol=1e-6)


# --- gradients -------------------------------------------------------------------------------


def _scans(jaxpr) -> int:
  """Number of `scan` equations, nested ones included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "scan"
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _scans(sub)
  return count


CASES = {
    "shared": ({"head": random_head(1)}, CriticConfig(hidden=HIDDEN)),
    "per_agent_head": ({"head": random_head(2)},
                       CriticConfig(mode="per_agent_head", hidden=HIDDEN)),
    "shared_lora": ({"head": random_head(1), "lora": random_adapters(1)},
                    CriticConfig(hidden=HIDDEN, lora=LORA_CONFIG)),
    "per_agent_lora": ({"head": random_head(1), "lora": random_adapters(2)},
                       CriticConfig(mode="per_agent_lora", hidden=HIDDEN,
                                    lora=LORA_CONFIG)),
}


def weighted_values(critic, base, weights, critic_config, tokens=TOKENS, agent_ids=AGENT_IDS):
  v = values(critic, base, tokens, CONFIG, critic_config, agent_ids=agent_ids)
  return jnp.sum(v * weights)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_reach_the_critic_only(case):
  critic, critic_config = CASES[case]
  loss = functools.partial(weighted_values, weights=jnp.ones((2, T)),
                           critic_config=critic_config)
  grad_critic, grad_base = jax.jit(jax.grad(loss, argnums=(0, 1)))(critic, PARAMS)
  assert all(not np.any(g) for g in jax.tree.leaves(grad_base))
  assert all(np.any(g) for g in jax.tree.leaves(grad_critic))
  # Without a critic LoRA nothing is differentiated through the decoder: the gradient program
  # holds the forward's layer scan only (a backward pass would add a second one).
  scans = _scans(jax.make_jaxpr(jax.grad(loss))(critic, PARAMS).jaxpr)
  assert scans >= 1 and (scans == 1) == ("lora" not in critic)


def test_a_loss_on_agent_0_leaves_agent_1_critic_untouched():
  weights = jnp.asarray(ACTION_IDS[:1] == 0, jnp.float32)  # row 0: agent 0 decides first
  for case, (part, agent_axis) in {"per_agent_head": ("head", 0),
                                   "per_agent_lora": ("lora", 1)}.items():
    critic, critic_config = CASES[case]
    grads = jax.jit(jax.grad(weighted_values), static_argnums=3)(
        critic, PARAMS, weights, critic_config, TOKENS[:1], AGENT_IDS[:1])
    for g in jax.tree.leaves(grads[part]):
      assert np.any(np.take(np.asarray(g), 0, axis=agent_axis)), case
      assert not np.any(np.take(np.asarray(g), 1, axis=agent_axis)), case


# --- the frozen-base fast path ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["shared", "per_agent_head"])
def test_fast_path_equals_the_full_path(case):
  critic, critic_config = CASES[case]
  h = critic_hidden_states(critic, PARAMS, TOKENS, CONFIG, critic_config)
  ids = action_frame_ids(AGENT_IDS)
  weights = jnp.asarray(np.random.default_rng(3).normal(size=(2, T)), jnp.float32)
  fast = lambda head: jnp.sum(values_from_hidden(head, h, ids, critic_config.mode) * weights)
  full = lambda head: weighted_values({"head": head}, PARAMS, weights, critic_config)
  np.testing.assert_allclose(fast(critic["head"]), jax.jit(full)(critic["head"]), rtol=1e-6)
  grads_full = jax.jit(jax.grad(full))(critic["head"])
  for g_fast, g_full in zip(jax.grad(fast)(critic["head"]), grads_full):
    np.testing.assert_allclose(g_fast, g_full, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", sorted(CASES))
def test_trainer_values_at_positions_equal_the_full_values_there(case):
  """`value_fns` as the update calls it: every position, or one decision per turn."""
  critic, critic_config = CASES[case]
  full = np.asarray(values(critic, PARAMS, TOKENS, CONFIG, critic_config, agent_ids=AGENT_IDS))
  batch = TrainBatch(**padding_fields(2, T, 3, 0, pad_id=0)).replace(
      tokens=TOKENS, mask=jnp.ones((2, T), bool), act_agent=jnp.asarray(ACTION_IDS))
  trainer_values, hidden = value_fns(critic_config, CONFIG)
  assert (hidden is None) == (critic_config.lora is not None)
  extras = Extras(old_logp=None, ref_logp=None,
                  critic_hidden=None if hidden is None else hidden(critic, PARAMS, batch))
  positions = jnp.asarray([[1, 6, 0], [2, 5, 9]], jnp.int32)  # [B, K]
  at = jax.jit(trainer_values)(critic, PARAMS, batch, extras, positions)
  np.testing.assert_allclose(at, np.take_along_axis(full, np.asarray(positions), axis=1),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(trainer_values(critic, PARAMS, batch, extras), full,
                             rtol=1e-5, atol=1e-6)


def test_no_critic_has_no_value_functions():
  assert value_fns(None, CONFIG) == (None, None)


# --- refusals by name ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, key", [
    (dict(mode="central"), "mode="),
    (dict(hidden=(1024, 0)), "hidden="),
    (dict(hidden=1024), "hidden="),
    (dict(lora="q_proj"), "lora="),
    (dict(mode="per_agent_lora"), "lora=None"),
    (dict(init_scale=-1.0), "init_scale="),
    (dict(init_scale=float("nan")), "init_scale="),
])
def test_config_errors_name_the_key(kwargs, key):
  with pytest.raises(ValueError, match=key):
    CriticConfig(**kwargs)


def test_list_hidden_becomes_a_hashable_tuple():
  assert hash(CriticConfig(hidden=[8, 4])) == hash(CriticConfig(hidden=(8, 4)))


def test_argument_errors_name_the_argument():
  critic, critic_config = CASES["per_agent_head"]
  with pytest.raises(ValueError, match="num_agents"):
    init_critic(critic_config, CONFIG, 0, jax.random.key(0))
  with pytest.raises(ValueError, match="agent_ids=None"):
    values(critic, PARAMS, TOKENS, CONFIG, critic_config)
  with pytest.raises(ValueError, match="agent_ids: id 2"):
    values(critic, PARAMS, TOKENS, CONFIG, critic_config, agent_ids=np.full((2, T), 2))
  with pytest.raises(ValueError, match="agent_ids has shape"):
    values(critic, PARAMS, TOKENS, CONFIG, critic_config, agent_ids=AGENT_IDS[:, :-1])
  with pytest.raises(ValueError, match="mode="):
    values_from_hidden(critic["head"], jnp.zeros((2, T, 64)), None, "central")
  with pytest.raises(ValueError, match="head_params hold 2 heads"):
    values_from_hidden(critic["head"], jnp.zeros((2, T, 64)), None, "shared")
  lora_critic, lora_config = CASES["per_agent_lora"]
  with pytest.raises(ValueError, match="agent_ids: id -2"):
    values(lora_critic, PARAMS, TOKENS, CONFIG, lora_config, agent_ids=np.full((2, T), -2))


def test_traced_bad_agent_ids_are_reported_under_checkify():
  critic, critic_config = CASES["per_agent_head"]
  run = jax.jit(lambda ids: values(critic, PARAMS, TOKENS, CONFIG, critic_config, agent_ids=ids))
  with validation.traced_checks():
    err, _ = checkify.checkify(run, errors=checkify.user_checks)(np.full((2, T), 5, np.int32))
  with pytest.raises(Exception, match="agent_ids"):
    err.throw()

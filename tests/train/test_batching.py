"""`act_positions`' widths; `per_row_adapters`: when it may switch to per-row adapter ids, and
that the update it feeds computes exactly what per-token ids compute."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench.update import turn_batch
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.train.batching import (act_positions, bucket_length, per_row_adapters,
                                      positions_width)
from marft_jax.train.update import LossConfig, TrainState, make_update, prepare
from tests.train.nonzero_adapters import nonzero_adapters

ROWS, PROMPT, REPLY = 4, 8, 8


def _padded_batch(vocab):
  """Rows of agents 0, 1, 0, 1; rows 1 and 3 end 3 tokens early (padding: id -1, masked)."""
  batch = turn_batch(vocab, ROWS, PROMPT, REPLY)
  mask = np.ones((ROWS, PROMPT + REPLY), bool)
  mask[1::2, -3:] = False
  ids = np.where(mask, np.asarray(batch.adapter_ids), -1).astype(np.int32)
  act = np.asarray(batch.act_mask) & np.roll(mask, -1, axis=1) & mask
  return batch.replace(mask=mask, adapter_ids=ids, act_mask=act, act_positions=act_positions(act))


@pytest.mark.parametrize("n, T, width", [
    (96, 256, 96), (97, 256, 128), (1, 256, 32), (0, 256, 32), (256, 256, 256),
    (200, 512, 256), (5, 12, 5), (12, 12, 12), (9, 64, 16)])
def test_positions_width_rounds_up_to_an_eighth_of_the_length(n, T, width):
  assert positions_width(n, T) == width


@pytest.mark.parametrize("n, minimum, width", [
    (1, 64, 64), (64, 64, 64), (65, 64, 128), (256, 64, 256), (257, 64, 384), (384, 64, 384),
    (385, 64, 512), (512, 64, 512), (513, 64, 768), (587, 64, 768), (769, 64, 1024),
    (1537, 64, 2048), (0, 64, 64), (33, 8, 48), (49, 8, 64), (65, 16, 96)])
def test_bucket_length_is_a_multiple_of_the_minimum_then_two_widths_an_octave(n, minimum,
                                                                              width):
  assert bucket_length(n, minimum) == width


def test_bucket_length_pads_a_row_by_less_than_a_third_above_four_minimums():
  widths = [bucket_length(n) for n in range(257, 8193)]
  assert all(w >= n and (w - n) / w < 1 / 3 for n, w in zip(range(257, 8193), widths))
  assert len(set(widths)) == 2 * 5  # 384, 512, 768, ..., 8192: two an octave


def test_act_positions_lists_each_rows_decisions_then_padding():
  act = np.zeros((3, 256), bool)
  act[0, 159:255] = True  # a 96-token reply after a 160-token prompt
  act[1, [3, 7, 100]] = True
  got = act_positions(act)
  assert got.shape == (3, 96)
  np.testing.assert_array_equal(got[0], np.arange(159, 255))
  np.testing.assert_array_equal(got[1], [3, 7, 100] + [-1] * 93)
  np.testing.assert_array_equal(got[2], -1)


def test_single_adapter_rows_become_per_row_ids():
  batch = _padded_batch(50)
  out = per_row_adapters(batch)
  np.testing.assert_array_equal(out.adapter_ids, [0, 1, 0, 1])
  assert per_row_adapters(out) is out  # already per row


def test_an_all_padding_row_gets_no_adapter():
  batch = _padded_batch(50)
  mask = np.asarray(batch.mask).copy()
  mask[2] = False
  out = per_row_adapters(batch.replace(mask=mask))
  np.testing.assert_array_equal(out.adapter_ids, [0, 1, -1, 1])


@pytest.mark.parametrize("where", [0, PROMPT + 2])
def test_a_row_mixing_adapters_keeps_per_token_ids(where):
  """A base-processed token (-1, as a shared stream's transition turn) or another agent's
  token inside a row's real tokens keeps the whole batch per token."""
  batch = _padded_batch(50)
  for other in (-1, 1):
    ids = np.asarray(batch.adapter_ids).copy()
    ids[0, where] = other
    out = per_row_adapters(batch.replace(adapter_ids=ids))
    assert out.adapter_ids.shape == (ROWS, PROMPT + REPLY)
    np.testing.assert_array_equal(out.adapter_ids, ids)


def test_the_update_is_the_same_with_per_row_and_per_token_ids():
  config = tiny_config()
  params = transformer.init_params(config, jax.random.key(0))
  policy = nonzero_adapters(config)
  optimizer = optax.adamw(1e-2, eps=1e-5)
  state = TrainState(policy=policy, critic=None, policy_opt=optimizer.init(policy),
                     critic_opt=None, step=jnp.zeros((), jnp.int32))
  per_token = jax.tree.map(jnp.asarray, _padded_batch(config.vocab_size))
  per_row = jax.tree.map(jnp.asarray, per_row_adapters(per_token))
  assert per_row.adapter_ids.shape == (ROWS,)
  loss = LossConfig(policy_level="action")
  update = make_update(config, loss, optimizer, None, None, 2, epochs=1, minibatches=2)
  results = []
  for batch in (per_token, per_row):
    extras = prepare(params, policy, batch, config, loss, minibatches=2)
    new_state, metrics = update(state, params, batch, extras, jnp.ones((2,), bool),
                                jnp.asarray(True), jax.random.key(3))
    results.append((extras.old_logp, new_state.policy.layers, metrics))
  (logp_t, layers_t, metrics_t), (logp_r, layers_r, metrics_r) = results
  np.testing.assert_allclose(logp_r, logp_t, rtol=1e-5, atol=1e-6)
  assert float(jnp.max(jnp.abs(logp_t))) > 0  # the comparison saw real log-probs
  moved = jax.tree.map(lambda new, old: float(jnp.max(jnp.abs(new - old))), layers_t,
                       policy.layers)
  assert max(jax.tree.leaves(moved)) > 1e-4  # the update moved the adapters
  jax.tree.map(lambda r, t: np.testing.assert_allclose(r, t, rtol=1e-5, atol=1e-6),
               layers_r, layers_t)
  for key in ("policy_loss", "approx_kl", "adapter0/grad_norm", "adapter1/grad_norm"):
    np.testing.assert_allclose(metrics_r[key], metrics_t[key], rtol=1e-4, atol=1e-6)

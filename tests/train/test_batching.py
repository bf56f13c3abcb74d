"""`act_positions`' widths; the rows' length buckets (`row_length`, and the trainer passing it
`optimizer.row_length_step`); `per_row_adapters`: when it may switch to per-row adapter ids,
and that the update it feeds computes exactly what per-token ids compute."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench.update import turn_batch
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.train import batching, loop
from marft_jax.train.build import model as model_lib
from marft_jax.train import run as run_lib
from marft_jax.train.config import OptimizerSection
from marft_jax.train.batching import (ROW_LENGTH_STEPS, act_positions, bucket_length,
                                      per_row_adapters, positions_width, row_length)
from marft_jax.train.update import LossConfig, TrainState, make_update, prepare
from tests.train.echo_config import echo_config
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
    (200, 512, 256), (5, 12, 5), (12, 12, 12), (9, 64, 16), (48, 160, 48), (49, 160, 64),
    (9, 96, 16), (3, 32, 4), (25, 224, 48)])
def test_positions_width_rounds_up_to_an_eighth_of_the_length(n, T, width):
  assert positions_width(n, T) == width


def test_positions_width_is_unchanged_at_the_row_lengths_before_row_length_step():
  """At every T of step 64's rule (old checkpoints' batches), a multiple of T/8 as before."""
  for T in sorted({row_length(n, 64) for n in range(1, 8193)}):
    for n in range(T + 1):
      assert positions_width(n, T) == min(-(-max(n, 1) // (T // 8)) * (T // 8), T), (n, T)


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


@pytest.mark.parametrize("step", ROW_LENGTH_STEPS)
def test_row_length_is_the_next_multiple_of_the_step_then_two_widths_an_octave(step):
  """Every n to 8192 against the definition: up to 256 the smallest multiple of `step` that
  holds n; above, the smallest of 384, 512, 768, 1024, ... (2^k and 3·2^(k-1)) that does."""
  octaves = sorted({w for k in range(8, 14) for w in (2 ** k, 3 * 2 ** (k - 1))})
  for n in range(0, 8193):
    want = (max(n, 1) + step - 1) // step * step if n <= 256 else \
        next(w for w in octaves if w >= n)
    assert row_length(n, step) == want, (n, step)


def test_row_length_at_step_64_is_the_rule_before_the_key():
  """Checkpoints written before optimizer.row_length_step resume with 64: the same rows."""
  assert [row_length(n, 64) for n in range(8193)] == [bucket_length(n) for n in range(8193)]


@pytest.mark.parametrize("step", [0, 24, 512, 33])
def test_a_row_length_step_not_offered_is_refused_naming_the_key(step):
  with pytest.raises(ValueError, match="row_length_step"):
    row_length(100, step)
  with pytest.raises(ValueError, match="row_length_step"):
    echo_config(optimizer=OptimizerSection(row_length_step=step))


def test_the_trainer_pads_rows_to_its_row_length_step(monkeypatch, tmp_path):
  """loop.train's batch is `make_batch` at optimizer.row_length_step (the run stopped there):
  step 128 pads the echo rows (under 64 tokens with every reply at its budget) to 128."""
  from marft_jax.models import tiny
  seen = []

  def recording(episodes, *args, **kwargs):
    longest = batching.budgeted_widths(episodes, kwargs.get("reply_budgets"))[0]
    seen.append((longest, batching.make_batch(episodes, *args, **kwargs).tokens.shape[1]))
    raise _Stop

  monkeypatch.setattr(run_lib, "make_batch", recording)
  config = echo_config(num_envs=2, iterations=1, optimizer=OptimizerSection(row_length_step=128))
  with pytest.raises(_Stop):
    loop.train(config, str(tmp_path), model=model_lib.Model(*tiny.tiny_model()), progress=False)
  [(longest, T)] = seen
  assert T == 128 and row_length(longest, 32) <= 64, seen


class _Stop(Exception):
  pass


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

"""Padding rows (a batch padded to the most rows its team can fill) cost the update nothing and
change nothing: minibatches are filled with real rows first, a slot of padding alone is
skipped, and `prepare` and the values at rollout time skip blocks of padding rows. Padding
columns (a longer row length, `optimizer.row_length_step`) change only the rounding.

Reference: the same update on the real rows alone, unpadded, with one minibatch (the padded
batch's minibatch size), which trains exactly those rows in one step; the same rows without
the padding columns; and NumPy checks of each epoch's order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bench.update import turn_batch
from marft_jax.lora.config import LoraConfig
from marft_jax.models import transformer
from marft_jax.models.config import tiny_config
from marft_jax.train import critic as critic_lib
from marft_jax.train.batching import PADDING, TrainBatch, padding_fields, per_row_adapters
from marft_jax.train.update import (Extras, LossConfig, TrainState, make_update, minibatch_slots,
                                    prepare)
from tests.train.nonzero_adapters import nonzero_adapters

REAL, PROMPT, REPLY = 4, 6, 5


def _padded(batch: TrainBatch, where: str) -> TrainBatch:
  """`batch`'s rows with as many padding rows, after them ("end", as one process's batch)
  or between them ("interleaved", as the blocks of several processes)."""
  pad = padding_fields(REAL, PROMPT + REPLY, 1, batch.act_positions.shape[1], pad_id=0)
  pad["adapter_ids"] = pad["adapter_ids"][:, 0]  # per-row ids, as the real rows'
  both = jax.tree.map(lambda x, p: np.concatenate([np.asarray(x), p]), batch, TrainBatch(**pad))
  order = np.arange(2 * REAL) if where == "end" else \
      np.stack([np.arange(REAL), REAL + np.arange(REAL)], axis=1).reshape(-1)
  return jax.tree.map(lambda x: x[order], both), order


@pytest.fixture(scope="module")
def setup():
  config = tiny_config()
  params = transformer.init_params(config, jax.random.key(0))
  policy = nonzero_adapters(config)
  critic_config = critic_lib.CriticConfig(mode="shared", hidden=(16,))
  critic = critic_lib.init_critic(critic_config, config, 2, jax.random.key(1))
  policy_opt, critic_opt = optax.adamw(1e-2, eps=1e-5), optax.adam(1e-2, eps=1e-5)
  state = TrainState(policy=policy, critic=critic, policy_opt=policy_opt.init(policy),
                     critic_opt=critic_opt.init(critic), step=jnp.zeros((), jnp.int32))
  values, hidden = critic_lib.value_fns(critic_config, config)
  batch = per_row_adapters(turn_batch(config.vocab_size, REAL, PROMPT, REPLY))
  loss = LossConfig(policy_level="action")

  def run(batch, minibatches, loss=loss):
    """(extras, new state, metrics) of one epoch over `batch` in `minibatches`."""
    update = make_update(config, loss, policy_opt, critic_opt, values, 2, epochs=1,
                         minibatches=minibatches)
    batch = jax.tree.map(jnp.asarray, batch)
    extras = prepare(params, state.policy, batch, config, loss,
                     lambda p, b, chunks: hidden(state.critic, p, b, chunks=chunks),
                     minibatches=minibatches)
    new_state, metrics = update(state, params, batch, extras, jnp.ones((2,), bool),
                                jnp.asarray(True), jax.random.key(3))
    return extras, new_state, {k: float(v) for k, v in metrics.items()}

  return dict(state=state, batch=batch, run=run, reference=run(batch, 1))


@pytest.mark.parametrize("where", ["end", "interleaved"])
def test_padding_rows_train_exactly_like_the_real_rows_alone(setup, where):
  batch, order = _padded(setup["batch"], where)
  (ref_extras, ref_state, ref_metrics) = setup["reference"]
  extras, state, metrics = setup["run"](batch, 2)  # 8 rows: 2 slots of 4, one of padding
  real = order < REAL  # the padded batch's real rows; they hold rows order[real] in order
  close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5,
                                                  atol=1e-6)
  # prepare: the real rows' π_old and critic inputs; zeros for a block of padding alone.
  close(np.asarray(extras.old_logp)[real], ref_extras.old_logp)
  close(np.asarray(extras.critic_hidden)[real], ref_extras.critic_hidden)
  if where == "end":
    assert not np.any(np.asarray(extras.critic_hidden)[REAL:])
  # The update: one step on the four real rows, the slot of padding skipped.
  assert metrics["minibatches_trained"] == ref_metrics["minibatches_trained"] == 1
  moved = max(float(jnp.max(jnp.abs(new - old))) for new, old in
              zip(jax.tree.leaves(ref_state.policy), jax.tree.leaves(setup["state"].policy)))
  assert moved > 1e-4
  jax.tree.map(close, state.policy, ref_state.policy)
  # The critic and its moments did not move in the skipped slot (they used to follow
  # Adam's momentum there, on a zero gradient).
  jax.tree.map(close, state.critic, ref_state.critic)
  jax.tree.map(close, state.critic_opt, ref_state.critic_opt)
  floats = lambda tree: [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype,
                                                                             jnp.floating)]
  for x, y in zip(floats(state.policy_opt), floats(ref_state.policy_opt)):
    close(x, y)
  # The policy's step count follows the slots (its learning-rate schedule is in slots).
  assert int(state.step) == 2 and int(ref_state.step) == 1
  for key in ("policy_loss", "value_loss", "approx_kl", "adapter0/grad_norm",
              "first_ratio_max_dev", "nonfinite"):
    np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-6,
                               err_msg=key)


def _widened(batch: TrainBatch, columns: int) -> TrainBatch:
  """`batch` with `columns` more padding columns in every [B, T] field (per-row adapter ids,
[B], unchanged)."""
  B = batch.tokens.shape[0]
  pad = padding_fields(B, columns, batch.turn_valid.shape[1], batch.act_positions.shape[1],
                       pad_id=0)
  wide = lambda name: np.concatenate([np.asarray(getattr(batch, name)), pad[name]], axis=1)
  return batch.replace(**{name: wide(name) for name, (width, _, _) in PADDING.items()
                          if width == "T" and np.ndim(getattr(batch, name)) == 2})


def test_padding_columns_train_like_the_rows_without_them(setup):
  """The rows padded to 3 times their length (as `optimizer.row_length_step`'s coarser steps
  pad them) train as the rows without the padding columns, to f32 rounding: π_old and the
  critic's inputs, the new adapters, critic and their moments, and the metrics. Token level:
  its losses and values are [B, T] means (the action level's are [B, K])."""
  loss = LossConfig(policy_level="token")
  batch = setup["batch"]
  T = batch.tokens.shape[1]
  decisions = np.random.default_rng(0).normal(size=(2,) + batch.tokens.shape) * batch.act_mask
  batch = batch.replace(act_advantage=decisions[0].astype(np.float32),
                        act_return=decisions[1].astype(np.float32))  # token level's
  want_extras, want, want_metrics = setup["run"](batch, 2, loss)
  extras, got, metrics = setup["run"](_widened(batch, 2 * T), 2, loss)
  close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5,
                                                  atol=1e-6)
  close(np.asarray(extras.old_logp)[:, :T], want_extras.old_logp)
  close(np.asarray(extras.critic_hidden)[:, :T], want_extras.critic_hidden)
  assert not np.any(np.asarray(extras.old_logp)[:, T:])
  moved = max(float(jnp.max(jnp.abs(new - old))) for new, old in
              zip(jax.tree.leaves(want.policy), jax.tree.leaves(setup["state"].policy)))
  assert moved > 1e-4
  # Adam divides a gradient by its own magnitude: a near-zero one's rounding moves its
  # weight by up to about lr · 1e-4 (2.5e-6 seen).
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-5), got, want)
  for key, value in want_metrics.items():
    np.testing.assert_allclose(metrics[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("real_rows, minibatches, taken", [
    ([1, 1, 1, 1, 1, 1, 1, 1], 4, [1, 1, 1, 1]),
    ([0, 1, 0, 0, 1, 1, 0, 0], 4, [1, 1, 0, 0]),
    ([0, 0, 0, 0, 0, 0, 0, 1], 2, [1, 0]),
    ([1, 1, 1, 0, 1, 0, 1, 0], 2, [1, 1]),
])
def test_each_epoch_shuffles_the_real_rows_first(real_rows, minibatches, taken):
  real = np.asarray(real_rows, bool)
  epochs = 3
  indices, trained = minibatch_slots(jax.random.key(7), jnp.asarray(real), epochs, minibatches)
  indices = np.asarray(indices).reshape(epochs, -1)
  np.testing.assert_array_equal(np.asarray(trained).reshape(epochs, -1),
                                np.tile(np.asarray(taken, bool), (epochs, 1)))
  R = int(real.sum())
  for order in indices:
    assert sorted(order) == list(range(len(real)))  # a permutation of the rows
    assert real[order[:R]].all() and not real[order[R:]].any()  # real rows first
  # A full batch keeps the plain shuffle of every epoch.
  if real.all():
    keys = jax.random.split(jax.random.key(7), epochs)
    for key, order in zip(keys, indices):
      np.testing.assert_array_equal(order, np.asarray(jax.random.permutation(key, len(real))))
  else:  # and the real rows are really shuffled: their orders differ between epochs
    assert len({tuple(order[:R]) for order in indices}) > 1 or R == 1


@pytest.mark.parametrize("mode", ["per_agent_lora", "shared"])
def test_the_rollout_values_of_a_padded_batch_are_the_real_rows_values(setup, mode):
  """The trainer's values at rollout time (`critic.batch_values_fn`), by blocks of rows: the
  real rows' values as the critic gives them unpadded, and a block of padding skipped."""
  config = tiny_config()
  params = transformer.init_params(config, jax.random.key(0))
  lora = LoraConfig(rank=4, alpha=8.0) if mode == "per_agent_lora" else None
  critic_config = critic_lib.CriticConfig(mode=mode, hidden=(16,), lora=lora)
  critic = critic_lib.init_critic(critic_config, config, 2, jax.random.key(1))
  if lora is not None:  # nonzero critic adapters, so they change the values
    critic["lora"] = critic["lora"].replace(layers=jax.tree.map(
        lambda x: x + 0.05, critic["lora"].layers))
  values, hidden = critic_lib.value_fns(critic_config, config)
  batch, order = _padded(setup["batch"], "end")

  def extras_of(b, chunks):
    h = None if hidden is None else hidden(critic, params, b, chunks=chunks)
    zeros = jnp.zeros(b.tokens.shape, jnp.float32)
    return Extras(old_logp=zeros, ref_logp=zeros, critic_hidden=h)

  padded = jax.tree.map(jnp.asarray, batch)
  real = jax.tree.map(jnp.asarray, setup["batch"])
  got = np.asarray(critic_lib.batch_values_fn(values, 2)(critic, params, padded,
                                                       extras_of(padded, 2)))
  want = np.asarray(values(critic, params, real, extras_of(real, 1)))
  np.testing.assert_allclose(got[:REAL], want, rtol=2e-5, atol=1e-6)
  assert np.abs(want).max() > 1e-3  # real values were compared
  assert not np.any(got[REAL:])  # the block of padding rows was skipped

"""The mesh changes how the update's rows are laid out, never which rows train together.

A mesh of S batch shards pads the batch to a multiple of minibatches × S rows so that every
minibatch splits over the shards. Before `minibatch_slots` drew its minibatches over the
logical rows, `mesh.data=6` padded a 16-row batch to 24 and shuffled all 24: its minibatches
held 12 and 4 real rows where one device's held 8 and 8, so the run trained otherwise than
on one device, by more than rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.train import config as config_lib
from marft_jax.train import loop
from marft_jax.train import update
from marft_jax.train.update import minibatch_slots
from tests.fixtures.old_checkpoints import make
from tests.train.echo_config import echo_config, tiny_trainer_model

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs


def _cases(count: int, seed: int = 0):
  """(team rows, minibatches, shards, processes, real rows per process, epochs), drawn."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    minibatches = int(rng.integers(1, 5))
    shards = int(rng.choice([1, 2, 3, 4, 6, 8]))
    processes = int(rng.choice([d for d in (1, 2, 4) if shards % d == 0]))
    rows = int(rng.integers(1, 40))
    L = -(-rows // minibatches) * minibatches
    B = -(-rows // (minibatches * shards)) * minibatches * shards
    # Each process holds B / processes rows: its own real rows first, then its padding.
    real = [int(rng.integers(0, B // processes + 1)) for _ in range(processes)]
    while sum(real) > rows:
      real[int(np.argmax(real))] -= 1
    yield L, B, minibatches, processes, real, int(rng.integers(1, 4))


@pytest.mark.parametrize("case", list(_cases(30)))
def test_a_padded_batch_trains_the_same_rows_together_as_one_device(case):
  """For every layout a mesh makes (any team rows, minibatches, shards, processes, real rows
  per process), each minibatch holds exactly the real rows, in order, of one device's
  minibatch over the same real rows (the batch compacted, padding behind), with the same
  key; the padding rows fill it and each row appears once an epoch."""
  L, B, minibatches, processes, real, epochs = case
  block = B // processes
  physical = np.zeros(B, bool)
  for p, r in enumerate(real):
    physical[p * block:p * block + r] = True
  compact = np.arange(L) < sum(real)
  key = jax.random.key(sum(real) * 7 + B)
  slots = jax.jit(update.minibatch_slots, static_argnums=(2, 3, 4))  # one compile, not ~40 ops
  reference, reference_taken = slots(key, jnp.asarray(compact), epochs, minibatches, None)
  got, taken = slots(key, jnp.asarray(physical), epochs, minibatches, L)
  got, reference = np.asarray(got), np.asarray(reference)
  assert got.shape == (epochs * minibatches, B // minibatches)
  real_rows = np.flatnonzero(physical)  # the i-th real row of the padded batch
  for slot, want in zip(got, reference):
    np.testing.assert_array_equal(slot[physical[slot]], real_rows[want[want < sum(real)]])
  for epoch in got.reshape(epochs, -1):
    assert sorted(epoch) == list(range(B))
  np.testing.assert_array_equal(taken, reference_taken)


def test_one_devices_batch_keeps_the_plain_draw():
  """One device's batch (its real rows first, L = B) draws as before the mesh's slots, bit
  for bit: each epoch's permutation of the rows, the real ones moved first (stable), so
  today's checkpoints resume as they trained."""
  real = jnp.asarray([1, 1, 1, 1, 1, 0, 0, 0], bool)
  got, _ = minibatch_slots(jax.random.key(3), real, 2, 2, logical_rows=8)

  def order(key):
    shuffled = jax.random.permutation(key, 8)
    return shuffled[jnp.argsort(~real[shuffled], stable=True)]
  np.testing.assert_array_equal(got.reshape(2, 8), jax.vmap(order)(jax.random.split(
      jax.random.key(3), 2)))


@pytest.fixture(scope="module")
def model():
  return tiny_trainer_model()


def _policy_after_one_iteration(model, workdir, data):
  config = dataclasses.replace(
      echo_config("marft_a", num_envs=8, iterations=1, checkpoint_every=1),
      mesh=config_lib.MeshSection(data=data))
  loop.train(config, workdir, model=model, progress=False)
  return make.policy_arrays(workdir, 1)


def test_a_run_on_six_batch_shards_trains_as_on_one_device(model, tmp_path):
  """The echo team's 16 rows pad to 24 on 6 shards (minibatches of 12 rows, 8 of them real,
  as one device's 8): its adapters after one iteration are one device's, to rounding."""
  assert jax.device_count() >= 6  # tests/conftest.py: 8 virtual CPU devices
  one = _policy_after_one_iteration(model, str(tmp_path / "one"), 1)
  six = _policy_after_one_iteration(model, str(tmp_path / "six"), 6)
  assert set(one) == set(six)
  moved = False
  for name in one:
    np.testing.assert_allclose(six[name], one[name], rtol=0, atol=2e-5, err_msg=name)
    moved |= name.endswith("/b") and bool(np.any(one[name] != 0))  # B starts at 0
  assert moved  # the update trained something

"""Checkpointing leaves nothing behind: a long run's saves do not pile up Python objects.

TensorStore's `experimental_collect_matching_metrics` leaks the objects it returns, and Orbax
calls it around every save only for a log line (`checkpoint.skip_orbax_byte_counts`). The
measure is the count of objects the garbage collector tracks, after a warm-up of saves (the
first ones fill Orbax's bounded caches: `get_storage_type` keeps the last 32 paths, two a
save), per further save.
"""

import gc

import jax.numpy as jnp
import pytest
import tensorstore

from marft_jax.train import checkpoint

WARMUP, SAVES = 24, 24


def _state():
  return {"lora": jnp.ones((2, 16, 8)), "critic": jnp.zeros((64,)),
          "opt": [jnp.full((4, 4), 0.5)] * 6}


def _objects() -> int:
  gc.collect()
  return len(gc.get_objects())


def _objects_per_save(workdir) -> float:
  state = _state()
  with checkpoint.Checkpointer(workdir, max_to_keep=2) as ckpt:
    for step in range(WARMUP):
      ckpt.save(step, state, {"step": step})
    before = _objects()
    for step in range(WARMUP, WARMUP + SAVES):
      ckpt.save(step, state, {"step": step})
    return (_objects() - before) / SAVES


def test_saves_leave_no_objects_behind(tmp_path):
  # Orbax keeps a bounded list of its steps' infos: a few objects in all, not per save.
  assert _objects_per_save(tmp_path) < 1.0


def _tensorstore_leaks() -> bool:
  tensorstore.experimental_collect_matching_metrics("/tensorstore/")
  before = _objects()
  for _ in range(50):
    tensorstore.experimental_collect_matching_metrics("/tensorstore/")
  return _objects() - before >= 25


def test_without_the_workaround_each_save_leaves_objects(tmp_path, monkeypatch):
  """The mutant: Orbax's own byte count back in place. The measure above catches it."""
  if not _tensorstore_leaks():
    pytest.skip(f"tensorstore {tensorstore.__version__} no longer leaks its metrics: "
                "checkpoint.skip_orbax_byte_counts can go")
  from orbax.checkpoint._src.serialization import tensorstore_utils
  original = checkpoint._ORBAX_RAW_BYTES
  assert original is not None and original is not tensorstore_utils.get_tensorstore_raw_bytes
  monkeypatch.setattr(checkpoint, "skip_orbax_byte_counts", lambda: False)
  monkeypatch.setattr(tensorstore_utils, "get_tensorstore_raw_bytes", original)
  assert _objects_per_save(tmp_path) >= 5.0


def test_the_workaround_is_idempotent():
  assert checkpoint.skip_orbax_byte_counts() and checkpoint.skip_orbax_byte_counts()
  from orbax.checkpoint._src.serialization import tensorstore_utils
  assert tensorstore_utils.get_tensorstore_raw_bytes() is None

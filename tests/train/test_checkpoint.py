"""Checkpointer: exact round trips, refusals (NaN, other structure or config), atomicity under
SIGKILL, retention of PEFT exports, and the SIGTERM flag of a running loop."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marft_jax.lora import Adapters
from marft_jax.lora.peft_io import CONFIG_FILE, WEIGHTS_FILE
from marft_jax.train import checkpoint
from marft_jax.train.checkpoint import (Checkpointer, CheckpointMismatchError,
                                        NonFiniteStateError, PreemptionFlag)

# After a damaged checkpoint's failed read, tensorstore's reads still in flight report "Event
# loop is closed" as unraisable exceptions, during that test or the next one.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = {"num_agents": 2, "lora": {"rank": 4, "targets": ["q_proj", "v_proj"]},
          "train": {"num_iterations": 10, "lr": 1e-3}}


def make_adapters(seed=0, rank=4, agents=2, layers=2, width=8):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  return Adapters(layers={name: {"a": normal(layers, agents, width, rank),
                                 "b": normal(layers, agents, rank, width)}
                          for name in ("q_proj", "v_proj")}, scale=4.0)


def make_state(seed=0, rank=4, agents=2):
  """What the trainer saves: adapters, critic, an AdamW state with non-zero moments, key data."""
  adapters = make_adapters(seed, rank, agents)
  critic = {"w": jnp.full((8, 1), 0.5 + seed, jnp.bfloat16), "b": jnp.zeros((1,), jnp.float32)}
  optimizer = optax.adamw(1e-2)
  opt_state = optimizer.init(adapters)
  grads = jax.tree.map(lambda x: jnp.sin(x) + seed, adapters)
  _, opt_state = optimizer.update(grads, opt_state, adapters)
  key = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 7))
  return {"adapters": adapters, "critic": critic, "opt": opt_state, "rng": key,
          "step": jnp.asarray(seed, jnp.int32)}


def meta(step, config=CONFIG):
  return {"iteration": step, "policy_version": step, "data_cursor": 3 * step,
          "agent_schedule": [0, 1], "config": config}


@pytest.mark.exactness
def test_round_trip_into_a_fresh_state_is_bit_exact(tmp_path):
  state = make_state(seed=0)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() is None
    assert ckpt.save(3, state, meta(3))
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 3
    restored, saved_meta = ckpt.restore(make_state(seed=1), config=CONFIG)
  chex.assert_trees_all_equal(restored, state)
  chex.assert_trees_all_equal_dtypes(restored, state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  assert isinstance(restored["adapters"], Adapters) and restored["adapters"].scale == 4.0
  assert isinstance(restored["opt"][0], optax.ScaleByAdamState)
  assert saved_meta["data_cursor"] == 9 and saved_meta["agent_schedule"] == [0, 1]
  assert saved_meta["config_fingerprint"] == checkpoint.config_fingerprint(CONFIG)


def test_restore_from_shape_dtype_structs(tmp_path):
  state = make_state(seed=2)
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(0, state, meta(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored, _ = ckpt.restore(abstract, step=0)
  chex.assert_trees_all_equal(restored, state)


def test_retention_intervals_and_no_overwrite(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
    assert [ckpt.save(s, state, meta(s)) for s in (2, 3, 4, 6)] == [True, False, True, True]
    assert ckpt.save(7, state, meta(7), force=True)
    assert not ckpt.save(7, make_state(seed=1), meta(7), force=True)  # never overwritten
    assert ckpt.all_steps() == [6, 7]
    restored, _ = ckpt.restore(state)
  chex.assert_trees_all_equal(restored, state)
  with pytest.raises(FileNotFoundError, match=r"step 2 \(steps present: \[6, 7\]\)"):
    Checkpointer(tmp_path).restore(state, step=2)
  with pytest.raises(FileNotFoundError, match="no checkpoint to restore"):
    Checkpointer(tmp_path / "fresh").restore(state)


def _damage(folder, what):
  """Truncates the files of a saved step: its arrays' chunks ("arrays") or its meta JSON."""
  hits = 0
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      chunk = os.sep + "d" + os.sep in path and os.sep + "state" + os.sep in path
      if (what == "arrays" and chunk) or (what == "meta" and os.sep + "meta" + os.sep in path
                                          and name == "metadata"):
        os.truncate(path, 10)
        hits += 1
  assert hits, f"nothing to damage under {folder}"


@pytest.mark.parametrize("what", ["arrays", "meta"])
def test_a_damaged_checkpoint_is_named_and_nothing_is_lost(tmp_path, what):
  """A finalised step whose files were damaged on disk: one error naming its folder and the
  step to resume from; the folder stays for the user to look at, and the earlier step reads."""
  states = {s: make_state(seed=s) for s in (1, 2)}
  with Checkpointer(tmp_path) as ckpt:
    for s, state in states.items():
      ckpt.save(s, state, meta(s))
  _damage(tmp_path / "checkpoints" / "2", what)
  with Checkpointer(tmp_path) as ckpt:
    with pytest.raises(checkpoint.UnreadableCheckpointError) as error:
      ckpt.restore(make_state(seed=3), config=CONFIG)
    message = str(error.value)
    assert message.startswith(f"{tmp_path}/checkpoints/2: checkpoint of step 2 cannot be read")
    assert "to resume from step 1 (kept: [1])" in message and "tensorstore_spec" not in message
    assert ckpt.all_steps() == [1, 2]  # nothing moved or deleted
    if what == "meta":
      with pytest.raises(checkpoint.UnreadableCheckpointError, match="step 2 cannot be read"):
        ckpt.read_meta(2)
    restored, _ = ckpt.restore(make_state(seed=3), step=1, config=CONFIG)
  chex.assert_trees_all_equal(restored, states[1])


def test_a_damaged_only_checkpoint_says_there_is_no_earlier_one(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(5, make_state(), meta(5))
  _damage(tmp_path / "checkpoints" / "5", "arrays")
  with pytest.raises(checkpoint.UnreadableCheckpointError,
                     match="step 5 cannot be read .*no earlier checkpoint is kept"):
    Checkpointer(tmp_path).restore(make_state())


def test_non_finite_state_is_never_written(tmp_path):
  state = make_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, meta(1))
    layers = dict(state["adapters"].layers)
    layers["v_proj"] = {**layers["v_proj"], "b": layers["v_proj"]["b"].at[1, 0, 2, 3].set(jnp.nan)}
    bad = {**state, "adapters": state["adapters"].replace(layers=layers)}
    with pytest.raises(NonFiniteStateError,
                       match="step 2: the state leaf adapters/layers/v_proj/b holds"):
      ckpt.save(2, bad, meta(2), force=True)
    bf16_inf = {**state, "critic": {**state["critic"], "w": state["critic"]["w"].at[0].set(
        jnp.inf)}}
    with pytest.raises(NonFiniteStateError, match="leaf critic/w holds"):
      ckpt.save(3, bf16_inf, meta(3))
    assert ckpt.all_steps() == [1]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]


@pytest.mark.parametrize("change, key", [({"rank": 8}, "q_proj"), ({"agents": 3}, "q_proj")])
def test_other_structure_is_refused_naming_the_key(tmp_path, change, key):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, make_state(), meta(1))
    with pytest.raises(CheckpointMismatchError,
                       match=rf"{tmp_path}/checkpoints: step 1: leaf '.*{key}.*' is saved as"):
      ckpt.restore(make_state(**change))
    with pytest.raises(CheckpointMismatchError, match="has no leaf 'extra'"):
      ckpt.restore({**make_state(), "extra": jnp.zeros(2)})
    with pytest.raises(CheckpointMismatchError, match="holds leaf 'critic/b'"):
      ckpt.restore({**make_state(), "critic": {"w": make_state()["critic"]["w"]}})


def test_other_config_is_refused_naming_the_keys(tmp_path):
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, make_state(), meta(1))
    changed = {**CONFIG, "lora": {**CONFIG["lora"], "rank": 8},
               "train": {**CONFIG["train"], "num_iterations": 20}}
    with pytest.raises(CheckpointMismatchError,
                       match=r"step 1 was written with a different config \(lora.rank: saved 4, "
                             r"now 8; train.num_iterations: saved 10, now 20\)"):
      ckpt.restore(make_state(), config=changed)
    longer = {**CONFIG, "train": {**CONFIG["train"], "num_iterations": 20}}
    _, saved_meta = ckpt.restore(make_state(), config=longer, may_differ=["train.num_iterations"])
    assert saved_meta["config"] == CONFIG
    as_tuples = {**CONFIG, "lora": {**CONFIG["lora"], "targets": ("q_proj", "v_proj")}}
    ckpt.restore(make_state(), config=as_tuples)  # JSON turns tuples into lists: still equal


def test_the_saved_config_is_compared_as_read_config_reads_it(tmp_path):
  """A field added to the config after a checkpoint was written (absent from the saved config)
  compares equal once `read_config` fills in its default, and is refused by name at any other
  value; without `read_config` the saved dict is compared as it is."""
  fill_defaults = lambda saved: {**saved, "model": {"remat": False, **saved.get("model", {})}}
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, make_state(), meta(1))
    defaults = {**CONFIG, "model": {"remat": False}}
    ckpt.restore(make_state(), config=defaults, read_config=fill_defaults)
    changed = {**CONFIG, "model": {"remat": True}}
    with pytest.raises(CheckpointMismatchError, match=r"model.remat: saved False, now True"):
      ckpt.restore(make_state(), config=changed, read_config=fill_defaults)
    with pytest.raises(CheckpointMismatchError, match=r"model.remat: saved '<missing>'"):
      ckpt.restore(make_state(), config=defaults)


def _step_1_and_step_2_in_flight(tmp_path):
  """(the state saved as step 1, the folder of a step 2 that Orbax has not finished)."""
  state = make_state()
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, meta(1))
  in_flight = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp"
  (in_flight / "state").mkdir(parents=True)
  return state, in_flight


def test_unfinished_step_is_ignored_and_cleaned(tmp_path):
  state, partial = _step_1_and_step_2_in_flight(tmp_path)
  (partial / "state" / "half_written").write_bytes(b"\0" * 100)
  with Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == 1
    restored, _ = ckpt.restore(make_state(seed=1))
    assert ckpt.save(2, state, meta(2))
  assert not partial.exists()
  chex.assert_trees_all_equal(restored, state)


def test_close_waits_for_the_deletion_of_unfinished_steps(tmp_path, monkeypatch):
  """A process that only opens and restores must not exit with the deletion still running."""
  from orbax.checkpoint._src.path import temporary_paths
  cleanup = temporary_paths.cleanup_temporary_paths

  restored_yet = threading.Event()

  async def slow_cleanup(*args, **kwargs):  # a slow file system: the deletion lags the restore
    restored_yet.wait(timeout=60)
    time.sleep(0.5)
    return await cleanup(*args, **kwargs)

  state, in_flight = _step_1_and_step_2_in_flight(tmp_path)
  monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow_cleanup)
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(make_state(seed=1))
    assert in_flight.exists()
    restored_yet.set()
  assert not in_flight.exists()
  chex.assert_trees_all_equal(restored, state)


def test_read_only_leaves_a_live_runs_folder_alone(tmp_path):
  """An evaluator reading a run that is still training must not delete its in-flight save."""
  state, in_flight = _step_1_and_step_2_in_flight(tmp_path)
  with Checkpointer(tmp_path, read_only=True) as ckpt:
    assert ckpt.latest_step() == 1
    restored, _ = ckpt.restore(make_state(seed=1), config=CONFIG)
    with pytest.raises(ValueError, match="read_only"):
      ckpt.save(2, state, meta(2))
    time.sleep(1)  # Orbax's clean-up of unfinished steps (when on) runs in the background
  assert in_flight.exists()
  chex.assert_trees_all_equal(restored, state)


def _run_script(tmp_path, source, *args, **popen_kwargs):
  script = tmp_path / "script.py"
  script.write_text(textwrap.dedent(source))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  return subprocess.Popen([sys.executable, str(script), *map(str, args)], cwd=REPO, env=env,
                          **popen_kwargs)


_KILLED_MID_SAVE = """
import os, sys, time
import numpy as np
from orbax.checkpoint._src.path import atomicity
from marft_jax.train.checkpoint import Checkpointer

workdir, ready = sys.argv[1], sys.argv[2]
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def stalled_finalize(self):  # Step 2's files are written; hang before the rename.
  if self.get_final().name == "2":
    open(ready, "w").close()
    time.sleep(600)
  return await finalize(self)

atomicity.AtomicRenameTemporaryPath.finalize = stalled_finalize
ckpt = Checkpointer(workdir)
ckpt.save(1, {"w": np.full((64, 64), 1.0, np.float32)}, {"iteration": 1})
ckpt.save(2, {"w": np.full((64, 64), 2.0, np.float32)}, {"iteration": 2})
"""


def test_sigkill_during_a_save_leaves_the_previous_step_loadable(tmp_path):
  workdir, ready = tmp_path / "run", tmp_path / "ready"
  child = _run_script(tmp_path, _KILLED_MID_SAVE, workdir, ready)
  try:
    deadline = time.monotonic() + 60
    while not ready.exists():
      assert child.poll() is None, "the child exited before saving step 2"
      assert time.monotonic() < deadline, "the child never reached step 2's rename"
      time.sleep(0.05)
    partial = [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith("2.")]
    assert partial and any(partial[0].rglob("*")), "step 2 should be half-written on disk"
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  with Checkpointer(workdir) as ckpt:
    assert ckpt.all_steps() == [1]
    restored, saved_meta = ckpt.restore({"w": np.zeros((64, 64), np.float32)})
  np.testing.assert_array_equal(restored["w"], np.ones((64, 64), np.float32))
  assert saved_meta == {"iteration": 1}
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1"]


_PREEMPTED_LOOP = """
import sys, time
import numpy as np
from marft_jax.train.checkpoint import Checkpointer, PreemptionFlag

with PreemptionFlag() as preempted, Checkpointer(sys.argv[1], save_interval_steps=1000) as ckpt:
  for step in range(1, 100000):
    state = {"w": np.full(4, step, np.float32)}
    print(f"step {step}", flush=True)
    time.sleep(0.02)
    if preempted.requested:
      ckpt.save(step, state, {"iteration": step}, force=True, wait=True)
      print(f"saved {step}", flush=True)
      break
"""


def test_sigterm_mid_loop_saves_the_last_step_and_exits_0(tmp_path):
  workdir = tmp_path / "run"
  child = _run_script(tmp_path, _PREEMPTED_LOOP, workdir, stdout=subprocess.PIPE, text=True)
  try:
    for line in child.stdout:
      if line.strip() == "step 5":
        child.send_signal(signal.SIGTERM)
        break
    out, _ = child.communicate(timeout=60)
  finally:
    if child.poll() is None:
      child.kill()
  assert child.returncode == 0
  saved = int(out.split("saved ")[1])
  with Checkpointer(workdir) as ckpt:
    assert ckpt.all_steps() == [saved]
    restored, _ = ckpt.restore({"w": np.zeros(4, np.float32)})
  np.testing.assert_array_equal(restored["w"], np.full(4, saved, np.float32))


def test_preemption_flag_sets_and_restores_handlers():
  before = signal.getsignal(signal.SIGTERM)
  with PreemptionFlag() as flag:
    assert not flag.requested
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.requested and flag.signal_received == signal.SIGTERM
  assert signal.getsignal(signal.SIGTERM) is before
  with PreemptionFlag(signals=(signal.SIGINT,)) as flag:
    os.kill(os.getpid(), signal.SIGINT)
    assert flag.requested
    with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C stops a loop that never polls
      os.kill(os.getpid(), signal.SIGINT)


def test_peft_exports_follow_the_retained_checkpoints(tmp_path):
  state, names = make_state(), ["reasoner", "actor"]
  with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, state, meta(step))
      folder = ckpt.export_peft(step, state["adapters"], names, base_model_name_or_path="tiny")
    assert folder == str(tmp_path / "exports" / "step_3")
    assert sorted(os.listdir(tmp_path / "exports")) == ["step_2", "step_3"]
    for name in names:
      assert os.path.isfile(os.path.join(folder, name, WEIGHTS_FILE))
      with open(os.path.join(folder, name, CONFIG_FILE)) as f:
        config = json.load(f)
      assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny"


def test_failed_export_leaves_checkpoint_and_previous_export(tmp_path, monkeypatch):
  state, names = make_state(), ["reasoner", "actor"]
  with Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, state, meta(1))
    ckpt.export_peft(1, state["adapters"], names)
    ckpt.save(2, state, meta(2))

    def fails_half_way(root, adapters, names, base_model_name_or_path=None):
      os.mkdir(os.path.join(root, names[0]))
      raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_peft_adapters", fails_half_way)
    with pytest.raises(OSError, match="disk full"):
      ckpt.export_peft(2, state["adapters"], names)
    assert sorted(os.listdir(tmp_path / "exports")) == ["step_1"]
    restored, _ = ckpt.restore(make_state(seed=1))
  chex.assert_trees_all_equal(restored, state)


def test_async_save_is_on_disk_after_close(tmp_path):
  state = make_state(seed=3)
  with Checkpointer(tmp_path, async_save=True) as ckpt:
    assert ckpt.save(5, state, meta(5))
  with Checkpointer(tmp_path) as ckpt:
    restored, _ = ckpt.restore(make_state())
  chex.assert_trees_all_equal(restored, state)

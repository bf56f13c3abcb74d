"""PEFT saves under failure: a failure at every file operation of a save (k-th call of
`os.replace`, `os.fsync`, `json.dump`, safetensors `save_file`, ...) leaves the previous adapter
loadable bit for bit; a crash at every point leaves each folder old or new, never mixed; bad
indices, names and files are refused by name."""

import collections
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from marft_jax import lora
from tests.lora.conftest import CONFIG, random_adapters

# Two adapter sets that differ in every tensor and in scale: a folder mixing one's weights with
# the other's config would load with the wrong scale. NumPy leaves: slicing them is fast.
OLD = jax.tree.map(np.asarray, random_adapters(3, rank=4, seed=0))
NEW = jax.tree.map(np.asarray, random_adapters(3, rank=4, seed=1).replace(scale=0.5))
NAMES = ["planner", "coder", "critic"]
# The file operations a save makes, as (module, attribute): the ones faults are injected into.
OPS = {"os.mkdir": (os, "mkdir"), "os.replace": (os, "replace"), "os.rename": (os, "rename"),
       "os.fsync": (os, "fsync"), "json.dump": (json, "dump"),
       "save_file": (safetensors.numpy, "save_file"), "shutil.rmtree": (shutil, "rmtree")}


class Faults:
  """Counts the calls of `OPS` during a `with` block; makes call `k` of `op` raise OSError.

  With `crash`, every later call fails too (`rmtree(ignore_errors=True)` silently): nothing
  more reaches the disk, so the block leaves the files as a process killed at that call would.
  """

  def __init__(self, op=None, k=None, crash=False):
    self.op, self.k, self.crash = op, k, crash
    self.counts, self.failed = collections.Counter(), False

  def __enter__(self):
    self._patch = pytest.MonkeyPatch()
    for name, (module, attr) in OPS.items():
      self._patch.setattr(module, attr, self._wrap(name, getattr(module, attr)))
    return self

  def __exit__(self, *exc):
    self._patch.undo()

  def _wrap(self, name, fn):
    def wrapped(*args, **kwargs):
      self.counts[name] += 1
      if (self.failed and self.crash) or (name, self.counts[name]) == (self.op, self.k):
        self.failed = True
        if kwargs.get("ignore_errors"):
          return None
        raise OSError(f"injected failure: {name} call {self.counts[name]}")
      return fn(*args, **kwargs)
    return wrapped


def _state(path, i):
  """"old" or "new" if `path` loads as adapter i of OLD or NEW exactly (tensors and scale)."""
  loaded = lora.load_peft_adapter(path, CONFIG)
  for label, adapters in (("old", OLD), ("new", NEW)):
    same = jax.tree.map(lambda x, y: np.array_equal(x, y[:, i:i + 1]), loaded.layers,
                        adapters.layers)
    if loaded.scale == adapters.scale and all(jax.tree.leaves(same)):
      return label
  raise AssertionError(f"{path} loads as neither the old nor the new adapter {i}")


def _save(root, adapters, num_agents):
  if num_agents == 1:
    lora.save_peft_adapter(root / NAMES[0], adapters, index=0)
  else:
    lora.save_peft_adapters(root, adapters, NAMES[:num_agents])


def _fault_cases(tmp_path, num_agents):
  """(op, k) for every call k of every op that saving NEW over OLD makes."""
  root = tmp_path / "count"
  _save(root, OLD, num_agents)
  with Faults() as faults:
    _save(root, NEW, num_agents)
  assert faults.counts["save_file"] == faults.counts["json.dump"] == num_agents
  assert faults.counts["os.replace"] == 2 * num_agents  # Old aside, new in, per folder.
  assert faults.counts["os.fsync"] == 3 * num_agents + 1  # 2 files + folder each, the parent.
  return [(op, k) for op, n in sorted(faults.counts.items()) for k in range(1, n + 1)]


@pytest.mark.parametrize("num_agents", [1, 3])
def test_failure_at_every_step_keeps_the_previous_adapters(tmp_path, num_agents):
  for op, k in _fault_cases(tmp_path, num_agents):
    root = tmp_path / f"{op}-{k}"
    _save(root, OLD, num_agents)
    # The contract: a save that raises leaves every folder old; one that returns, all new. (A
    # few faults are harmless: `makedirs` of an existing root, deleting the replaced folder.)
    with Faults(op, k) as faults:
      try:
        _save(root, NEW, num_agents)
        expected = "new"
      except OSError as e:
        assert "injected" in str(e), (op, k, e)
        expected = "old"
    assert faults.failed, (op, k)
    states = [_state(root / name, i) for i, name in enumerate(NAMES[:num_agents])]
    assert states == [expected] * num_agents, (op, k)
    _save(root, NEW, num_agents)  # A later save succeeds and leaves no temp folder.
    assert sorted(os.listdir(root)) == sorted(NAMES[:num_agents]), (op, k)
    assert [_state(root / name, i) for i, name in enumerate(NAMES[:num_agents])] == (
        ["new"] * num_agents), (op, k)


@pytest.mark.parametrize("num_agents", [1, 3])
def test_crash_at_every_step_leaves_each_folder_old_or_new(tmp_path, num_agents):
  for op, k in _fault_cases(tmp_path, num_agents):
    root = tmp_path / f"{op}-{k}"
    _save(root, OLD, num_agents)
    with Faults(op, k, crash=True):
      try:
        _save(root, NEW, num_agents)
      except OSError as e:
        assert "injected" in str(e), (op, k, e)
    # A crash between a swap's two renames leaves one folder absent, its old contents aside;
    # even a save that then fails while writing puts them back first.
    with Faults("json.dump", 1), pytest.raises(OSError, match="injected"):
      _save(root, OLD, num_agents)
    states = [_state(root / name, i) for i, name in enumerate(NAMES[:num_agents])]
    # Folders are swapped in order: the first ones new, the rest old ("new" < "old").
    assert states == sorted(states), (op, k, states)
    _save(root, NEW, num_agents)
    assert sorted(os.listdir(root)) == sorted(NAMES[:num_agents]), (op, k)


def test_failure_to_delete_the_replaced_folder_is_cleaned_up_later(tmp_path):
  lora.save_peft_adapter(tmp_path / "a", OLD)
  with Faults("shutil.rmtree", 1):
    lora.save_peft_adapter(tmp_path / "a", NEW)
  assert _state(tmp_path / "a", 0) == "new"
  assert [name[:7] for name in sorted(os.listdir(tmp_path))] == [".a.old-", "a"]
  lora.save_peft_adapter(tmp_path / "a", OLD)
  assert os.listdir(tmp_path) == ["a"]


def test_failure_while_writing_agent_2_of_3_keeps_all_three(tmp_path):
  lora.save_peft_adapters(tmp_path, OLD, NAMES)
  with Faults("json.dump", 2), pytest.raises(OSError, match="json.dump call 2"):
    lora.save_peft_adapters(tmp_path, NEW, NAMES)
  assert [_state(tmp_path / name, i) for i, name in enumerate(NAMES)] == ["old"] * 3
  assert sorted(os.listdir(tmp_path)) == sorted(NAMES)


def test_unserialisable_config_keeps_the_old_weights_and_scale(tmp_path):
  lora.save_peft_adapter(str(tmp_path / "a"), OLD, index=1)
  with pytest.raises(TypeError, match="not JSON serializable"):
    lora.save_peft_adapter(str(tmp_path / "a"), NEW, index=1, base_model_name_or_path=object())
  assert _state(tmp_path / "a", 1) == "old"
  assert os.listdir(tmp_path) == ["a"]


def test_leftovers_of_a_crash_are_cleaned_and_a_moved_adapter_is_named(tmp_path):
  lora.save_peft_adapter(tmp_path / "a", OLD)
  # What a crash between a swap's two renames leaves: no `a`, the old folder aside.
  os.rename(tmp_path / "a", tmp_path / ".a.old-dead0000")
  (tmp_path / ".a.tmp-dead0001").mkdir()
  (tmp_path / ".a.tmp-dead0001" / "adapter_model.safetensors").write_bytes(b"partial")
  with pytest.raises(FileNotFoundError, match=r"\.a\.old-dead0000 \(the next save"):
    lora.load_peft_adapter(tmp_path / "a", CONFIG)
  lora.save_peft_adapter(pathlib.Path(tmp_path / "a"), NEW)
  assert os.listdir(tmp_path) == ["a"]
  assert _state(tmp_path / "a", 0) == "new"


def test_a_folder_that_is_not_an_adapter_is_not_replaced(tmp_path):
  (tmp_path / "workdir").mkdir()
  (tmp_path / "workdir" / "checkpoint").write_text("keep me")
  (tmp_path / "file").write_text("keep me")
  for target in ("workdir", "file"):
    with pytest.raises(ValueError, match=f"{target}: exists and is not a PEFT adapter folder"):
      lora.save_peft_adapter(tmp_path / target, OLD)
  assert (tmp_path / "workdir" / "checkpoint").read_text() == "keep me"
  assert sorted(os.listdir(tmp_path)) == ["file", "workdir"]


@pytest.mark.parametrize("index", [3, 5, -1, 1.0, True, "0"])
def test_index_out_of_range_or_not_an_int_is_refused(tmp_path, index):
  with pytest.raises(ValueError, match=rf"index={index!r}: use an int in \[0, 3\)"):
    lora.save_peft_adapter(tmp_path / "a", OLD, index=index)
  with pytest.raises(ValueError, match="index="):
    lora.peft_tensors(OLD, index)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("names, message", [
    (["a", "b"], "one name per adapter"), ("abc", "one name per adapter"),
    (["a", "b", "a"], r"\['a'\] appear more than once"), (["a", "b/c", "d"], "'b/c' is not"),
    (["a", "..", "d"], "'..' is not"), (["a", ".b", "d"], "'.b' is not"),
    (["a", "", "d"], "'' is not"), (["a", 2, "d"], "2 is not")])
def test_bad_names_are_refused(tmp_path, names, message):
  with pytest.raises(ValueError, match=message):
    lora.save_peft_adapters(tmp_path, OLD, names)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text, message", [
    ('{"r": 4,\n "lora_alpha": 8,,}', r"invalid JSON at line 2, column 18"),
    ("[4, 8]", "holds a JSON list, not an object"),
    ('{"lora_alpha": 8}', "missing key 'r'"),
    ('{"r": 4}', "missing key 'lora_alpha'"),
    ('{"r": "eight", "lora_alpha": 8}', "r='eight', expected a positive integer"),
    ('{"r": 0, "lora_alpha": 8}', "r=0, expected a positive integer"),
    ('{"r": true, "lora_alpha": 8}', "r=True, expected a positive integer"),
    ('{"r": 4, "lora_alpha": "8"}', "lora_alpha='8', expected a positive number"),
    ('{"r": 4, "lora_alpha": NaN}', "lora_alpha=nan, expected a positive number"),
    ('{"r": 4, "lora_alpha": 8, "lora_dropout": "0.1"}', "lora_dropout='0.1'"),
    ('{"r": 4, "lora_alpha": 8, "layers_to_transform": ["0"]}', "layers_to_transform=")])
def test_broken_config_names_the_file_and_key(tmp_path, text, message):
  lora.save_peft_adapter(tmp_path, OLD)
  (tmp_path / "adapter_config.json").write_text(text)
  with pytest.raises(ValueError, match=r"adapter_config\.json: " + message):
    lora.load_peft_adapter(tmp_path, CONFIG)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_broken_weights_file_is_named(tmp_path, damage):
  lora.save_peft_adapter(tmp_path, OLD)
  weights = tmp_path / "adapter_model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"not a tensor file" * 4,
                       "empty": b""}[damage])
  with pytest.raises(ValueError, match=r"adapter_model\.safetensors: not a valid safetensors"):
    lora.load_peft_adapter(tmp_path, CONFIG)


def test_check_peft_folder_finds_what_the_load_would_without_reading_tensors(tmp_path):
  """A launch checks its adapter folders before the model loads (`check_peft_folder`): the
  same errors as `load_peft_adapter` for a missing folder, config or weights file, and for a
  broken config; the tensors themselves are the load's to read."""
  lora.save_peft_adapter(tmp_path / "good", OLD)
  config, weights = lora.check_peft_folder(tmp_path / "good")
  assert (config["r"], weights) == (4, str(tmp_path / "good" / "adapter_model.safetensors"))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ValueError, match=r"a_file: a file, not a PEFT adapter folder"):
    lora.check_peft_folder(tmp_path / "a_file")
  for check in (lora.check_peft_folder, lambda p: lora.load_peft_adapter(p, CONFIG)):
    with pytest.raises(FileNotFoundError, match=r"nowhere/adapter_config\.json: not found"):
      check(tmp_path / "nowhere")
  lora.save_peft_adapter(tmp_path / "no_weights", OLD)
  (tmp_path / "no_weights" / "adapter_model.safetensors").unlink()
  for check in (lora.check_peft_folder, lambda p: lora.load_peft_adapter(p, CONFIG)):
    with pytest.raises(FileNotFoundError, match=r"no_weights/adapter_model\.safetensors: not "):
      check(tmp_path / "no_weights")
  (tmp_path / "good" / "adapter_config.json").write_text('{"r": 0, "lora_alpha": 8}')
  with pytest.raises(ValueError, match=r"adapter_config\.json: r=0, expected a positive"):
    lora.check_peft_folder(tmp_path / "good")


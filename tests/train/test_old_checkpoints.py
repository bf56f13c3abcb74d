"""Checkpoints written by earlier commits resume as they were trained.

References: tests/fixtures/old_checkpoints (make.py there says how they were made). Each
fixture is a one-iteration checkpoint written by an earlier commit's own trainer, with what
that same code trained next (its step-2 state, as digests and as arrays, its iteration-1
metrics, and the codegen it ran under). Bit for bit holds on one codegen only (the same CPU,
instruction set, jaxlib, XLA flags and device count: tests/exactness.py): a fixture written
under this process's is compared digest by digest, one written elsewhere within the spread
that spread.py measured across instruction sets. The
history of the config's keys (which commit added which, and what the code did before) is
`tests/fixtures/old_checkpoints/keys.json`, each commit's `TrainConfig()` read by that
commit's code, and the history of the shipped teams `teams.json` (a digest of each task's
team, per commit that changed one), both independent of `config_history`.
"""

import dataclasses
import itertools
import json
import os
import shutil

import jax
import numpy as np
import pytest

from marft_jax.configs import to_config_dict
from marft_jax.models import loading
from marft_jax.train import algorithms
from marft_jax.train.build import model as model_lib
from marft_jax.train.config import saved as saved_config
from marft_jax.train import config_history
from marft_jax.train import loop
from marft_jax.train import update as update_lib
from marft_jax.train.checkpoint import Checkpointer, CheckpointMismatchError
from marft_jax.train.config import RoleSection, TrainConfig
from tests import exactness
from tests.fixtures.old_checkpoints import make
from tests.fixtures.old_checkpoints import spread
from tests.train.echo_config import resolved

pytestmark = pytest.mark.exactness  # tests/exactness.py: CI runs these under two ISAs

FIXTURES = make.HERE
# Hand-written from the history: what today's defaults for the keys each fixture's commit
# lacked would change. An f32 run before model.matmul_precision ran at the platform default
# ("auto" is exact f32); a bf16 run before loss.behaviour_correction trained without it
# ("auto" turns it on for bf16; its precision "auto" is the platform default, as it was).
# Every f32 fixture predates loss.old_logp, whose "auto" reads π_old from the rollout in f32.
# Every fixture predates optimizer.row_length_step (rows padded to 64 tokens, not 32: the
# padding changes the f32 rounding), and model.lora_update_f32, which changes the bf16 ones'
# sampling (their LoRA update was rounded to bf16; f32 is the same either way).
_ROWS = "optimizer.row_length_step"
_BF16_LORA = "model.lora_update_f32"
REFUSED = {"before_correction_f32": {"model.matmul_precision", "loss.old_logp",
                                     "advantage.jit_whitening", _ROWS},
           "before_correction_bf16": {"loss.behaviour_correction", "advantage.jit_whitening",
                                      _ROWS, _BF16_LORA},
           "roles_before_precision_f32": {"model.matmul_precision", "loss.old_logp",
                                          "advantage.jit_whitening", _ROWS},
           "roles_before_precision_bf16": {"advantage.jit_whitening", _ROWS, _BF16_LORA},
           "every_key_f32": {"loss.old_logp", _ROWS},
           # main just before rollout.max_staleness (resumed at its 0): only the rows
           "before_async_f32": {_ROWS},
           # the keys of a run written after df0626f, its write time before it (op by op)
           "window_f32": {"loss.old_logp", "advantage.jit_whitening", _ROWS}}
# Every fixture but every_key_f32 predates df0626f (2026-11-26 22:35), which jitted the
# advantage whitening (its fused reductions round f32 advantages about 1e-7 apart): read as
# advantage.jit_whitening=False, refused under today's True, bit for bit once set.
# Diagnostics computed another way since (not trained on): the largest sampler/learner gap is
# the update's `behaviour/logp_gap_max` today, measured against the learner's pass of the
# update rather than the one before it; in f32 both are ~1e-6, in bf16 they differ.
REDEFINED = ("logp/sampler_learner_max_gap",)


def _saved_config(workdir):
  with Checkpointer(workdir, read_only=True) as checkpointer:
    return checkpointer.read_meta(1)["config"], checkpointer.written_at(1)


def _todays_command(saved: dict, iterations: int) -> TrainConfig:
  """The same run launched with today's code: the keys the old config had, with its values;
  the keys added since at today's defaults."""
  return resolved(to_config_dict(TrainConfig()).to_dict(),
                  {**config_history.flatten(saved), "iterations": iterations})


@pytest.fixture(scope="module")
def models():
  return {dtype: model_lib.Model(*loading.load_model(make.MODEL, param_dtype=dtype,
                                                    compute_dtype=dtype))
          for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("name", sorted(make.FIXTURES))
def test_an_old_checkpoint_resumes_as_its_own_code_trained_or_is_refused_by_key(
    name, models, tmp_path):
  with open(os.path.join(FIXTURES, name, "next.json")) as f:
    expected = json.load(f)
  workdir = str(tmp_path / "run")
  shutil.copytree(os.path.join(FIXTURES, name, "workdir"), workdir)
  saved, written_at = _saved_config(workdir)
  config = _todays_command(saved, iterations=expected["step"])
  model = models[config.model.param_dtype]

  # Today's defaults for the keys added since: refused, naming each key that changes behaviour.
  if REFUSED[name]:
    with pytest.raises(CheckpointMismatchError) as refusal:
      loop.train(config, workdir, model=model, progress=False)
    named = {key for key in config_history.flatten(to_config_dict(config).to_dict())
             if f"{key}: saved" in str(refusal.value)}
    assert named == REFUSED[name], str(refusal.value)
    # The user sets the saved values the refusal names.
    changes = {key: config_history.flatten(
        to_config_dict(saved_config.read_saved_config(saved, "", written_at)).to_dict())[key]
        for key in REFUSED[name]}
    config = _with(config, changes)
  loop.train(config, workdir, model=model, progress=False)

  with Checkpointer(workdir, read_only=True) as checkpointer:  # what today's records
    assert checkpointer.read_meta(expected["step"])["changes_known"] == \
        config_history.CHANGES_KNOWN
  _assert_trains_as_recorded(workdir, expected, name)


def _assert_trains_as_recorded(workdir: str, expected: dict, name: str) -> None:
  """Bit for bit where the fixture was written under this process's codegen (CPU, instruction
  set, jaxlib, XLA flags, device count: tests/exactness.py). Elsewhere on XLA:CPU, an f32
  run within the spread measured across CPUs and instruction sets. A bf16 run elsewhere, and
  any run on another backend, is checked for its leaves only: bf16's rounding differs from
  one CPU to another by enough to flip sampled tokens, and then the run's trajectory (the
  same old code on two CPUs: 0.18 and 0.42 of a policy leaf's norm apart after one update),
  so no tolerance tells its rounding from a change."""
  step = expected["step"]
  metrics = make.metrics_row(workdir, step - 1)
  kept = [k for k in expected["metrics"] if k not in REDEFINED]
  actual_metrics = {k: metrics.get(k) for k in kept}
  expected_metrics = {k: expected["metrics"][k] for k in kept}
  bf16 = expected["changes"].get("model.param_dtype") == "bfloat16"
  if exactness.same_codegen(expected.get("codegen")):
    assert make.state_digests(workdir, step) == expected["state"]
    assert actual_metrics == expected_metrics
  elif jax.default_backend() == "cpu" and not bf16:
    exactness.assert_states_close(make.state_arrays(workdir, step), _recorded_state(name))
    exactness.assert_metrics_close(actual_metrics, expected_metrics)
  else:
    state = make.state_arrays(workdir, step)
    assert state.keys() == expected["state"].keys()
    assert all(np.isfinite(v).all() for v in state.values() if v.dtype.kind == "f")


def _recorded_state(name: str) -> dict:
  with np.load(os.path.join(FIXTURES, name, "next_state.npz")) as recorded:
    return dict(recorded)


def _swapping_first_rows(real):
  """`update.minibatch_slots` whose epoch 0's first two minibatches trade their first rows."""
  def swapped(*args, **kwargs):
    indices, trained = real(*args, **kwargs)
    return indices.at[0, 0].set(indices[1, 0]).at[1, 0].set(indices[0, 0]), trained
  return swapped


@pytest.mark.parametrize("change", ["advantage.normalize", "minibatch_swap"])
def test_the_cross_host_tolerance_is_far_below_a_semantic_change(change, models, tmp_path,
                                                                 monkeypatch):
  """every_key_f32 resumed with one semantic change, a key flipped or two rows traded between
  the first two minibatches, moves some trained leaf by at least 100 times the tolerance
  that rounding on another instruction set is allowed (and so fails its comparison)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(os.path.join(FIXTURES, "every_key_f32", "workdir"), workdir)
  saved, written_at = _saved_config(workdir)
  config = _todays_command(saved, iterations=2)
  read = config_history.flatten(to_config_dict(
      saved_config.read_saved_config(saved, "", written_at)).to_dict())
  config = _with(config, {key: read[key] for key in REFUSED["every_key_f32"]})
  if change == "minibatch_swap":
    monkeypatch.setattr(update_lib, "minibatch_slots",
                        _swapping_first_rows(update_lib.minibatch_slots))
    jax.clear_caches()  # traced anew, not an earlier test's program reused
  else:
    flipped = not config.advantage.normalize
    config = _with(config, {change: flipped})
    spread.set_saved_key(workdir, change, flipped)  # as if launched so (not refused)
  try:
    loop.train(config, workdir, model=models["float32"], progress=False)
  finally:
    jax.clear_caches()
  errors = exactness.leaf_errors(make.state_arrays(workdir, 2), _recorded_state("every_key_f32"))
  trained = max(v for k, v in errors.items() if k.startswith(("policy/", "critic/")))
  assert trained >= 100 * exactness.STATE_RTOL, (change, trained)
  with pytest.raises(AssertionError, match="leaves beyond"):
    exactness.assert_states_close(make.state_arrays(workdir, 2),
                                  _recorded_state("every_key_f32"))


# --- the history of the keys (keys.json: each commit's own TrainConfig) -------------------------


def _keys_history():
  """{commit: {"date", "keys"}}, oldest first (the file's order is not relied on)."""
  with open(os.path.join(FIXTURES, "keys.json")) as f:
    return dict(sorted(json.load(f).items(), key=lambda item: item[1]["date"]))


def _today_keys():
  return set(config_history.flatten(to_config_dict(TrainConfig()).to_dict()))


def test_every_key_added_since_the_first_format_says_what_it_meant_before():
  """Generated from TrainConfig's leaves: a key today that the first checkpoint format lacked
  has an `ADDED` entry naming the commit that added it (a key added later without one fails
  here)."""
  history = _keys_history()
  first = set(history[make.FIRST_FORMAT]["keys"])
  added_by = {}
  for commit, era in history.items():
    for key in era["keys"]:
      added_by.setdefault(key, commit)
  entries = {entry.key: entry for entry in config_history.ADDED}
  for key in sorted(_today_keys() - first):
    assert key in entries, f"{key}: added since the first checkpoint format, not in ADDED"
    assert entries[key].commit == added_by.get(key, "after the scan"), key
    assert history[entries[key].commit]["date"] == entries[key].date, key
  assert set(entries) <= _today_keys()


def _era_config(era: set, config: TrainConfig) -> dict:
  """`config` as recorded today, with only the keys of `era` (a saved config of that era)."""
  today = to_config_dict(saved_config.as_recorded(algorithms.resolve(config))).to_dict()
  saved = {}
  for key, value in config_history.flatten(today).items():
    if key in era:
      *sections, field = key.split(".")
      node = saved
      for section in sections:
        node = node.setdefault(section, {})
      node[field] = value
  return saved


@pytest.mark.parametrize("commit", sorted(_keys_history()))
def test_a_config_of_every_earlier_format_reads_with_every_key_decided(commit):
  """A saved config holding exactly one era's keys (today's values for them) reads with each
  key it lacks set by `ADDED`, never left to today's default, and loads."""
  era = set(_keys_history()[commit]["keys"])
  saved = _era_config(era, TrainConfig())
  filled = config_history.flatten(config_history.fill_missing(saved))
  assert set(filled) == _today_keys()
  entries = {entry.key: entry for entry in config_history.ADDED}
  for key in _today_keys() - era:
    before = entries[key].before
    assert filled[key] == (before(config_history.flatten(saved), None) if callable(before) else
                           before), key
  assert_loads = saved_config.read_saved_config(saved, "era " + commit)
  assert assert_loads.model.matmul_precision == ("default" if "model.matmul_precision" not in era
                                                 else "auto")


def _with(config: TrainConfig, changes: dict) -> TrainConfig:
  return resolved(to_config_dict(config).to_dict(), changes)


def test_an_old_config_whose_team_or_data_changed_since_is_refused_naming_the_key():
  """Generated from the history: for every era of the config's keys before the team was
  written out (3821d0b) and every shipped team (task, roles), a config that lets the task's
  shipped team play is refused naming team.roles exactly when a shipped team of that era
  (teams.json, as each commit's code built it) is not today's; a file task before
  task.test_path (3ba9c2c) trained on every problem, and is refused naming it."""
  keys, teams = _keys_history(), json.loads(open(os.path.join(FIXTURES, "teams.json")).read())
  eras = sorted(keys.items(), key=lambda item: item[1]["date"])
  changes = sorted(teams.items(), key=lambda item: item[1]["date"])
  today = changes[-1][1]["teams"]
  checked = 0
  for (commit, era), after in zip(eras, [e[1]["date"] for e in eras[1:]] + ["9999"]):
    if "lora.dropout_rate" in era["keys"]:
      continue  # the team is written out: compared key by key
    start = max(i for i, (_, c) in enumerate(changes) if c["date"] <= era["date"])
    in_era = [c["teams"] for _, c in changes[start:] if c["date"] < after]
    for team in today:
      task, roles = team.split("/")
      config = TrainConfig(task=dataclasses.replace(TrainConfig().task, name=task),
                           team=dataclasses.replace(TrainConfig().team, num_roles=int(roles)))
      saved = _era_config(set(era["keys"]), config)
      if "team" in saved and "roles" in saved["team"]:
        saved["team"].update(roles={}, order="")  # as recorded before 3821d0b
      expected = set()
      if any(t[team] != today[team] for t in in_era):
        expected.add("team.roles")
      if task in ("math_jsonl", "code") and "task.test_path" not in era["keys"]:
        expected.add("task.test_path")
      refused = {key for key, _ in config_history.unreproducible(saved)}
      assert refused == expected, (commit, team)
      if expected:
        with pytest.raises(CheckpointMismatchError, match=sorted(expected)[0].replace(".", r"\.")):
          saved_config.read_for_resume(saved, f"era {commit}")
      checked += 1
  assert checked > 100


def _dags(max_roles: int):
  """Every DAG on roles r0..r{n-1} (n <= max_roles) whose edges go forward in that order,
  with at least one edge."""
  for n in range(2, max_roles + 1):
    roles = [f"r{i}" for i in range(n)]
    pairs = list(itertools.combinations(roles, 2))
    for chosen in itertools.product((False, True), repeat=len(pairs)):
      edges = [p for p, on in zip(pairs, chosen) if on]
      if edges:
        yield roles, edges


def test_a_dag_checkpoint_from_before_dag_credit_is_refused_where_its_successors_moved():
  """Generated over every DAG of 2-4 roles: the successors `config_history` says each turn
  had before and has since `dag_credit` equal ppo.turn_successors over the layers' relation
  (ppo.layer_sees: the old rule) and over the graph's (envs.agent_sees); a checkpoint that
  does not record the change is refused naming team.edges exactly where they differ, and one
  that records it never."""
  from marft_jax import envs, ppo
  from marft_jax.envs.profiles import AgentProfile
  moved = 0
  for roles, edges in _dags(4):
    graph = envs.AgentGraph(tuple(roles), tuple(edges))
    layers = graph.layers()
    turns = [r for layer in layers for r in layer]
    n = len(turns)
    step, valid = np.zeros(n, np.int32), np.ones(n, bool)
    layer_k = np.asarray([i for i, layer in enumerate(layers) for _ in layer], np.int32)
    team = [AgentProfile(role=r, system_prompt="", description="") for r in turns]
    sees = np.asarray(envs.agent_sees(graph, team))
    old = np.asarray(ppo.turn_successors(step, ppo.layer_sees(step, layer_k, valid), valid))
    new = np.asarray(ppo.turn_successors(step, sees, valid))
    assert config_history.layer_successors(roles, edges) == old.tolist(), edges
    assert config_history.reach_successors(roles, edges) == new.tolist(), edges
    config = _team_config(roles, ["own"] * len(roles), graph="dag",
                          edges=",".join(f"{a}>{b}" for a, b in edges))
    refused = config_history.changed_since(None, config)
    assert [key for key, _ in refused] == (["team.edges"] if (old != new).any() else [])
    assert config_history.changed_since(config_history.CHANGES_KNOWN, config) == []
    moved += bool((old != new).any())
  assert moved > 10
  assert config_history.changed_since(None, _team_config(["a", "b"], ["own", "own"])) == []


def _team_config(roles, adapters, **team):
  """A TrainConfig whose team declares `roles` (the last graded) with `adapters`."""
  declared = tuple(RoleSection(r, graded=r == roles[-1], adapter=a)
                   for r, a in zip(roles, adapters))
  return TrainConfig(task=dataclasses.replace(TrainConfig().task, name="echo"),
                     team=dataclasses.replace(TrainConfig().team, roles=declared,
                                              order=",".join(roles), **team))


@pytest.mark.parametrize("data,fsdp", [(1, 1), (2, 1), (1, 2), (-1, 1), (3, 2)])
def test_a_checkpoint_trained_on_several_batch_shards_before_mesh_minibatches_is_refused(
    data, fsdp):
  """Before mesh_minibatches a mesh of several batch shards drew its minibatches over the
  rows it padded (and several processes over their blocks): a checkpoint without the record
  whose mesh had more than one shard (-1: every device) is refused naming mesh.data."""
  config = dataclasses.replace(_team_config(["a", "b"], ["own", "own"]),
                               mesh=dataclasses.replace(TrainConfig().mesh, data=data,
                                                        fsdp=fsdp))
  refused = [key for key, _ in config_history.changed_since(None, config)]
  assert refused == ([] if data * fsdp == 1 else ["mesh.data"])
  assert config_history.changed_since(config_history.CHANGES_KNOWN, config) == []


@pytest.mark.parametrize("interval", [0, 2])
@pytest.mark.parametrize("shared_adapter", [False, True])
def test_a_checkpoint_from_before_untrained_roles_is_refused_where_a_role_trained_nothing(
    interval, shared_adapter):
  """Generated over the adapters three roles can have: a checkpoint without the record of
  untrained_roles (25d1793) is refused naming team.roles exactly where some turn trains
  nothing (a 'base' role; the agent-by-agent schedule over more than one adapter), counted
  here from the roles, never with team.shared_adapter (every role on adapter 0)."""
  for adapters in itertools.product(("own", "shared", "base"), repeat=3):
    if all(a == "base" for a in adapters):
      continue  # refused by the config: nothing would train
    if adapters.count("shared") == 1 and not shared_adapter:
      continue  # refused by the config: a role shares with no one
    config = dataclasses.replace(
        _team_config(["a", "b", "c"], adapters, shared_adapter=shared_adapter),
        optimizer=dataclasses.replace(TrainConfig().optimizer,
                                      agent_iteration_interval=interval))
    trained = adapters.count("own") + ("shared" in adapters)
    expected = not shared_adapter and ("base" in adapters or (interval > 0 and trained > 1))
    refused = [key for key, _ in config_history.changed_since(None, config)]
    assert refused == (["team.roles"] if expected else []), adapters
    assert config_history.changed_since(config_history.CHANGES_KNOWN, config) == []


@pytest.mark.parametrize("recorded", [False, True])
def test_the_resume_reads_the_checkpoints_record_of_changes(models, tmp_path, recorded):
  """The every_key_f32 checkpoint's config made a 3-role DAG whose turns moved with
  dag_credit (reasoner>verifier: the actor, no longer hopping to the verifier, ends the step):
  without a record of the change the resume is refused naming team.edges; with it, the
  config passes and the state (2 adapters, not 3) is what differs."""
  workdir = str(tmp_path / "run")
  shutil.copytree(os.path.join(FIXTURES, "every_key_f32", "workdir"), workdir)
  path = os.path.join(workdir, "checkpoints", "1", "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  team = meta["config"]["team"]
  team["roles"]["verifier"] = dict(team["roles"]["actor"], graded=False)
  team.update(order="reasoner,actor,verifier", graph="dag", edges="reasoner>verifier", num_roles=3)
  meta.pop("changes_known", None)
  if recorded:
    meta["changes_known"] = config_history.CHANGES_KNOWN
  meta.pop("config_fingerprint")
  with open(path, "w") as f:
    json.dump(meta, f)
  config = dataclasses.replace(saved_config.read_saved_config(meta["config"], ""), iterations=2)
  with pytest.raises(CheckpointMismatchError) as refused:
    loop.train(config, workdir, model=models["float32"], progress=False)
  assert ("team.edges: DAG credit" in str(refused.value)) != recorded, str(refused.value)
  assert ("another number of agents" in str(refused.value)) == recorded, str(refused.value)


@pytest.mark.parametrize("when,jitted", [("2026-11-26 16:50", False), ("2026-11-26 22:35", False),
                                         ("2026-11-26 22:36", True), ("2026-11-27 09:00", True),
                                         (None, True)])
def test_a_checkpoint_of_the_jit_whitening_keys_era_is_dated_by_its_write_time(
    tmp_path, when, jitted):
  """window_f32's keys are those of every config written between 3821d0b (2026-11-26 16:45)
  and 8880145 (2026-11-28 08:07); df0626f (22:35:40) jitted the whitening in between. Its
  write time as Orbax recorded it decides (no record: read as jitted, as before)."""
  workdir = str(tmp_path / "run")
  shutil.copytree(os.path.join(FIXTURES, "window_f32", "workdir"), workdir)
  if when is None:
    path = os.path.join(workdir, "checkpoints", "1", "_CHECKPOINT_METADATA")
    with open(path) as f:
      record = json.load(f)
    del record["init_timestamp_nsecs"], record["commit_timestamp_nsecs"]
    with open(path, "w") as f:
      json.dump(record, f)
  else:
    make.set_written_at(workdir, 1, when)
  saved, written_at = _saved_config(workdir)
  assert (written_at is None) == (when is None)
  if when is not None:
    assert written_at.strftime("%Y-%m-%d %H:%M") == when
  assert saved_config.read_saved_config(saved, "", written_at).advantage.jit_whitening == jitted
  # A config of the era before (no lora.dropout_rate) is op by op at any time.
  before = {**saved, "lora": {k: v for k, v in saved["lora"].items() if k != "dropout_rate"}}
  assert not saved_config.read_saved_config(before, "", written_at).advantage.jit_whitening


@pytest.mark.parametrize("commit", sorted(_keys_history()))
def test_an_orchestrator_below_top_p_1_from_before_19d683f_is_refused(commit):
  """Until 19d683f (2026-11-24 15:28) the orchestrator sampled at top_p=1 (and 64 tokens)
  whatever team.top_p: an orchestrated config of an earlier era with top_p below 1 is
  refused naming team.top_p; one at top_p=1 reads with 64 routing tokens."""
  era = _keys_history()[commit]
  base = TrainConfig(task=dataclasses.replace(TrainConfig().task, name="code"),
                     team=dataclasses.replace(TrainConfig().team, graph="orchestrator",
                                              num_roles=2))
  for top_p, early in ((0.9, era["date"] < "2026-11-24 15:28"), (1.0, False)):
    saved = _era_config(set(era["keys"]) | {"task.test_path"}, base)
    saved["team"]["top_p"] = top_p  # (today's resolve refuses top_p < 1 without correction)
    refused = {key for key, _ in config_history.unreproducible(saved)} - {"team.roles"}
    assert refused == ({"team.top_p"} if early else set()), (commit, top_p)
  if "team.orchestrator_max_new_tokens" not in era["keys"]:
    read = saved_config.read_saved_config(saved, "")
    assert read.team.orchestrator_max_new_tokens == 64

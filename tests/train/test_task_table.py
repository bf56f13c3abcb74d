"""The task table (train/tasks.py): every shipped task an entry that builds its environments,
and a task of your own, `task.name="package.module:factory"`, resolved and checked at the edge:
an unknown module, a missing attribute, a factory that raises or returns no `Environment` is
one line naming task.name and the module, before the model loads."""

import dataclasses
import os
import subprocess
import sys

import pytest

from marft_jax import envs
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.train import algorithms, loop, tasks, trained_problems
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import preflight
from marft_jax.train.build import team as team_lib
from marft_jax.train import config as config_lib
from examples import parity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLES = (config_lib.RoleSection("thinker"), config_lib.RoleSection("answerer", graded=True))
SEEN = []


def recording(task, split, seed):  # a factory that records what it receives
  SEEN.append((dict(task.options), split, seed))
  return parity.make_env(task, split, seed)


def raising(task, split, seed):
  raise RuntimeError("no data\nhere")


def returns_text(task, split, seed):
  return "an environment"


NOT_CALLABLE = 3


def own(name, **task):
  return config_lib.TrainConfig(task=config_lib.TaskSection(name=name, **task),
                                team=config_lib.TeamSection(roles=ROLES,
                                                            order="thinker,answerer"))


def test_every_shipped_task_is_an_entry_declaring_what_it_needs():
  assert config_lib.TASKS == tasks.NAMES and config_lib.SANDBOX_TASKS == ("code", "humaneval")
  for entry in tasks.SHIPPED:
    assert entry.record in tasks.RECORDS and entry.heldout in tasks.HELDOUT, entry.name
    assert (entry.record == "stream") == (entry.stream is not None), entry.name
    assert tasks.lookup(entry.name) is entry
  by = {t.name: t for t in tasks.SHIPPED}
  assert [n for n, t in by.items() if t.problem_file] == ["math_jsonl", "code", "humaneval"]
  assert [n for n, t in by.items() if not t.trains] == ["humaneval"]
  assert by["arithmetic"].reads == ("level", "horizon") and by["echo"].reads == ("echo_high",)


@pytest.mark.parametrize("name", ["echo", "arithmetic", "math_jsonl", "split_facts"])
def test_shipped_entries_build_the_environments_of_their_task(name):
  config = algorithms.resolve(config_lib.TrainConfig(task=config_lib.TaskSection(name=name)))
  team, _ = team_lib.build_team(config)
  batch = envs_build.build_envs(config, team, seed=0, split="test", num_envs=2, group_size=1)
  try:
    assert isinstance(batch.envs[0], envs.Environment)
    assert isinstance(batch.reset(0)[1], envs.Observation)
  finally:
    batch.close()


def test_a_factory_receives_the_task_section_and_its_options():
  SEEN.clear()
  config = algorithms.resolve(own(f"{__name__}:recording", options={"high": 7, "x": [1, 2]}))
  tree = to_config_dict(config)
  tree.task.options.high = 9  # as --config.task.options.high=9
  config = from_config_dict(config_lib.TrainConfig, tree)
  assert config.task.options == {"high": 9, "x": [1, 2]}
  preflight.read_task_data(config)  # the edge check: both splits, seed 0
  batch = envs_build.build_envs(config, team_lib.build_team(config)[0], seed=5, num_envs=2,
                              group_size=1)
  assert SEEN == [({"high": 9, "x": [1, 2]}, "train", 0), ({"high": 9, "x": [1, 2]}, "test", 0),
                  ({"high": 9, "x": [1, 2]}, "train", 5), ({"high": 9, "x": [1, 2]}, "train", 5)]
  assert int(batch.reset(0)[1].task.split()[1]) < 9


@pytest.mark.parametrize("name, says", [
    ("no_such_module_xyz:make", "module 'no_such_module_xyz' does not import"),
    (f"{__name__}:missing", f"module '{__name__}' has no attribute 'missing'"),
    (f"{__name__}:NOT_CALLABLE", "is a int, not a function"),
    (f"{__name__}:raising", "raised RuntimeError: no data here"),
    (f"{__name__}:returns_text", "returned str, not a marft_jax.envs.Environment"),
])
def test_a_bad_factory_is_one_line_naming_the_key_and_the_module(name, says, tmp_path):
  config = algorithms.resolve(own(name))
  with pytest.raises(ValueError) as e:
    preflight.check_training_files(config)
  assert str(e.value).startswith(f"task.name={name!r}: ") and says in str(e.value)
  assert "\n" not in str(e.value) and name.split(":")[0] in str(e.value)
  with pytest.raises(ValueError, match="task.name="):  # the same from Python
    loop.train(config, str(tmp_path / "run"), progress=False)
  assert not os.path.exists(tmp_path / "run")  # refused before the workdir or the model


def test_train_task_names_the_factory_and_refuses_what_cannot_be_found_again(tmp_path):
  config = config_lib.TrainConfig(team=config_lib.TeamSection(roles=ROLES,
                                                              order="thinker,answerer"))
  named = tasks.with_factory(config, parity.make_env)
  assert named.task.name == "examples.parity:make_env"
  with pytest.raises(ValueError, match="not importable"):
    tasks.with_factory(config, lambda task, split, seed: parity.Parity())
  with pytest.raises(ValueError, match="two tasks"):
    tasks.with_factory(own(f"{__name__}:recording"), parity.make_env)
  with pytest.raises(ValueError, match=r"task.name=.*raising.*RuntimeError"):
    loop.train(config, str(tmp_path / "run"), task=raising, progress=False)


def test_config_checks_of_a_task_of_your_own():
  with pytest.raises(ValueError, match="team.roles: .*no shipped team"):
    config_lib.TrainConfig(task=config_lib.TaskSection(name="examples.parity:make_env"))
  with pytest.raises(ValueError, match="options=.*task of your own"):
    config_lib.TaskSection(name="arithmetic", options={"a": 1})
  with pytest.raises(ValueError, match="JSON values only"):
    config_lib.TaskSection(name="a.b:c", options={"a": object()})
  with pytest.raises(ValueError, match="'package.module:factory'"):
    config_lib.TaskSection(name="a.b:")
  with pytest.raises(ValueError, match="task.level=2 is read by"):
    own("a.b:c", level=2)
  assert own("a.b:c", horizon=3).task.horizon == 3  # a factory's episodes may take steps


def test_problem_ids_are_recorded_and_left_out_of_an_evaluation():
  config = algorithms.resolve(own("examples.parity:make_env", options={"high": 6}))
  team = team_lib.build_team(config)[0]
  batch = envs_build.build_envs(config, team, seed=0, num_envs=4, group_size=1)
  cursor = {"seed": 0, "episodes": [3, 3, 3, 3]}
  record = trained_problems.record(config, cursor, batch)
  played = {batch.envs[0].problem_id(batch.episode_seed(i, k)) for i in range(4)
            for k in range(3)}
  assert [i for i, _ in record["problems"]] == sorted(played)
  trained = trained_problems.fingerprints(record)
  assert set(trained.values()) == played and len(played) < 6
  test = envs_build.build_envs(config, team, seed=1, split="test", num_envs=4, group_size=1,
                             trained=trained)
  for i in range(4):
    for _ in range(5):
      number = test.reset(i)[1].task.split()[1]
      assert number not in played
      test.step(i, {"thinker": "", "answerer": "even"})
  episodes = [dataclasses.make_dataclass("E", ["seed"])(s) for s in range(40)]
  assert 0 < trained_problems.replaced_draws(config, episodes, trained) < 40


def test_launch_train_stops_on_a_bad_factory_before_the_model_loads(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", "--config=examples/parity_config.py",
       f"--workdir={tmp_path / 'run'}", "--config.task.name=examples.parity:nothing",
       "--config.model.source=/no/such/model"],
      capture_output=True, text=True, cwd=ROOT, timeout=300)
  lines = [l for l in out.stderr.splitlines() if l.strip()]
  assert out.returncode != 0 and lines[-1] == (
      "error: task.name='examples.parity:nothing': module 'examples.parity' has no "
      "attribute 'nothing'"), out.stderr[-2000:]

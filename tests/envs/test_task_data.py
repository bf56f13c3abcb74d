"""Tasks built from the config (`envs_build.build_envs`): problem files for math and code, their
held-out part, and the order problems are drawn in.

Held-out problems are never training problems: for a split file and for a train/test pair,
the problem ids every training env can draw and the ids the evaluation plays are disjoint.
Each problem is seen once per epoch, in an order seeded by the run that resume continues.
"""

import json
import logging

import numpy as np
import pytest

from marft_jax.envs import EnvBatch, EchoEnv, splits
from marft_jax.envs.problems import bundled_path
from marft_jax.train import config as config_lib
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train.build import preflight
from marft_jax.train.build import team as team_lib
from marft_jax.train import loop


def _config(num_envs=4, group_size=None, **task):
  rollout = dict(num_envs=num_envs, **({"group_size": group_size} if group_size else {}))
  return config_lib.preset("marft_a", task=config_lib.TaskSection(**task),
                           rollout=config_lib.RolloutSection(**rollout))


def _code_file(path, ids):
  with open(path, "w") as f:
    for name in ids:
      f.write(json.dumps({"id": name, "prompt": f"Print the word {name}.",
                          "tests": [{"input": "", "output": f"{name}\n"}]}) + "\n")
  return str(path)


def _math_file(path, numbers, stem="q"):
  with open(path, "w") as f:
    for n in numbers:
      f.write(json.dumps({"question": f"{stem}: what is {n} + 0?",
                          "answer": f"{n} + 0 = {n}\n#### {n}"}) + "\n")
  return str(path)


def _ids(config, split, episodes=None):
  """The problem ids the split's envs draw in `episodes` rounds (default: two epochs)."""
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=config.seed, split=split)
  try:
    rounds = episodes or -(-2 * envs.num_tasks // len(envs))
    seen = []
    for _ in range(rounds):
      for index in range(len(envs)):
        envs.reset(index)
        seen.append(envs.envs[index].problem.id)
    return seen
  finally:
    envs.close()


def test_code_task_reads_its_problem_file(tmp_path):
  path = _code_file(tmp_path / "mine.jsonl", [f"w{i}" for i in range(10)])
  seen = _ids(_config(name="code", path=path), "train")
  assert set(seen) <= {f"w{i}" for i in range(10)} and len(set(seen)) == 9


# --- held out: never a training problem ---

def test_split_is_seeded_and_holds_out_the_documented_fraction():
  items = list(range(50))
  train, test = splits.split(items)
  assert len(test) == 5 and sorted(train + test) == items  # 10 %
  assert splits.split(items) == (train, test)  # the same every time
  assert len(splits.split(items[:3])[1]) == 1  # at least one
  assert len(splits.split(items[:2])[0]) == 1  # at least one left to train on
  assert train == tuple(sorted(train)) and test == tuple(sorted(test))  # file order kept
  with pytest.raises(ValueError, match="at least 2"):
    splits.split(items[:1])


@pytest.mark.parametrize("name", ["math_jsonl", "code"])
def test_one_file_is_split_and_says_so(tmp_path, caplog, name):
  path = (_math_file(tmp_path / "all.jsonl", range(30)) if name == "math_jsonl"
          else _code_file(tmp_path / "all.jsonl", [f"w{i}" for i in range(30)]))
  config = _config(name=name, path=path)
  with caplog.at_level(logging.INFO):
    train = _ids(config, "train")
  test = _ids(config, "test")
  assert set(train).isdisjoint(test)
  assert len(set(test)) == 3 and len(set(train)) == 27  # every problem is in one part
  assert any("held out" in r.getMessage() and "3 of its 30" in r.getMessage()
             for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("name", ["math_jsonl", "code"])
def test_a_test_file_is_held_out_less_any_training_problem(tmp_path, caplog, name):
  if name == "math_jsonl":
    train_path = _math_file(tmp_path / "train.jsonl", range(8))
    test_path = _math_file(tmp_path / "test.jsonl", [6, 7, 100, 101, 102])  # 6, 7: in train
  else:
    train_path = _code_file(tmp_path / "train.jsonl", [f"w{i}" for i in range(8)])
    with open(tmp_path / "test.jsonl", "w") as f:  # the same prompts under other ids
      for i in (6, 7, 100, 101, 102):
        f.write(json.dumps({"id": f"test{i}", "prompt": f"Print  the word w{i}.",
                            "tests": [{"input": "", "output": f"w{i}\n"}]}) + "\n")
    test_path = str(tmp_path / "test.jsonl")
  config = _config(name=name, path=train_path, test_path=test_path)
  with caplog.at_level(logging.WARNING):
    test = _ids(config, "test")
  train = _ids(config, "train")
  assert len(set(train)) == 8 and len(set(test)) == 3 and set(train).isdisjoint(test)
  assert any("2 of its 5 problems are also in the training file" in r.getMessage()
             for r in caplog.records)


def test_math500_records_are_a_test_file_for_math_records():
  config = _config(name="math_jsonl", path=bundled_path("math_style.jsonl"),
                   test_path=bundled_path("math500_style.jsonl"))
  test = _ids(config, "test")
  assert sorted(set(test)) == sorted(p.id for p in splits.task_problems(
      "math_jsonl", config.task.path, config.task.test_path)[1])
  assert len(set(test)) == 6 and set(test).isdisjoint(_ids(config, "train"))


def test_a_one_problem_file_needs_a_test_file(tmp_path):
  path = _math_file(tmp_path / "one.jsonl", [5])
  with pytest.raises(ValueError, match="one.jsonl.*at least 2"):
    _ids(_config(name="math_jsonl", path=path), "train")


@pytest.mark.parametrize("name", ["math_jsonl", "code"])
def test_a_missing_or_malformed_problem_file_is_named_before_the_model_loads(
    tmp_path, monkeypatch, name):
  good = (_math_file if name == "math_jsonl" else _code_file)(tmp_path / "good.jsonl", "ab")
  missing = str(tmp_path / "missing.jsonl")
  for task, error in [
      (dict(path=missing), f"task.path='{missing}': no such file"),
      (dict(path=str(tmp_path)), "a folder, not a file"),
      (dict(path=good, test_path=missing), f"task.test_path='{missing}': no such file")]:
    with pytest.raises(FileNotFoundError, match=error):
      preflight.read_task_data(_config(name=name, **task))
  malformed = tmp_path / "malformed.jsonl"
  malformed.write_text(open(good).readline() + '{"question": \n')
  with pytest.raises(ValueError, match=r"malformed\.jsonl:2: not (valid )?JSON"):
    preflight.read_task_data(_config(name=name, path=str(malformed)))
  preflight.read_task_data(_config(name=name, path=good))  # a good file passes
  # The trainer reads the files before it loads the model (which can take minutes).
  monkeypatch.setattr(model_lib, "load", lambda config: pytest.fail("the model was loaded"))
  with pytest.raises(FileNotFoundError, match="task.path="):
    loop.train(_config(name=name, path=missing), str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["path", "test_path"])
@pytest.mark.parametrize("name", ["arithmetic", "echo"])
def test_problem_files_are_for_file_tasks_only(key, name):
  with pytest.raises(ValueError, match=f"^{key}='x.jsonl': only the file tasks .* not "
                                       f"name='{name}'"):
    config_lib.TaskSection(name=name, **{key: "x.jsonl"})


# --- once per epoch, in a seeded order that resume continues ---

def _play(batch, rounds):
  """The task seeds of `rounds` rollouts, one episode per env each, in env order."""
  return [batch.reset(i)[0] for _ in range(rounds) for i in range(len(batch))]


@pytest.mark.parametrize("num_envs, group_size, num_tasks", [(4, 1, 10), (6, 2, 9), (3, 3, 4)])
def test_consecutive_episodes_see_every_task_once_per_epoch(num_envs, group_size, num_tasks):
  batch = EnvBatch(lambda i: EchoEnv(graded=("a",)), num_envs, seed=7, group_size=group_size,
                   num_tasks=num_tasks)
  groups = num_envs // group_size
  seeds = _play(batch, rounds=3 * num_tasks)
  per_group = seeds[::group_size]  # one task per group of envs
  assert all(seeds[i] == seeds[i - i % group_size] for i in range(len(seeds)))
  epochs = [per_group[e * num_tasks:(e + 1) * num_tasks] for e in range(3 * groups)]
  for epoch in epochs:
    assert sorted(epoch) == list(range(num_tasks))
  assert len({tuple(e) for e in epochs}) > 1  # each epoch draws its own order
  other = EnvBatch(lambda i: EchoEnv(graded=("a",)), num_envs, seed=8, group_size=group_size,
                   num_tasks=num_tasks)
  assert _play(other, rounds=num_tasks) != seeds[:num_envs * num_tasks]  # seeded by the run


def test_resume_continues_the_same_order():
  make = lambda: EnvBatch(lambda i: EchoEnv(graded=("a",)), 4, seed=3, num_tasks=7)
  straight = _play(make(), rounds=6)
  first = make()
  head = _play(first, rounds=2)
  resumed = make()
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # as a checkpoint
  assert head + _play(resumed, rounds=4) == straight
  with pytest.raises(ValueError, match="tasks"):
    EnvBatch(lambda i: EchoEnv(graded=("a",)), 4, seed=3, num_tasks=8).load_state_dict(
        first.state_dict())


def test_training_envs_see_each_problem_once_per_epoch(tmp_path):
  path = _math_file(tmp_path / "all.jsonl", range(40))  # 36 to train on
  seen = _ids(_config(name="math_jsonl", path=path), "train", episodes=9)  # 4 envs x 9
  assert len(seen) == 36 and len(set(seen)) == 36


def test_generated_tasks_keep_independent_streams():
  batch = EnvBatch(lambda i: EchoEnv(graded=("a",)), 4, seed=0)
  seeds = _play(batch, rounds=2)
  assert len(set(seeds)) == 8 and min(seeds) > 1000  # hashes, not task indices
  assert np.all(np.asarray(seeds) >= 0)

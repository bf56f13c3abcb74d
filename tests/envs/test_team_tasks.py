"""The team tasks (split_facts, verify_correct, grid_path): seeded generators, disjoint
splits, exact graders (hand-written right and wrong answers, format edge cases), what each
role is shown, the trained-problem record, and the config wiring (the shipped teams, the
shared stream refused where roles see views of their own).
"""

import dataclasses
import itertools

import pytest

from marft_jax import envs
from marft_jax.envs import grid_path, split_facts, team_tasks, verify_correct
from marft_jax.envs.problems import Problem
from marft_jax.train import algorithms, teams, trained_problems
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import team as team_lib
from marft_jax.train import config as config_lib

MODULES = {"split_facts": split_facts, "verify_correct": verify_correct,
           "grid_path": grid_path}


@pytest.mark.parametrize("task", sorted(MODULES))
def test_the_generator_is_seeded(task):
  m = MODULES[task]
  assert m.generate_problems(20, 3) == m.generate_problems(20, 3)
  assert m.generate_problems(5, 3) == m.generate_problems(20, 3)[:5]
  assert m.generate_problems(20, 3) != m.generate_problems(20, 4)
  source = team_tasks.problems(task, "test")
  assert source.problem_for_seed(7) == m.generate_problems(1, 7, "test")[0]


@pytest.mark.parametrize("task", sorted(MODULES))
def test_the_splits_share_no_problem(task):
  m = MODULES[task]
  train = [p for s in range(40) for p in m.generate_problems(10, s, "train")]
  test = [p for s in range(40) for p in m.generate_problems(10, s, "test")]
  assert len({p.id for p in train + test}) == len(train) + len(test)
  assert not {p.question for p in train} & {p.question for p in test}
  assert all(p.meta["split"] == "train" for p in train)
  assert all(p.meta["split"] == "test" for p in test)
  fingerprints = {trained_problems.fingerprint(p) for p in train}
  assert not fingerprints & {trained_problems.fingerprint(p) for p in test}
  with pytest.raises(ValueError, match="split"):
    m.generate_problems(1, 0, "dev")


@pytest.mark.parametrize("task", ["split_facts", "verify_correct"])
def test_every_gold_answer_is_the_computation(task):
  for p in MODULES[task].generate_problems(200, 0, "train"):
    if task == "verify_correct":
      assert eval(p.meta["expression"]) == int(p.answer) > 0  # noqa: S307 (our own text)
    else:
      counts = [int(w) for w in p.meta["facts"].split() if w.isdigit()]
      assert len(counts) == split_facts.CONTAINERS
      assert int(p.answer) in {a + b for a in counts for b in counts} | \
          {a - b for a in counts for b in counts if a > b}


_GOLD = Problem("q", "1200", "p")


@pytest.mark.parametrize("reply, correct, how", [
    ("7 + 5 = \\boxed{1200}", True, "boxed"),
    ("\\boxed{1,200}", True, "boxed"),
    ("\\boxed{ 1200 }", True, "boxed"),
    ("\\boxed{$1200$}", True, "boxed"),
    ("\\boxed{1200.}", True, "boxed"),
    ("The answer is 1200.", True, "answer_is"),
    ("#### 1200", True, "hash"),
    ("so 600 + 600 = 1200", True, "last_number"),
    ("\\boxed{1200} but no, \\boxed{1201}", False, "boxed"),
    ("\\boxed{1201}", False, "boxed"),
    ("\\boxed{1200.5}", False, "boxed"),
    ("\\boxed{1200.0}", False, "boxed"),  # an integer task: a decimal is not its answer
    ("\\boxed{600 + 600}", False, "boxed"),
    ("\\boxed{-1200}", False, "boxed"),
    ("twelve hundred", False, "none"),
    ("", False, "none"),
])
def test_the_integer_grader_is_exact(reply, correct, how):
  got, prediction, got_how = team_tasks.integer_grade(reply, _GOLD)
  assert (got, got_how) == (correct, how)
  assert (prediction == "1200") == correct


_GRID = Problem("q", "RRDD", "g", meta={"rows": ["S.#", ".#.", "..G"]})


@pytest.mark.parametrize("reply, correct, how", [
    ("\\boxed{DDRR}", True, "boxed"),
    ("\\boxed{ddrr}", True, "boxed"),
    ("\\boxed{D, D, R, R}", True, "boxed"),
    ("\\boxed{D -> D -> R -> R}", True, "boxed"),
    ("\\boxed{DDRRLR}", True, "boxed"),  # any way that ends on G, not only the shortest
    ("\\boxed{RRDD}", False, "boxed"),  # into the wall at row 1, column 3
    ("\\boxed{DDR}", False, "boxed"),  # stops short of G
    ("\\boxed{LDDRRR}", False, "boxed"),  # off the grid first
    ("\\boxed{DDRRR}", False, "boxed"),  # past G, off the grid
    ("\\boxed{down down right right}", False, "malformed"),
    ("\\boxed{}", False, "malformed"),
    ("DDRR", False, "none"),
])
def test_the_path_grader_is_exact(reply, correct, how):
  got, moves, got_how = grid_path.grade(reply, _GRID)
  assert (got, got_how) == (correct, how)


def test_every_shipped_grid_has_its_answer_as_a_way():
  for p in grid_path.generate_problems(200, 1, "test"):
    rows = p.meta["rows"]
    assert len(rows) <= 5 and all(len(r) <= 5 for r in rows)
    assert sum(r.count("#") for r in rows) == grid_path.WALLS
    assert grid_path.follow(rows, p.answer) and len(p.answer) >= 2
    assert grid_path.shortest(rows) == p.answer
    assert grid_path.grade(f"\\boxed{{{p.answer}}}", p)[0]


def _fewest_moves(rows):
  """The length of the shortest way from S to G by trying every move string, shortest
  first (independent of `grid_path.shortest`'s breadth-first search)."""
  for k in range(1, 9):
    if any(grid_path.follow(rows, "".join(m)) for m in itertools.product("UDLR", repeat=k)):
      return k
  return None


@pytest.mark.parametrize("task", sorted(MODULES))
def test_each_problems_kind_is_read_from_its_own_text(task):
  problems = MODULES[task].generate_problems(150, 2, "test")
  for p in problems:
    if task == "split_facts":
      want = "difference" if p.meta["ask"].startswith("How many more") else "total"
    elif task == "verify_correct":
      want = "times" if "*" in p.meta["expression"] else "add_sub"
    else:
      k = _fewest_moves(p.meta["rows"])
      want = f"{k}_moves" if k < 4 else "4+_moves"
    assert p.meta["kind"] == want, p
  kinds = {"split_facts": set(split_facts.KINDS), "verify_correct": {"times", "add_sub"},
           "grid_path": {"2_moves", "3_moves", "4+_moves"}}[task]
  assert {p.meta["kind"] for p in problems} == kinds


def test_split_facts_shows_each_half_to_one_role():
  p = split_facts.generate_problems(1, 0, "test")[0]
  obs = split_facts.observation(p, ("reporter", "middle", "answerer"))
  assert obs.view("reporter") == f"Facts: {p.meta['facts']}"
  assert obs.view("answerer") == f"Question: {p.meta['ask']}"
  assert obs.view("middle") == obs.task == p.meta["task"]
  assert p.meta["ask"] not in obs.view("reporter") and p.meta["facts"] not in obs.task
  assert not any(ch.isdigit() for ch in obs.view("answerer"))  # the counts are the reporter's
  with pytest.raises(ValueError, match="at least 2"):
    team_tasks.make_env("split_facts", team_tasks.problems("split_facts", "test"), ("a",), ("a",))


@pytest.mark.parametrize("task", sorted(MODULES))
def test_one_episode_grades_the_graded_role(task):
  env = team_tasks.make_env(task, team_tasks.problems(task, "test"), ("first", "second"),
                            ("second",))
  obs = env.reset(5)
  problem = env.problem
  right = f"\\boxed{{{problem.answer}}}"
  step = env.step({"first": right, "second": right})
  assert step.done and step.observation is None and step.rewards == {"first": 1.0,
                                                                       "second": 1.0}
  assert step.info["problem_id"] == problem.id and step.info["correct"] == {"second": True}
  assert step.info["metrics"] == {"score": 1.0, "formatted_answer": 1.0}
  assert env.reset(5) == obs
  wrong = env.step({"first": right, "second": "no idea"})
  assert wrong.rewards == {"first": 0.0, "second": 0.0}
  assert wrong.info["metrics"] == {"score": 0.0, "formatted_answer": 0.0}
  with pytest.raises(RuntimeError, match="reset"):
    env.step({"second": right})


# Per task: a right answer in its graded form without a box, and one given another way (a
# grid path's moves are written one word each, as its prompt shows: "R D R").
_UNBOXED = {"split_facts": ("The answer is {}.", "so it is {}"),
            "verify_correct": ("#### {}", "so it is {}"),
            "grid_path": ("Path: {}", "{}")}


@pytest.mark.parametrize("task", sorted(MODULES))
def test_the_held_out_format_rate_counts_each_tasks_own_form(task):
  """evaluate's answer_format_rate reads the env's per-role `formatted`: grid_path's "Path:"
  form is its graded form (it read 0 % when only the math forms counted)."""
  from types import SimpleNamespace
  from marft_jax.train import evaluate
  env = team_tasks.make_env(task, team_tasks.problems(task, "test"), ("first", "second"),
                            ("second",))
  formatted_reply, other_reply = _UNBOXED[task]
  infos = []
  for seed, reply in enumerate([formatted_reply] * 3 + [other_reply]):
    env.reset(seed)
    answer = " ".join(env.problem.answer) if task == "grid_path" else env.problem.answer
    infos.append(env.step({"first": "", "second": reply.format(answer)}).info)
  assert [i["formatted"] for i in infos] == [{"second": True}] * 3 + [{"second": False}]
  episodes = [SimpleNamespace(dropped=None, infos=[i], rewards=[[1.0]], turns=[])
              for i in infos]
  team = [SimpleNamespace(role="first", graded=False), SimpleNamespace(role="second",
                                                                        graded=True)]
  assert evaluate.summarize(episodes, team)["answer_format_rate/second"] == 0.75
  # A user's env that names only its answer's form still counts the math forms.
  for i in infos:
    del i["formatted"]
  assert evaluate.summarize(episodes, team)["answer_format_rate/second"] == (
      0.0 if task == "grid_path" else 0.75)


def _config(task, **changes):
  base = config_lib.TrainConfig(algorithm="marft_a")
  return algorithms.resolve(dataclasses.replace(
      base, task=config_lib.TaskSection(name=task),
      team=config_lib.TeamSection(**teams.shipped(task, 2)), **changes))


@pytest.mark.parametrize("task", sorted(MODULES))
def test_the_task_builds_with_its_shipped_team(task):
  config = _config(task)
  team, structure = team_lib.build_team(config)
  assert structure is None and [p.graded for p in team] == [False, True]
  batch = envs_build.build_envs(config, team, seed=0, split="test", num_envs=2)
  _, obs = batch.reset(0)
  assert isinstance(obs, envs.Observation)
  batch.close()
  with pytest.raises(ValueError, match="2 roles"):
    teams.shipped(task, 3)
  record = trained_problems.record(config, {"seed": 4, "episodes": [2, 1]})
  assert record["task"] == task
  played = {trained_problems.fingerprint(team_tasks.problems(task, "train").problem_for_seed(
      envs.EnvBatch(lambda i: None, 2, seed=4).episode_seed(i, k)))
            for i, n in enumerate([2, 1]) for k in range(n)}
  assert set(trained_problems.fingerprints(record)) == played


def test_the_shared_stream_is_refused_where_roles_see_views_of_their_own():
  with pytest.raises(ValueError, match="shared_stream.*split_facts.*per_agent"):
    team_lib.build_team(_config("split_facts", algorithm="shared_stream_ppo"))
  team_lib.build_team(_config("verify_correct", algorithm="shared_stream_ppo"))  # no views


@pytest.fixture(scope="module")
def tiny_model():
  from tests.train.echo_config import tiny_trainer_model
  return tiny_trainer_model()


@pytest.mark.parametrize("task", sorted(MODULES))
def test_one_training_iteration_on_the_tiny_model(task, tiny_model, tmp_path):
  """`loop.train` plays the task with its shipped team (each role's prompt holds what it may
  see) and updates: a metrics row with a finite loss and the task's own metrics."""
  import glob
  import json
  from marft_jax.train import loop
  from tests.train.echo_config import echo_config
  config = echo_config("marft_a", num_envs=4, iterations=1,
                       task=config_lib.TaskSection(name=task),
                       team=config_lib.TeamSection(**teams.shipped(task, 2), max_new_tokens=3,
                                                   last_max_new_tokens=3, temperature=0.7),
                       rollout=config_lib.RolloutSection(num_envs=4, max_context=1024))
  loop.train(config, str(tmp_path), model=tiny_model, progress=False)
  with open(tmp_path / "metrics.jsonl") as f:
    (row,) = [json.loads(line) for line in f]
  assert row["episodes"] == 4 and row["dropped"] == 0, row
  assert 0.0 <= row["env/score"] <= 1.0 and row["loss"] == row["loss"], row
  records = [json.loads(line) for path in glob.glob(str(tmp_path / "transcripts" / "*.jsonl"))
             for line in open(path)]
  assert len(records) == 4
  for record in records:
    first, second = record["turns"]
    if task == "split_facts":  # each role saw its own half, recorded per turn
      assert first["view"].startswith("Facts: ") and first["view"] in first["prompt"]
      assert second["view"].startswith("Question: ") and second["view"] in second["prompt"]
      assert "Question: " not in first["prompt"] and "holds" not in second["view"]
    else:
      assert first["view"] is None and record["task"] in first["prompt"]

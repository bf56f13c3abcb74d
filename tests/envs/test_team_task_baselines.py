"""The team tasks' single-agent form (`team_tasks.full_information_<task>`): the same problems
and grader, every role shown the whole problem, the team's last role graded; grid_path's
`Path:` form, graded as exactly as its `\\boxed{}` one; its corner grids and candidates."""

import pytest

from marft_jax.envs import grid_path, team_tasks
from marft_jax.envs.problems import Problem
from marft_jax.train import tasks as tasks_lib
from marft_jax.train.config import TaskSection

FACTORIES = {t: getattr(team_tasks, f"full_information_{t}") for t in team_tasks.names()}


@pytest.mark.parametrize("task", team_tasks.names())
def test_full_information_shows_the_whole_problem_and_grades_the_last_role(task):
  config = TaskSection(name=f"marft_jax.envs.team_tasks:full_information_{task}")
  tasks_lib.check(config)  # what launch.train checks of a factory before the model loads
  env = FACTORIES[task](config, "test", 0)
  obs = env.reset(11)
  same = team_tasks.problems(task, "test").problem_for_seed(11)  # the team's problem of seed 11
  assert env.problem == same
  assert obs.task == same.question and not obs.role_views
  assert obs.view("solver") == obs.view("draft") == same.question
  reply = f"\\boxed{{{same.answer}}}"
  step = env.step({"draft": "", "final": reply})  # the rollout's actions: team order
  assert step.info["correct"] == {"final": True} and step.rewards == {"draft": 1.0, "final": 1.0}
  env.reset(11)
  assert env.step({"solver": "no answer"}).info["correct"] == {"solver": False}


def test_split_facts_full_information_holds_facts_and_question():
  env = team_tasks.full_information_split_facts(TaskSection(), "train", 0)
  obs = env.reset(3)
  assert env.problem.meta["facts"] in obs.task and env.problem.meta["ask"] in obs.task


_GRID = Problem("q", "RRDD", "g", meta={"rows": ["S.#", ".#.", "..G"]})


@pytest.mark.parametrize("reply, correct, how", [
    ("Path: D D R R", True, "path"),
    ("The moves are U, D. path: d d r r.", True, "path"),  # the last Path:, either case
    ("Path: R R\nPath: D-D->R R", True, "path"),
    ("The path from S to G is D D R R, a short one.", True, "path"),
    ("Path: D D R R then stop", True, "path"),  # the run of letters, then other words
    ("Path: DDRR.", True, "path"),  # upper-case letters written together
    ("Path: DD-R R", True, "path"),
    ("Path: DDRRU", False, "path"),  # past G
    ("Path: ddrr", False, "malformed"),  # lower case together is a word, not moves
    ("The path from S to G is D D, R R.", False, "path"),  # a comma ends the run: D D
    ("Path: R R D D", False, "path"),  # into the wall
    ("Path: D D R R \\boxed{RR}", False, "boxed"),  # a box counts first
    ("Path:", False, "malformed"),
    ("Path: down, down", False, "malformed"),
    ("Path: Right", False, "malformed"),  # a word starting with a move letter is no move
    ("This path is long.", False, "malformed"),
])
def test_the_path_form_is_graded_exactly(reply, correct, how):
  got, _, got_how = grid_path.grade(reply, _GRID)
  assert (got, got_how) == (correct, how)


def test_corner_grids_start_top_left_and_end_bottom_right(monkeypatch):
  monkeypatch.setattr(grid_path, "CORNERS", True)
  monkeypatch.setattr(grid_path, "ROWS", 5)
  monkeypatch.setattr(grid_path, "COLS", 5)
  monkeypatch.setattr(grid_path, "WALLS", 4)
  problems = grid_path.generate_problems(50, 0, "test")
  for p in problems:
    rows = p.meta["rows"]
    assert rows[0][0] == "S" and rows[-1][-1] == "G"
    assert sum(r.count("#") for r in rows) == 4 and grid_path.follow(rows, p.answer)
  assert len({tuple(p.meta["rows"]) for p in problems}) > 40  # held-out grids, mostly distinct


def test_candidates_list_the_way_and_failing_paths(monkeypatch):
  monkeypatch.setattr(grid_path, "CANDIDATES", 3)
  for p in grid_path.generate_problems(30, 2, "train"):
    listed = p.question.rsplit("Candidate paths: ", 1)[1].rstrip(".").split(", ")
    paths = [c.replace(" ", "") for c in listed]
    assert p.meta["candidates"] == paths  # what the analysis of a copied candidate reads
    assert len(set(paths)) == 3 and p.answer in paths
    assert [grid_path.follow(p.meta["rows"], c) for c in paths].count(True) == 1
    assert {len(c) for c in paths} == {len(p.answer)}


def test_a_grid_without_candidates_lists_none(monkeypatch):
  monkeypatch.setattr(grid_path, "CANDIDATES", 0)
  for p in grid_path.generate_problems(10, 2, "train"):
    assert p.meta["candidates"] == [] and "Candidate paths" not in p.question

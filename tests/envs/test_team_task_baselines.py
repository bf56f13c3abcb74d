"""The team tasks' single-agent form (`team_tasks.full_information`): the same problems and
grader, every role shown the whole problem; and grid_path's `Path:` form, graded as exactly as
its `\\boxed{}` one."""

import pytest

from marft_jax.envs import grid_path, team_tasks
from marft_jax.envs.problems import Problem
from marft_jax.train.config import TaskSection

FACTORY = "marft_jax.envs.team_tasks:full_information"


def _task(**options):
  return TaskSection(name=FACTORY, options=options)


@pytest.mark.parametrize("task", team_tasks.names())
def test_full_information_shows_the_whole_problem_and_grades_the_named_role(task):
  env = team_tasks.full_information(_task(task=task, graded="solver"), "test", 0)
  obs = env.reset(11)
  same = team_tasks.problems(task, "test").problem_for_seed(11)  # the team's problem of seed 11
  assert env.problem == same
  assert obs.task == same.question and not obs.role_views
  assert obs.view("solver") == obs.view("draft") == same.question
  right = team_tasks.make_env(task, team_tasks.problems(task, "test"), ("a", "b"), ("b",))
  right.reset(11)
  reply = f"\\boxed{{{same.answer}}}"
  assert env.step({"solver": reply}).info["correct"] == {"solver": True}
  assert right.step({"a": "", "b": reply}).info["correct"] == {"b": True}


def test_split_facts_full_information_holds_facts_and_question():
  env = team_tasks.full_information(_task(task="split_facts", graded="solver"), "train", 0)
  obs = env.reset(3)
  assert env.problem.meta["facts"] in obs.task and env.problem.meta["ask"] in obs.task


@pytest.mark.parametrize("options", [{}, {"task": "arithmetic", "graded": "x"},
                                     {"task": "grid_path"}, {"task": "grid_path", "graded": "x",
                                                             "extra": 1}])
def test_full_information_refuses_bad_options(options):
  with pytest.raises(ValueError, match="task.options"):
    team_tasks.full_information(_task(**options), "test", 0)


_GRID = Problem("q", "RRDD", "g", meta={"rows": ["S.#", ".#.", "..G"]})


@pytest.mark.parametrize("reply, correct, how", [
    ("Path: D D R R", True, "path"),
    ("The moves are U, D. path: d, d, r, r.", True, "path"),  # the last Path:, either case
    ("Path: R R\nPath: D D R R", True, "path"),
    ("Path: D D R R then stop", False, "malformed"),
    ("Path: R R D D", False, "path"),  # into the wall
    ("Path: D D R R \\boxed{RR}", False, "boxed"),  # a box counts first
    ("Path:", False, "malformed"),
    ("Path: down, down", False, "malformed"),
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

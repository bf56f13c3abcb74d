"""The team tasks: generated problems a two-role team has a reason to solve together.

  split_facts     each role sees half of the problem: the quantities, or the question asked
                  of them (`split_facts.py`); the graded answer needs both.
  verify_correct  two-operation arithmetic: a solver writes the calculation, a checker sees
                  it and gives the final answer (`verify_correct.py`).
  grid_path       a small grid with walls: a planner writes the moves, an executor the
                  final path in the graded form (`grid_path.py`).

Each task module has a seeded generator (`generate_problems(n, seed, split)`, Python's
`random.Random` stream of a string seed, `random()` only, as `arithmetic.py`), a train and a
held-out split (a problem's signature, its numbers or grid and not its wording, hashed into
ten buckets, one of them "test": `arithmetic.split_of`; the generator discards the other
split's draws, so the two never share a problem or an id), an exact grader (no model judges)
and the observation it shows each role (`observation(problem, roles)`). This module holds
what they share: the problem source, the one-step environment and the integer answer reader.

One episode is one env step: every role speaks once in the team's graph, the graded roles'
replies are graded, and the score (the mean over them, 0 or 1 with one graded role) is
every role's reward. `Step.info` holds `problem_id`, `gold`, and per graded role
`prediction`, `answer_format`, `formatted` (whether that form is the task's graded form:
grid_path's "path" is, a bare last number is not) and `correct`; `info["metrics"]`: `score` and
`formatted_answer` (the fraction of graded replies in the graded form).

The baselines' form of each task is `full_information_<task>`, a task of your own
(`task.name="marft_jax.envs.team_tasks:full_information_grid_path"`, ...): the same problems
and grader, every role shown the whole problem (split_facts' facts and question together),
the team's last role graded, so that one agent can solve it alone (`WholeProblemEnv`).
"""

from __future__ import annotations

import random
import re
from typing import Callable, Mapping, Optional, Sequence

from marft_jax.envs.base import Environment, Observation, Step
from marft_jax.envs.math_grading import extract_answer
from marft_jax.envs.problems import Problem, check_seed

SPLITS = ("train", "test")
_INTEGER = re.compile(r"[-\u2212]?\d{1,3}(?:,\d{3})+|[-\u2212]?\d+")


def rng_for(task: str, split: str, seed: int) -> random.Random:
  """The generator stream of `task`'s `split` and `seed` (the same on any machine)."""
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: must be one of {SPLITS}")
  return random.Random(f"marft_jax.{task}/{split}/{check_seed(seed)}")


def randint(rng: random.Random, low: int, high: int) -> int:
  """Uniform in [low, high], from `rng.random()` only (stable across Python versions)."""
  return low + int(rng.random() * (high - low + 1))


def choice(rng: random.Random, options: Sequence):
  return options[int(rng.random() * len(options))]


def read_integer(reply: str) -> tuple[Optional[int], str]:
  """(the reply's final answer as an exact integer, or None; how it was given).

  The answer is `math_grading.extract_answer`'s (the last `\\boxed{}`, `####`, "answer is",
  else the last number: `how` says which). It counts when it is one integer, with or without
  thousands separators, a sign, a `$` or a trailing full stop (`\\boxed{1,200}`, `$12`, `12.`);
  `12.0`, `12.5`, `7+5` or words are no integer (None; `how` is kept)."""
  found, how = extract_answer(reply)
  if found is None:
    return None, how
  text = found.strip().lstrip("\\").strip("$ ").rstrip(".").strip()
  if not _INTEGER.fullmatch(text):
    return None, how
  return int(text.replace(",", "").replace("\u2212", "-")), how


class Problems:
  """An endless problem source: seed s gives the first problem of `generate(1, s, split)`
  (`generate` a task module's `generate_problems`)."""

  def __init__(self, generate: Callable[..., list], split: str = "train"):
    if split not in SPLITS:
      raise ValueError(f"split={split!r}: must be one of {SPLITS}")
    self.generate, self.split = generate, split

  def __repr__(self) -> str:
    return f"Problems({self.generate.__module__}, split={self.split!r})"

  def problem_for_seed(self, seed: int) -> Problem:
    return self.generate(1, check_seed(seed), self.split)[0]


# grade(reply, problem) -> (correct, prediction as text or None, how it was given)
Grade = Callable[[str, Problem], tuple[bool, Optional[str], str]]


class TeamTaskEnv(Environment):
  """One env step on a generated problem, graded exactly (see the module docstring).

  problems: the source (`Problems`, or anything with `problem_for_seed`).
  roles: the team's role names in order (the task's views go to roles by position).
  graded_roles: whose replies are graded.
  observation: (problem, roles) -> what the roles are shown.
  grade: the task's grader.
  formatted: the `how`s that count as the graded form.
  """

  def __init__(self, problems, roles: Sequence[str], graded_roles: Sequence[str],
               observation: Callable[[Problem, Sequence[str]], Observation], grade: Grade,
               formatted: Sequence[str]):
    self.problems, self.roles = problems, tuple(roles)
    self.graded_roles = tuple(graded_roles)
    if not self.graded_roles:
      raise ValueError("graded_roles: name the role(s) whose answer counts")
    self._observation, self._grade, self.formatted = observation, grade, tuple(formatted)
    self.problem: Optional[Problem] = None

  def reset(self, seed: int) -> Observation:
    self.problem = self.problems.problem_for_seed(seed)
    return self._observation(self.problem, self.roles)

  def step(self, actions: Mapping[str, str]) -> Step:
    if self.problem is None:
      raise RuntimeError("step: no episode in progress; call reset(seed) first")
    grades = {r: self._grade(actions.get(r, ""), self.problem) for r in self.graded_roles}
    score = sum(g[0] for g in grades.values()) / len(grades)
    formatted = sum(g[2] in self.formatted for g in grades.values()) / len(grades)
    info = {"problem_id": self.problem.id, "gold": self.problem.answer,
            "prediction": {r: g[1] for r, g in grades.items()},
            "answer_format": {r: g[2] for r, g in grades.items()},
            "formatted": {r: g[2] in self.formatted for r, g in grades.items()},
            "correct": {r: g[0] for r, g in grades.items()},
            "metrics": {"score": score, "formatted_answer": formatted}}
    self.problem = None
    return Step(observation=None, rewards={r: score for r in actions}, done=True, info=info)


def integer_grade(reply: str, problem: Problem) -> tuple[bool, Optional[str], str]:
  """A `Grade` for an integer gold answer (`read_integer`)."""
  value, how = read_integer(reply)
  return value is not None and value == int(problem.answer), \
      None if value is None else str(value), how


def names() -> tuple[str, ...]:
  return tuple(_MODULES)


def module(task: str):
  """The task module of `task` (one of `names()`)."""
  import importlib
  if task not in _MODULES:
    raise ValueError(f"task={task!r}: the team tasks are {names()}")
  return importlib.import_module(f"marft_jax.envs.{_MODULES[task]}")


def problems(task: str, split: str) -> Problems:
  """`task`'s problem source of `split`."""
  return Problems(module(task).generate_problems, split)


def make_env(task: str, source, roles: Sequence[str], graded_roles: Sequence[str]
             ) -> TeamTaskEnv:
  """An environment of `task` over `source`, for a team of `roles` (in order)."""
  m = module(task)
  m.check_roles(roles)
  return TeamTaskEnv(source, roles, graded_roles, m.observation, m.grade, m.FORMATTED)


class WholeProblemEnv(TeamTaskEnv):
  """A team task with every role shown the whole problem (`Problem.question`; no role views)
  and the team's last role graded: the last key of `actions`, which the rollout fills in the
  team's order (`rollout.runner`)."""

  def __init__(self, task: str, split: str):
    m = module(task)
    super().__init__(problems(task, split), (), ("?",), _whole_problem, m.grade, m.FORMATTED)

  def step(self, actions: Mapping[str, str]) -> Step:
    if actions:
      self.graded_roles = (list(actions)[-1],)
    return super().step(actions)


def _whole_problem(problem: Problem, roles: Sequence[str]) -> Observation:
  return Observation(task=problem.question)


# The single-agent baselines' environments, tasks of your own (`train/tasks.py`'s factory
# contract: task.name="marft_jax.envs.team_tasks:full_information_<task>"). Episode seeds
# give the same problems as the named task's (`Problems`), so a baseline and a team evaluated
# with one seed score the same held-out problems; `seed` is unused (each `reset` brings it).
def full_information_split_facts(task, split: str, seed: int) -> WholeProblemEnv:
  """split_facts with the facts and the question shown together."""
  return WholeProblemEnv("split_facts", split)


def full_information_verify_correct(task, split: str, seed: int) -> WholeProblemEnv:
  """verify_correct, graded on the team's last role."""
  return WholeProblemEnv("verify_correct", split)


def full_information_grid_path(task, split: str, seed: int) -> WholeProblemEnv:
  """grid_path, graded on the team's last role."""
  return WholeProblemEnv("grid_path", split)


_MODULES = {"split_facts": "split_facts", "verify_correct": "verify_correct",
            "grid_path": "grid_path"}
# The tasks whose roles see views of their own (`Observation.role_views`): the per-agent view
# only (a shared stream would show each view to the later roles).
PRIVATE_VIEWS = ("split_facts",)

"""Verify and correct: two-operation arithmetic, a solver's calculation checked by a checker.

A problem is a starting number and two operations applied in turn ("Start with 12. Add 7,
then multiply by 3. What is the result?"), each of +, − or ×, every intermediate result a
positive integer. Every role sees the problem. The team's first role writes the
calculation step by step; the last (graded) role reads it and gives the final answer, so a
wrong first step can be caught and corrected there.

Knobs (calibrated for the untuned SmolLM2-135M team, docs/team_tasks.md): the starting
number and the added or subtracted amounts from `NUMBERS`, multipliers from `FACTORS`,
operations `OPS`.

Grading is exact: the graded role's final answer (`team_tasks.read_integer`) must equal the
result. `Problem.meta["expression"]` is the computation as Python (`((12 + 7) * 3)`).
Splits: a problem's signature is its numbers and operations; see `team_tasks`.
"""

from __future__ import annotations

from typing import Sequence

from marft_jax.envs import arithmetic
from marft_jax.envs.base import Observation
from marft_jax.envs.problems import Problem
from marft_jax.envs.team_tasks import choice, integer_grade, randint, rng_for

NAME = "verify_correct"
NUMBERS = (1, 9)
FACTORS = (2, 3)
OPS = ("add", "sub", "times")
FORMATTED = ("boxed", "hash", "answer_is")
grade = integer_grade

_WORDS = {"add": ("add {x}", "{v} + {x}"), "sub": ("subtract {x}", "{v} - {x}"),
          "times": ("multiply by {x}", "{v} * {x}")}


def _step(rng, op: str, v: int):
  """(amount, new value) of one operation on `v`, or None when it would not stay positive."""
  x = randint(rng, *(FACTORS if op == "times" else NUMBERS))
  new = {"add": v + x, "sub": v - x, "times": v * x}[op]
  return (x, new) if new > 0 else None


def _draw(rng):
  v = start = randint(rng, *NUMBERS)
  steps, expr = [], str(start)
  for _ in range(2):
    op = choice(rng, OPS)
    done = _step(rng, op, v)
    if done is None:
      return None
    x, v = done
    steps.append((op, x))
    expr = f"({_WORDS[op][1].format(v=expr, x=x)})"
  words = [_WORDS[op][0].format(x=x) for op, x in steps]
  question = f"Start with {start}. {words[0].capitalize()}, then {words[1]}. What is the result?"
  return question, v, (NAME, start, tuple(steps)), expr


def generate_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
  """`n` problems of `split`; the same arguments always give the same list (meta:
  `expression`, `kind`: "times" when a step multiplies, else "add_sub", and `split`)."""
  rng = rng_for(NAME, split, seed)
  problems = []
  while len(problems) < n:
    drawn = _draw(rng)
    if drawn is None or arithmetic.split_of(drawn[2]) != split:
      continue
    question, answer, signature, expr = drawn
    kind = "times" if any(op == "times" for op, _ in signature[2]) else "add_sub"
    problems.append(Problem(question=question, answer=str(answer),
                            id=f"{NAME}-{split}-s{seed}-{len(problems)}",
                            meta={"expression": expr, "kind": kind, "split": split}))
  return problems


def check_roles(roles: Sequence[str]) -> None:
  if not roles:
    raise ValueError("verify_correct: a team of at least one role")


def observation(problem: Problem, roles: Sequence[str]) -> Observation:
  """Every role sees the problem."""
  return Observation(task=problem.question)

"""Split information: one role sees the quantities, the other the question asked of them.

A problem is a few containers with a count each ("Box A holds 7 marbles.") and a question on
two of them: their total, or how many more one holds than the other. The team's first role
(in order) sees only the facts, its last role only the question (`Observation.role_views`);
any role between them, and the task, say only what the team must do. So the graded answer
needs both: the facts' role must pass the counts on, the question's role must pick the two
it is asked about and compute. Roles speak in the per-agent view (a shared stream would show
the facts to the later role: refused).

Knobs (calibrated for the untuned SmolLM2-135M team, docs/team_tasks.md): `CONTAINERS`
containers, counts from `COUNTS`, the questions `KINDS`.

Grading is exact: the question's role's final answer (`team_tasks.read_integer`: the last
`\\boxed{}`, else "answer is", else the last number) must equal the gold integer.
Splits: a problem's signature is its setting, counts and question (not its wording); see
`team_tasks`.
"""

from __future__ import annotations

from typing import Sequence

from marft_jax.envs import arithmetic
from marft_jax.envs.base import Observation
from marft_jax.envs.problems import Problem
from marft_jax.envs.team_tasks import choice, integer_grade, randint, rng_for

NAME = "split_facts"
CONTAINERS = 2
COUNTS = (1, 9)
KINDS = ("total", "difference")
FORMATTED = ("boxed", "hash", "answer_is")
grade = integer_grade

# (container, its plural's article form, the things counted)
_SETTINGS = (("box", "marbles"), ("jar", "coins"), ("tray", "cookies"), ("basket", "apples"),
             ("crate", "oranges"), ("tank", "fish"), ("bag", "sweets"), ("drawer", "pens"))
_LABELS = "ABCDE"
TASK = "Your team answers a question about {things}. Each of you sees only part of it."


def _draw(rng):
  container, things = choice(rng, _SETTINGS)
  counts = [randint(rng, *COUNTS) for _ in range(CONTAINERS)]
  kind = choice(rng, KINDS)
  i = randint(rng, 0, CONTAINERS - 1)
  j = randint(rng, 0, CONTAINERS - 2)
  j += j >= i  # a second, other container
  if kind == "difference" and counts[i] == counts[j]:
    return None
  if kind == "difference" and counts[i] < counts[j]:
    i, j = j, i
  x, y = f"{container} {_LABELS[i]}", f"{container} {_LABELS[j]}"
  facts = " ".join(f"{container.capitalize()} {_LABELS[k]} holds {n} {things}."
                   for k, n in enumerate(counts))
  if kind == "total":
    question, answer = f"How many {things} are in {x} and {y} together?", counts[i] + counts[j]
  else:
    question, answer = f"How many more {things} are in {x} than in {y}?", counts[i] - counts[j]
  signature = (NAME, container, tuple(counts), kind, i, j)
  return facts, question, answer, signature, things, kind


def generate_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
  """`n` problems of `split`; the same arguments always give the same list. `question` is
  the whole problem (facts, then question: what a fingerprint hashes); meta holds
  `facts`, `ask` (the question alone), `task` (what roles without a view see), `kind`
  (the question's, one of `KINDS`), `split`."""
  rng = rng_for(NAME, split, seed)
  problems = []
  while len(problems) < n:
    drawn = _draw(rng)
    if drawn is None or arithmetic.split_of(drawn[3]) != split:
      continue
    facts, question, answer, _, things, kind = drawn
    problems.append(Problem(
        question=f"{facts}\n{question}", answer=str(answer),
        id=f"{NAME}-{split}-s{seed}-{len(problems)}",
        meta={"facts": facts, "ask": question, "task": TASK.format(things=things),
              "kind": kind, "split": split}))
  return problems


def check_roles(roles: Sequence[str]) -> None:
  if len(roles) < 2:
    raise ValueError(f"split_facts: a team of at least 2 roles (the first sees the facts, the "
                     f"last the question); roles: {list(roles)}")


def observation(problem: Problem, roles: Sequence[str]) -> Observation:
  """The first role sees the facts, the last the question, any other role the task."""
  return Observation(task=problem.meta["task"],
                     role_views={roles[0]: f"Facts: {problem.meta['facts']}",
                                 roles[-1]: f"Question: {problem.meta['ask']}"})

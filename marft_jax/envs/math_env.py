"""The math environment: the team answers a problem, up to `horizon` tries, graded by
math-verify.

One episode (as in the original MARFT's MATH env, `reference/marft-original.md` §6):

  reset(seed)  -> Observation(task=question)
  step(replies) : grade the reply of every role in `graded_roles`;
                  score = mean correctness over them, given to every role that acted;
                  done when score > 0 or after `horizon` env steps;
                  otherwise the judge line ("The answer is incorrect.") is appended to
                  Observation.feedback and the team tries again.

So the return is 1 at the first correct try and 0 if every try is wrong (no step penalty). The
judge knows the gold answer, as in the original: later tries get oracle right/wrong feedback.
With `judge_feedback=None` the team gets no feedback line and simply tries again.

Each `Step.info` holds, for transcripts: `problem_id`, `gold`, `turn` (1-based), and per graded
role `prediction` (the extracted answer or None), `answer_format` ("boxed", "hash",
"answer_is", "last_number" or "none"; see `math_grading.extract_answer`), `formatted`
(whether that form is an explicit final answer: boxed, `####` or "answer is"), `correct` and
`grade_status` ("ok", "no_answer", "timeout", "error"). `info["metrics"]` (averaged over env
steps by the trainer): `score`, `formatted_answer` (fraction of graded replies with an explicit
final answer: boxed, `####` or "answer is"), `grade_timeout` and `grade_error` (how many graded
replies could not be graded in time / at all; they score 0, and are not wrong answers).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from marft_jax.envs.arithmetic import ArithmeticProblems
from marft_jax.envs.base import Environment, Observation, Step
from marft_jax.envs.math_grading import FORMATTED, Grader, extract_answer
from marft_jax.envs.problems import Problem, ProblemSource

INCORRECT = "The answer is incorrect."


class MathEnv(Environment):
  """Math problems with a gold answer, multi-turn with a judge.

  problems: where problems come from (`ProblemSet`, or anything with
    `problem_for_seed(seed)`); default: the arithmetic word problems, levels 1-3, train split.
  graded_roles: the roles whose replies are graded (e.g. the actor, not the reasoner).
  horizon: the most env steps (tries) per episode; 1 gives single-turn episodes.
  judge_feedback: the line added to the feedback after a wrong try, or None for none.
  grader: a shared `Grader` (one worker process for many envs); default: one of its own,
    stopped by `close()`.
  """

  def __init__(self, problems: Optional[ProblemSource] = None, *,
               graded_roles: Sequence[str] = ("actor",), horizon: int = 3,
               judge_feedback: Optional[str] = INCORRECT, grader: Optional[Grader] = None):
    self.graded_roles = tuple(graded_roles)
    if not self.graded_roles or not all(isinstance(r, str) for r in self.graded_roles):
      raise ValueError(f"graded_roles={graded_roles!r}: must be a non-empty list of role names")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
      raise ValueError(f"horizon={horizon!r}: must be an int >= 1")
    self.problems = ArithmeticProblems() if problems is None else problems
    self.horizon = horizon
    self.judge_feedback = judge_feedback
    self._owns_grader = grader is None
    self.grader = Grader() if grader is None else grader
    self.problem: Optional[Problem] = None
    self._turn = 0
    self._feedback: tuple[str, ...] = ()
    self._done = True

  def reset(self, seed: int) -> Observation:
    self.problem = self.problems.problem_for_seed(seed)
    self._turn, self._feedback, self._done = 0, (), False
    return Observation(task=self.problem.question)

  def step(self, actions: Mapping[str, str]) -> Step:
    if self.problem is None or self._done:
      raise RuntimeError("MathEnv.step: no episode in progress; call reset(seed) first")
    missing = [r for r in self.graded_roles if r not in actions]
    if missing:
      raise ValueError(f"MathEnv.step: graded roles {missing} have no reply "
                       f"(replies from {sorted(actions)})")
    gold = self.problem.answer
    extracted = {r: extract_answer(actions[r]) for r in self.graded_roles}
    grades = {r: self.grader.grade(gold, pred) for r, (pred, _) in extracted.items()}
    score = sum(g.correct for g in grades.values()) / len(grades)
    self._turn += 1
    self._done = score > 0 or self._turn >= self.horizon
    if not self._done and self.judge_feedback is not None:
      self._feedback += (self.judge_feedback,)
    observation = None if self._done else Observation(self.problem.question, self._feedback)
    return Step(observation=observation, rewards={r: score for r in actions}, done=self._done,
                info=self._info(extracted, grades, score))

  def _info(self, extracted, grades, score: float) -> dict:
    statuses = [g.status for g in grades.values()]
    formatted = [how in FORMATTED for _, how in extracted.values()]
    return {
        "problem_id": self.problem.id,
        "gold": self.problem.answer,
        "turn": self._turn,
        "prediction": {r: pred for r, (pred, _) in extracted.items()},
        "answer_format": {r: how for r, (_, how) in extracted.items()},
        "formatted": {r: how in FORMATTED for r, (_, how) in extracted.items()},
        "correct": {r: g.correct for r, g in grades.items()},
        "grade_status": {r: g.status for r, g in grades.items()},
        "grade_detail": {r: g.detail for r, g in grades.items() if g.detail},
        "metrics": {
            "score": score,
            "formatted_answer": sum(formatted) / len(formatted),
            "grade_timeout": float(statuses.count("timeout")),
            "grade_error": float(statuses.count("error")),
        },
    }

  def close(self) -> None:
    if self._owns_grader:
      self.grader.close()

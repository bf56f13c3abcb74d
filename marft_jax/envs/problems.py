"""Math problems with a gold final answer, read from local JSONL files in GSM8K or MATH form.

One JSON object per line; the form is detected per line:

- GSM8K form: `{"question": ..., "answer": "<worked solution> #### 42"}`. The gold answer is the
  text after the last `####` (thousands separators dropped: `1,200` -> `1200`). A
  `final_answer` key, when present, wins over `####`.
- MATH form: `{"problem": ..., "solution": "... \\boxed{...} ..."}`, or the same with a
  `final_answer` key (the original MARFT's files) or an `answer` key (MATH-500). The gold is
  `final_answer`, else `answer`, else the content of the last `\\boxed{}` in `solution`
  (braces matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`).

An `id` (or MATH-500's `unique_id`) key names the problem; without one the id is
`<file stem>:<line number>`. Every other key goes to `Problem.meta` unchanged. Blank lines
are skipped. A malformed line raises `ValueError("<path>:<line>: <what is wrong>")`.

`ProblemSet.problem_for_seed(seed)` maps env seeds to problems: consecutive seeds walk through
a shuffled order that visits every problem once per epoch, and the same seed always gives the
same problem (`shuffle=False`: seed s is problem s % n, file order). The trainer's `EnvBatch`
keeps the epoch order itself (`EnvBatch(num_tasks=n)`: each problem once per epoch, in an
order seeded by the run, which resume continues) and hands the set task indices.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import numbers
import os
import re
from typing import Any, Iterator, Mapping, Optional, Protocol, Sequence, Union, overload

import numpy as np

PathLike = Union[str, os.PathLike]

# Small problem files written for this package (tests, examples, smoke runs): GSM8K form; MATH
# forms mixed; MATH-500 records (problem, solution, answer, subject, level, unique_id), e.g.
# a test file beside math_style.jsonl.
BUNDLED = ("gsm8k_style.jsonl", "math_style.jsonl", "math500_style.jsonl")

# A number written with thousands separators: 1,200 or -12,345.5.
_GROUPED_NUMBER = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem.

  question: the problem statement shown to the agents.
  answer: the gold final answer as text (`"42"`, `"\\frac{1}{2}"`), compared by the grader.
  id: a name that is unique within its problem set (for transcripts and reproducibility).
  meta: whatever else the source had (level, subject, worked solution, ...); not compared
    by hash.
  """

  question: str
  answer: str
  id: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def last_boxed(text: str) -> Optional[str]:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces matched, or
  None if there is none or its braces never close."""
  starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      depth += {"{": 1, "}": -1}.get(text[i], 0)
      if depth == 0:
        return text[start:i].strip()
  return None


def normalize_number(text: str) -> str:
  """Drops thousands separators from a plain number (`"1,200"` -> `"1200"`); other text is
  returned stripped and unchanged."""
  text = text.strip()
  if _GROUPED_NUMBER.fullmatch(text):
    return text.replace(",", "")
  return text


def _text_field(record: Mapping[str, Any], key: str, where: str) -> str:
  value = record[key]
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise ValueError(f"{where}: key {key!r} must be a string or a number, "
                     f"got {type(value).__name__}")
  text = str(value).strip()
  if not text:
    raise ValueError(f"{where}: key {key!r} is empty")
  return text


def _gold_answer(record: Mapping[str, Any], question_key: str, where: str) -> str:
  if "final_answer" in record:
    return normalize_number(_text_field(record, "final_answer", where))
  if question_key == "question":  # GSM8K form
    if "answer" not in record:
      raise ValueError(f"{where}: GSM8K form ('question') needs an 'answer' key")
    answer = _text_field(record, "answer", where)
    if "####" not in answer:
      raise ValueError(f"{where}: GSM8K 'answer' has no '#### <final answer>' marker")
    final = answer.rsplit("####", 1)[1].strip()
    if not final:
      raise ValueError(f"{where}: nothing after '####' in the GSM8K 'answer'")
    return normalize_number(final)
  if "answer" in record:  # MATH-500 form
    return normalize_number(_text_field(record, "answer", where))
  if "solution" in record:
    boxed = last_boxed(_text_field(record, "solution", where))
    if not boxed:
      raise ValueError(f"{where}: MATH 'solution' has no complete \\boxed{{...}} answer")
    return normalize_number(boxed)
  raise ValueError(f"{where}: MATH form ('problem') needs 'final_answer', 'answer' or "
                   f"'solution' (with \\boxed{{}})")


def problem_from_record(record: Any, default_id: str, where: str) -> Problem:
  """Builds a Problem from one decoded JSON line (see the module docstring for the forms).

  where: `"<path>:<line>"`, prefixed to every error message.
  """
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  question_keys = [k for k in ("question", "problem") if k in record]
  if len(question_keys) != 1:
    raise ValueError(f"{where}: needs exactly one of 'question' (GSM8K form) or 'problem' "
                     f"(MATH form); keys are {sorted(record)}")
  question_key = question_keys[0]
  question = _text_field(record, question_key, where)
  answer = _gold_answer(record, question_key, where)
  id_key = next((k for k in ("id", "unique_id") if k in record), None)
  problem_id = _text_field(record, id_key, where) if id_key else default_id
  meta = {k: v for k, v in record.items() if k not in (question_key, id_key)}
  return Problem(question=question, answer=answer, id=problem_id, meta=meta)


def read_problems(path: PathLike) -> "ProblemSet":
  """Reads a JSONL problem file (GSM8K and MATH forms may mix, detected per line).

  Raises ValueError naming the file and line for a line that is not a JSON object of a known
  form, for an id used twice, and for a file with no problems.
  """
  path = os.fspath(path)
  stem = os.path.splitext(os.path.basename(path))[0]
  problems, first_line = [], {}
  with open(path, "rb") as f:
    for line_no, raw in enumerate(f, start=1):
      where = f"{path}:{line_no}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      problem = problem_from_record(record, default_id=f"{stem}:{line_no}", where=where)
      if problem.id in first_line:
        raise ValueError(f"{where}: id {problem.id!r} already used on line "
                         f"{first_line[problem.id]}")
      first_line[problem.id] = line_no
      problems.append(problem)
  if not problems:
    raise ValueError(f"{path}: no problems in the file")
  return ProblemSet(problems, name=stem)


def check_seed(seed: Any) -> int:
  """`seed` as a Python int; ValueError unless it is a non-negative integer (NumPy ints too)."""
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
    raise ValueError(f"seed={seed!r}: must be a non-negative int")
  return int(seed)


def bundled_path(name: str) -> str:
  """The path of a problem file shipped in `marft_jax/envs/data/` (one of `BUNDLED`)."""
  if name not in BUNDLED:
    raise ValueError(f"name={name!r}: must be one of {BUNDLED}")
  return str(importlib.resources.files("marft_jax.envs").joinpath("data", name))


class ProblemSource(Protocol):
  """Anything an environment can draw problems from: a ProblemSet, or a generator such as
  `arithmetic.ArithmeticProblems`. The same seed must give the same problem."""

  def problem_for_seed(self, seed: int) -> Problem:
    ...


class ProblemSet(Sequence[Problem]):
  """An immutable, indexable list of problems with a seeded order for environments.

  problems: at least one Problem.
  name: for messages and transcripts.
  shuffle: if False, seed s gives problem s % len (file order).
  shuffle_seed: selects the per-epoch permutations (the same value, the same order).
  """

  def __init__(self, problems: Sequence[Problem], name: str = "problems", *,
               shuffle: bool = True, shuffle_seed: int = 0):
    self._problems = tuple(problems)
    if not self._problems:
      raise ValueError(f"ProblemSet {name!r}: no problems")
    self.name = name
    self.shuffle = shuffle
    self.shuffle_seed = shuffle_seed
    self._epoch_order: tuple[int, Optional[np.ndarray]] = (-1, None)

  def __len__(self) -> int:
    return len(self._problems)

  @overload
  def __getitem__(self, index: int) -> Problem: ...

  @overload
  def __getitem__(self, index: slice) -> Sequence[Problem]: ...

  def __getitem__(self, index):
    return self._problems[index]

  def __iter__(self) -> Iterator[Problem]:
    return iter(self._problems)

  def __repr__(self) -> str:
    return f"ProblemSet({self.name!r}, {len(self)} problems)"

  def problem_for_seed(self, seed: int) -> Problem:
    """The problem an env reset with `seed` gets (a non-negative int).

    Seeds `e*n .. e*n + n-1` (n problems) visit every problem once, in the order of a
    permutation drawn from `(shuffle_seed, e)`: epoch e.
    """
    epoch, position = divmod(check_seed(seed), len(self))
    if not self.shuffle:
      return self._problems[position]
    if self._epoch_order[0] != epoch:
      rng = np.random.default_rng([self.shuffle_seed, epoch])
      self._epoch_order = (epoch, rng.permutation(len(self)))
    return self._problems[int(self._epoch_order[1][position])]

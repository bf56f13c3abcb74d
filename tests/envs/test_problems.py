"""Problem files: GSM8K and MATH forms, errors that name file and line, the seeded order."""

import json

import pytest

from marft_jax.envs.problems import (BUNDLED, Problem, ProblemSet, bundled_path, last_boxed,
                                     read_problems)


def write_jsonl(path, lines):
  path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
  return path


def test_gsm8k_form_takes_the_text_after_the_last_marker(tmp_path):
  path = write_jsonl(tmp_path / "g.jsonl", [
      {"question": "Two plus two?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
      {"question": "Seats?", "answer": "45 * 250 = 11,250 ... #### 1,380"},
      {"question": "Cold?", "answer": "#### -4 "},
  ])
  problems = read_problems(path)
  assert [p.answer for p in problems] == ["4", "1380", "-4"]
  assert problems[0] == Problem("Two plus two?", "4", "g:1",
                                {"answer": "2 + 2 = <<2+2=4>>4\n#### 4"})


def test_math_forms_final_answer_answer_and_boxed(tmp_path):
  path = write_jsonl(tmp_path / "m.jsonl", [
      {"problem": "Half?", "solution": "So $x = \\boxed{\\frac{1}{2}}$."},
      {"problem": "Nested?", "solution": "\\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}"},
      {"problem": "Pair?", "solution": "\\boxed{9}", "final_answer": "(4, 3)"},
      {"problem": "MATH-500", "solution": "\\boxed{7}", "answer": "\\frac{14}{3}",
       "unique_id": "test/algebra/1.json", "level": 3},
      {"problem": "Number", "final_answer": 12},
  ])
  problems = read_problems(path)
  assert [p.answer for p in problems] == [
      "\\frac{1}{2}", "\\sqrt{\\frac{a}{b}}", "(4, 3)", "\\frac{14}{3}", "12"]
  assert problems[3].id == "test/algebra/1.json"
  assert problems[3].meta == {"solution": "\\boxed{7}", "answer": "\\frac{14}{3}", "level": 3}
  assert [p.id for p in problems[:3]] == ["m:1", "m:2", "m:3"]


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
  path = write_jsonl(tmp_path / "b.jsonl", ["", {"question": "q", "answer": "#### 1"}, "  "])
  (problem,) = read_problems(path)
  assert problem.id == "b:2"


@pytest.mark.parametrize("line, message", [
    ('{"question": "q", "answer": "#### 1"', "not valid JSON"),
    ('["question", "answer"]', "expected a JSON object, got list"),
    ({"prompt": "q", "answer": "#### 1"}, "needs exactly one of 'question'"),
    ({"question": "q", "problem": "p", "answer": "#### 1"}, "needs exactly one of"),
    ({"question": "q", "answer": "the answer is 4"}, "no '#### <final answer>' marker"),
    ({"question": "q", "answer": "4 ####  "}, "nothing after '####'"),
    ({"question": "q"}, "needs an 'answer' key"),
    ({"problem": "p", "solution": "it is 4"}, "no complete \\boxed{...}"),
    ({"problem": "p", "solution": "\\boxed{4"}, "no complete \\boxed{...}"),
    ({"problem": "p"}, "needs 'final_answer', 'answer' or 'solution'"),
    ({"problem": "p", "final_answer": ""}, "key 'final_answer' is empty"),
    ({"problem": "p", "final_answer": None}, "key 'final_answer' must be a string or a number"),
    ({"problem": "p", "final_answer": True}, "must be a string or a number, got bool"),
    ({"problem": ["p"], "final_answer": "1"}, "key 'problem' must be a string"),
])
def test_a_malformed_line_names_file_line_and_fault(tmp_path, line, message):
  path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "fine", "answer": "#### 1"}, "", line])
  with pytest.raises(ValueError) as error:
    read_problems(path)
  assert str(error.value).startswith(f"{path}:3: ")
  assert message in str(error.value)


def test_bytes_that_are_not_utf8_name_the_line(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9"}\n')
  with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8"):
    read_problems(path)


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "problem": "p", "answer": "1"},
                                            {"id": "a", "problem": "q", "answer": "2"}])
  with pytest.raises(ValueError, match=r"d\.jsonl:2: id 'a' already used on line 1"):
    read_problems(path)
  empty = write_jsonl(tmp_path / "e.jsonl", [""])
  with pytest.raises(ValueError, match=r"e\.jsonl: no problems"):
    read_problems(empty)


def test_last_boxed_matches_braces():
  assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
  assert last_boxed("\\boxed{1} and \\fbox{2}") == "2"
  assert last_boxed("\\boxed{{x}^{2}}") == "{x}^{2}"
  assert last_boxed("\\boxed{1} \\boxed{2") == "1"  # an unclosed last box falls back
  assert last_boxed("no box") is None


# Hand-checked gold answers of the bundled files (worked out on paper from the questions).
GSM8K_STYLE_ANSWERS = ["12", "99", "21", "6", "270", "45", "85", "550", "1380", "40", "27", "-4"]
MATH_STYLE_ANSWERS = ["\\frac{3}{4}", "5\\sqrt{2}", "6", "2", "9", "5", "15", "720",
                      "\\frac{7}{12}", "(4, 3)", "6", "\\frac{1}{3}"]
MATH500_STYLE_ANSWERS = ["42", "10", "60", "24", "\\frac{13}{24}", "7"]


def test_bundled_files_read_to_the_hand_checked_answers():
  assert BUNDLED == ("gsm8k_style.jsonl", "math_style.jsonl", "math500_style.jsonl")
  gsm = read_problems(bundled_path("gsm8k_style.jsonl"))
  math = read_problems(bundled_path("math_style.jsonl"))
  math500 = read_problems(bundled_path("math500_style.jsonl"))
  assert [p.answer for p in gsm] == GSM8K_STYLE_ANSWERS
  assert [p.answer for p in math] == MATH_STYLE_ANSWERS
  assert [p.answer for p in math500] == MATH500_STYLE_ANSWERS
  for p in math500:  # the gold answer is the boxed one of the worked solution
    assert last_boxed(p.meta["solution"]) == p.answer and p.id.startswith("ours/")
  assert gsm[0].question.startswith("A baker makes 24 rolls")
  assert math[4].id == "ours/number_theory/divisors_36.json"
  assert gsm.name == "gsm8k_style"
  with pytest.raises(ValueError, match="must be one of"):
    bundled_path("gsm8k.jsonl")


def make_set(n, **kwargs):
  return ProblemSet([Problem(f"q{i}", str(i), f"p{i}") for i in range(n)], **kwargs)


def test_problem_for_seed_visits_each_problem_once_per_epoch():
  problems = make_set(7)
  for epoch in range(3):
    seen = [problems.problem_for_seed(epoch * 7 + i).id for i in range(7)]
    assert sorted(seen) == sorted(p.id for p in problems)
  first_epochs = [[problems.problem_for_seed(e * 7 + i).id for i in range(7)] for e in range(3)]
  assert len({tuple(order) for order in first_epochs}) > 1  # epochs are reshuffled


def test_problem_for_seed_is_deterministic_across_instances_and_call_order():
  a, b = make_set(50), make_set(50)
  seeds = [3, 4_000_000_000, 17, 3, 99, 4_000_000_000]
  forward = [a.problem_for_seed(s) for s in seeds]
  backward = [b.problem_for_seed(s) for s in reversed(seeds)][::-1]
  assert forward == backward
  assert forward[0] == forward[3] and forward[1] == forward[5]
  other_order = make_set(50, shuffle_seed=1)
  assert [other_order.problem_for_seed(s) for s in range(50)] != [a.problem_for_seed(s)
                                                                 for s in range(50)]


def test_unshuffled_order_and_seed_checks():
  problems = make_set(3, shuffle=False)
  assert [problems.problem_for_seed(s).id for s in range(5)] == ["p0", "p1", "p2", "p0", "p1"]
  for seed in (-1, 1.5, True, "3"):
    with pytest.raises(ValueError, match="must be a non-negative int"):
      problems.problem_for_seed(seed)
  with pytest.raises(ValueError, match="no problems"):
    ProblemSet([])
  assert len(problems) == 3 and problems[1].id == "p1" and list(problems)[2].id == "p2"

"""The tensorflow-datasets builder: JSONL -> array_record -> tfds.data_source -> the same
problems (no TensorFlow installed)."""

import importlib.util
import json

import pytest
import tensorflow_datasets as tfds

from marft_jax.envs.problems import bundled_path, read_problems
from marft_jax.envs.tfds_math import (MarftMathProblems, build_problems_dataset,
                                      problems_from_tfds)


def test_no_tensorflow_is_needed():
  assert importlib.util.find_spec("tensorflow") is None


def test_round_trip_of_the_bundled_files(tmp_path):
  gsm, math = bundled_path("gsm8k_style.jsonl"), bundled_path("math_style.jsonl")
  builder = build_problems_dataset({"train": [gsm, math], "test": math}, tmp_path)
  assert builder.info.splits["train"].num_examples == 24
  train = problems_from_tfds(tmp_path, "train")
  assert list(train) == list(read_problems(gsm)) + list(read_problems(math))
  assert list(problems_from_tfds(tmp_path, "test")) == list(read_problems(math))
  assert train[13].meta == {"solution": "$\\sqrt{50} = \\sqrt{25 \\cdot 2} = "
                                        "\\boxed{5\\sqrt{2}}$.", "level": "Level 2",
                            "type": "Algebra"}
  # The same records through the plain tfds API: random access, text as bytes.
  source = tfds.data_source("marft_math_problems", split="test", data_dir=str(tmp_path),
                            download=False)
  assert len(source) == 12
  record = source[4]
  assert record["id"] == b"ours/number_theory/divisors_36.json" and record["answer"] == b"9"
  assert json.loads(record["meta"]) == {"answer": "9", "level": 2, "subject": "Number Theory"}


def test_unicode_and_rebuild(tmp_path):
  path = tmp_path / "mine.jsonl"
  path.write_text(json.dumps({"question": "Zoë has 3 €2 coins. How many euros?",
                              "answer": "3 × 2 = 6\n#### 6"}) + "\n", encoding="utf-8")
  build_problems_dataset({"train": path}, tmp_path / "data")
  (problem,) = problems_from_tfds(tmp_path / "data", "train")
  assert problem == read_problems(path)[0] and problem.question.startswith("Zoë")
  path.write_text(json.dumps({"question": "Two?", "answer": "#### 2"}) + "\n")
  kept = build_problems_dataset({"train": path}, tmp_path / "data")  # existing build kept
  assert problems_from_tfds(tmp_path / "data", "train")[0].answer == "6"
  assert kept.info.splits["train"].num_examples == 1
  build_problems_dataset({"train": path}, tmp_path / "data", overwrite=True)
  assert problems_from_tfds(tmp_path / "data", "train")[0].answer == "2"


def test_a_malformed_line_fails_the_build_by_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
  with pytest.raises(ValueError, match=r"bad\.jsonl:2: GSM8K form"):
    build_problems_dataset({"train": path}, tmp_path / "data")


def test_building_needs_split_files(tmp_path):
  with pytest.raises(ValueError, match="pass split_files"):
    MarftMathProblems(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()

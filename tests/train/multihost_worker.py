"""`python -m launch.train`, recording which environments this process built, reset and stepped.

test_multihost.py runs it as each process of a job (and as the single-process reference):
the record, one JSON file per process in the folder $MARFT_ENV_RECORD, shows whether each
process played only its own block of the environments. It wraps `EnvBatch`, through which
the training loop makes, resets and steps every environment.
"""

import atexit
import json
import os

import jax

from launch import cli
from launch import train as launch_train
from marft_jax.envs import batch as batch_lib
from marft_jax.train.config import TrainConfig

RECORD = {"process": None, "processes": None, "built": [], "reset": [], "step": []}


def _record(kind: str, index: int) -> None:
  if RECORD["process"] is None:  # known once the job has started (not at exit: shut down)
    RECORD["process"], RECORD["processes"] = jax.process_index(), jax.process_count()
  RECORD[kind].append(int(index))


def _wrap() -> None:
  cls = batch_lib.EnvBatch
  init, reset, step = cls.__init__, cls.reset, cls.step

  def recording_init(self, make_env, *args, **kwargs):
    def make(i):
      _record("built", i)
      return make_env(i)
    init(self, make, *args, **kwargs)

  def recording_reset(self, index):
    _record("reset", index)
    return reset(self, index)

  def recording_step(self, index, actions):
    _record("step", index)
    return step(self, index, actions)

  cls.__init__, cls.reset, cls.step = recording_init, recording_reset, recording_step


def _save() -> None:
  folder = os.environ["MARFT_ENV_RECORD"]
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, f"process_{RECORD['process']}.json"), "w") as f:
    json.dump(RECORD, f)


if __name__ == "__main__":
  _wrap()
  atexit.register(_save)
  cli.run(launch_train.main, launch_train._CONFIG, TrainConfig)

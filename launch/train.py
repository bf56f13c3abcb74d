r"""Train a team of agents with MARFT (the main job).

  python -m launch.train --workdir=runs/default            # SmolLM2, reasoner → actor
  python -m launch.train --config=marft_t --workdir=runs/marft_t    # a shipped config
  python -m launch.train --workdir=runs/default --config.iterations=80   # extend a run

`marft-train` (installed with the package) is the same program, from any folder; --config
takes a shipped config's name (listed at the end of --help) or a config file.

The checkpoint already in --workdir always wins: the same command resumes where it stopped
(SIGTERM or Ctrl-C save first); a second launch into a workdir whose run is still going
fails at once, naming that run's process. Metrics go to <workdir>/metrics.jsonl and TensorBoard
(<workdir>/tensorboard), the learning curve to <workdir>/learning_curve.png, transcripts to
<workdir>/transcripts/, PEFT exports of every agent's adapter to <workdir>/exports/.

Several devices and hosts (docs/scaling.md): `--config.mesh.data=-1` uses every device;
`--config.mesh.fsdp` / `--config.mesh.tensor` split the base weights. For a multi-process job
run the same command in every process with `--distributed` (a Cloud TPU slice, SLURM or Open
MPI job is detected from its environment) or with the explicit flags:

  python -m launch.train --workdir=/shared/run --config.mesh.data=-1 \
      --coordinator_address=10.0.0.1:1234 --num_processes=2 --process_id=0
"""

from __future__ import annotations

import jax
from absl import flags

from launch import cli
from marft_jax import multihost, sharding
from marft_jax.rollout.rewards import load_reward_fn
from marft_jax.train import backbones, workdir_lock
from marft_jax.train.config import resolve as resolve_lib
from marft_jax.train.build import preflight
from marft_jax.train import run as run_lib
from marft_jax.train.build import team as team_lib
from marft_jax.train.checkpoint import (CheckpointMismatchError, UnreadableCheckpointError,
                                       saved_steps)
from marft_jax.train.config import TrainConfig
from marft_jax.train.loop import finished_run_metrics, train
from marft_jax.train.write_failures import WorkdirWriteError

_CONFIG = cli.define_config_flag("train.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "where checkpoints, metrics, "
                               "transcripts and exports go (resumed if it holds a checkpoint)")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "join a multi-process job (jax.distributed.initialize); the flags "
    "below default to what the cluster's environment says")
_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 0, "processes in the job (0: from the "
                                      "cluster's environment)", lower_bound=0)
_PROCESS_ID = flags.DEFINE_integer("process_id", -1, "this process's rank (-1: from the "
                                   "cluster's environment)", lower_bound=-1)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "virtual CPU devices in this process (a rehearsal of a cluster on one "
    "machine; 0: the platform's devices)", lower_bound=0)


def main(config: TrainConfig) -> None:
  if _CPU_DEVICES.value:  # before anything starts a backend
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  if _DISTRIBUTED.value or _COORDINATOR.value or _NUM_PROCESSES.value:
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  try:  # the mesh against the devices and the processes, before the model loads
    mesh = sharding.mesh_from_config(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    preflight.check_processes(config, tuple(mesh.shape.values()), jax.process_count())
  except ValueError as e:
    cli.fail(f"config.{e}")
  with cli.one_line_errors(OSError, ValueError):  # before the model: it can take minutes
    preflight.check_training_files(config, resuming=bool(saved_steps(_WORKDIR.value)))
    team_lib.build_team(config)  # a shipped team's edges and menu are checked only here
  try:  # imported once here, before the model; `train` would import it too
    reward_fn = load_reward_fn(config.reward.fn) if config.reward.fn else None
  except ValueError as e:
    cli.fail(f"config.{e}")
  cli.make_folder("--workdir", _WORKDIR.value)
  try:
    # Before the model loads: a workdir another run is using fails at once (`train` locks too).
    with workdir_lock.exclusive(_WORKDIR.value, multihost.is_primary(), multihost.any_process):
      metrics = finished_run_metrics(config, _WORKDIR.value)  # a finished run: no model
      if metrics is None:
        with cli.one_line_errors(OSError, ValueError):
          model = run_lib.load_models(config)  # {name: Model} for a split team
        metrics = train(config, _WORKDIR.value, model=model, reward_fn=reward_fn)
  except (CheckpointMismatchError, UnreadableCheckpointError,  # raised by the resume
          workdir_lock.WorkdirInUseError, WorkdirWriteError) as e:  # (a full disk)
    raise SystemExit(f"error: {e}") from None  # one line, exit status 1
  if multihost.is_primary():
    heldout = metrics.get("heldout/accuracy")
    print(f"iterations={config.iterations} reward={metrics.get('reward', float('nan')):.4f} "
          f"accuracy={metrics.get('accuracy', float('nan')):.4f}"
          + ("" if heldout is None else f" heldout_accuracy={heldout:.4f}")
          + f" workdir={_WORKDIR.value}")


def run() -> None:
  """The `marft-train` console script; `python -m launch.train` runs it too."""
  cli.run(main, _CONFIG, TrainConfig, resolve=resolve_lib.resolve)


if __name__ == "__main__":
  run()

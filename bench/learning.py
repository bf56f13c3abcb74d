r"""Does MARFT learn? The sweep of issue 12: untuned vs single-agent PPO vs MARFT-A vs MARFT-T vs
GRPO with SmolLM2-135M-Instruct on generated arithmetic word problems.

Arms (`ARMS`), each the shipped config named beside it plus the sweep's overrides (`SWEEP`):

  untuned_1agent   ppo.py, adapters off          untuned_2agent   train.py, adapters off
  ppo_1agent       ppo.py (one solver)           marft_a_2agent   train.py (reasoner → actor)
  marft_t_2agent   marft_t.py                    grpo_2agent      grpo.py

Every trained arm gets the same rollout budget: `iterations × episodes` episodes of at most
`reasoner_tokens + actor_tokens` generated tokens (the single solver gets both turns' tokens
in its one turn; GRPO's episodes are tasks × group_size). A cell (arm, seed) trains with
`launch.train`, stopping at each of `curve_points` for a held-out evaluation with
`launch.eval` (`curve_problems` problems), and ends with the full evaluation on
`eval_problems` held-out problems (the arithmetic test split, which training never produces).
Untuned cells are that full evaluation alone; seed k of every arm evaluates on the same
problems (the held-out seed is derived from `config.seed`).

Resume: workdirs live outside the repository (`--runs`, default /root/marft_runs/<arm>/seed<k>);
`launch.train` resumes from the checkpoint there, and a cell whose result file exists in
`--results` (default docs/results/<arm>/seed<k>/eval.json) is skipped. So rerunning the same
command continues a sweep that spans sessions. Only small files enter `--results`: the final
eval.json (plus the training wall time), metrics.jsonl and heldout.jsonl.

  python -m bench.learning --print_commands                 # every cell's exact commands
  python -m bench.learning --arms=marft_a_2agent --seeds=0  # run (or resume) cells
  python -m bench.learning --aggregate                      # docs/results.{md,json}, curves

`bench/learning_results.py` aggregates whatever cells have finished.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = "launch/configs"


@dataclasses.dataclass(frozen=True)
class Arm:
  config: str  # file in launch/configs/
  trained: bool
  agents: int


ARMS = {
    "untuned_1agent": Arm("ppo.py", False, 1),
    "untuned_2agent": Arm("train.py", False, 2),
    "ppo_1agent": Arm("ppo.py", True, 1),
    "marft_a_2agent": Arm("train.py", True, 2),
    "marft_t_2agent": Arm("marft_t.py", True, 2),
    "grpo_2agent": Arm("grpo.py", True, 2),
}
SEEDS = (0, 1, 2)

# The sweep's settings, chosen from the calibration and the timing in docs/results.md.
SWEEP = dict(
    level=1,  # arithmetic difficulty (marft_jax/envs/arithmetic.py)
    episodes=16,  # per iteration, every trained arm
    reasoner_tokens=48,  # the first turn's cap (2 agents); untuned replies average ~27
    actor_tokens=16,  # the graded turn's cap (2 agents); one agent gets the sum
    temperature=0.3,  # sampling in training; untuned team, 64 problems: 0.7 -> 6 %, 0.3 -> 19 %
    lora_rank=8,
    minibatches=4,  # optimizer steps per iteration; 32 rows at once took 19 GB (swapless OOM)
    iterations=32,
    checkpoint_every=2,
    eval_problems=300,  # the final held-out evaluation
    curve_problems=64,  # the held-out evaluations along the way
    curve_points=(16,),  # iterations at which training stops for a held-out evaluation
)


def overrides(arm: str, seed: int, sweep: dict = SWEEP) -> list[str]:
  """The `--config.*` flags of `arm`'s cells (training and evaluation alike)."""
  spec = ARMS[arm]
  flags = {"seed": seed, "task.level": sweep["level"], "rollout.num_envs": sweep["episodes"],
           "team.temperature": sweep["temperature"], "lora.rank": sweep["lora_rank"],
           "optimizer.minibatches": sweep["minibatches"],
           "iterations": sweep["iterations"],
           "checkpoint_every": sweep["checkpoint_every"],
           "task.eval_problems": sweep["eval_problems"],
           # held-out curves come from launch.eval at `curve_points`, not from the loop
           "eval_every": 0}
  if spec.agents == 1:
    flags["team.last_max_new_tokens"] = sweep["reasoner_tokens"] + sweep["actor_tokens"]
  else:
    flags["team.max_new_tokens"] = sweep["reasoner_tokens"]
    flags["team.last_max_new_tokens"] = sweep["actor_tokens"]
  return [f"--config.{key}={value}" for key, value in flags.items()]


def workdir(runs: str, arm: str, seed: int) -> str:
  return os.path.join(runs, arm, f"seed{seed}")


def train_command(arm: str, seed: int, runs: str, iterations: Optional[int] = None,
                  sweep: dict = SWEEP) -> list[str]:
  """`launch.train` for the cell, stopping after `iterations` (default: the sweep's)."""
  flags = overrides(arm, seed, sweep)
  if iterations is not None:
    flags = [f for f in flags if not f.startswith("--config.iterations=")]
    flags.append(f"--config.iterations={iterations}")
  return [sys.executable, "-m", "launch.train", f"--config={CONFIGS}/{ARMS[arm].config}",
          *flags, f"--workdir={workdir(runs, arm, seed)}"]


def eval_command(arm: str, seed: int, runs: str, problems: Optional[int] = None,
                 sweep: dict = SWEEP) -> list[str]:
  """`launch.eval` for the cell: its checkpoint, or the base for an untuned arm."""
  command = [sys.executable, "-m", "launch.eval", f"--config={CONFIGS}/{ARMS[arm].config}",
             *overrides(arm, seed, sweep), f"--workdir={workdir(runs, arm, seed)}"]
  if not ARMS[arm].trained:
    command.append("--untuned")
  if problems is not None:
    command.append(f"--problems={problems}")
  return command


def cell_commands(arm: str, seed: int, runs: str, sweep: dict = SWEEP) -> list[list[str]]:
  """Every command of a cell, in order (what `run_cell` runs when nothing is done yet)."""
  if not ARMS[arm].trained:
    return [eval_command(arm, seed, runs, sweep=sweep)]
  commands = []
  for stop in sweep["curve_points"]:
    commands += [train_command(arm, seed, runs, stop, sweep),
                 eval_command(arm, seed, runs, sweep["curve_problems"], sweep)]
  return commands + [train_command(arm, seed, runs, sweep=sweep),
                     eval_command(arm, seed, runs, sweep=sweep)]


def shell(command: Sequence[str]) -> str:
  """The command as one would type it in the repository root."""
  return " ".join(shlex.quote("python" if i == 0 else c) for i, c in enumerate(command))


# --- running a cell ----------------------------------------------------------------------------


def _run(command: list[str], log_path: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {shell(command)}", flush=True)
  with open(log_path, "a", encoding="utf-8") as log:
    log.write(f"\n$ {shell(command)}\n")
    log.flush()
    code = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  if code:
    raise SystemExit(f"error: exit status {code}: {shell(command)} (log: {log_path})")


def _eval_json(work: str, arm: str) -> dict:
  name = "eval.json" if ARMS[arm].trained else "eval_untuned.json"
  with open(os.path.join(work, name), encoding="utf-8") as f:
    return json.load(f)


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file (none when it does not exist yet; a torn last line skipped)."""
  from marft_jax.train.metrics import read_metrics
  return read_metrics(path) if os.path.exists(path) else []


def _training_seconds(metrics_path: str) -> float:
  """Wall time of the training iterations (rollout + update, compile included)."""
  return sum(r.get("time/iteration_s", 0.0) for r in read_jsonl(metrics_path))


def run_cell(arm: str, seed: int, runs: str, results: str, sweep: dict = SWEEP) -> None:
  """Runs (or resumes, or skips when its eval.json is in `results`) one cell."""
  out = os.path.join(results, arm, f"seed{seed}")
  if os.path.exists(os.path.join(out, "eval.json")):
    print(f"{arm} seed {seed}: done ({out}/eval.json)", flush=True)
    return
  work = workdir(runs, arm, seed)
  os.makedirs(work, exist_ok=True)
  os.makedirs(out, exist_ok=True)
  log = os.path.join(work, "driver.log")
  start = time.time()
  curve_path = os.path.join(out, "heldout.jsonl")
  if ARMS[arm].trained:
    for stop in sweep["curve_points"]:
      if any(r["iteration"] >= stop for r in read_jsonl(curve_path)):
        continue
      _run(train_command(arm, seed, runs, stop, sweep), log)
      _run(eval_command(arm, seed, runs, sweep["curve_problems"], sweep), log)
      result = _eval_json(work, arm)
      with open(curve_path, "a", encoding="utf-8") as f:  # the step evaluated (a resumed
        # run that is already past `stop` evaluates where it is)
        f.write(json.dumps({"iteration": result["checkpoint_step"], "accuracy": result["accuracy"],
                            "problems": result["episodes"]}) + "\n")
    _run(train_command(arm, seed, runs, sweep=sweep), log)
  _run(eval_command(arm, seed, runs, sweep=sweep), log)
  result = _eval_json(work, arm)
  result["driver_wall_s"] = time.time() - start  # this session's share (a resume: less)
  if ARMS[arm].trained:
    metrics = os.path.join(work, "metrics.jsonl")
    shutil.copyfile(metrics, os.path.join(out, "metrics.jsonl"))
    result["train_wall_s"] = _training_seconds(metrics)
    result["iterations"] = sweep["iterations"]
    with open(curve_path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"iteration": sweep["iterations"], "accuracy": result["accuracy"],
                          "problems": result["episodes"]}) + "\n")
  result["commands"] = [shell(c) for c in cell_commands(arm, seed, runs, sweep)]
  with open(os.path.join(out, "eval.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"{arm} seed {seed}: accuracy={result['accuracy']:.4f} ({out}/eval.json)", flush=True)


def main(argv: Sequence[str]) -> None:
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms")
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
  parser.add_argument("--runs", default="/root/marft_runs", help="workdirs (checkpoints)")
  parser.add_argument("--results", default=os.path.join(ROOT, "docs", "results"))
  parser.add_argument("--print_commands", action="store_true", help="print, run nothing")
  parser.add_argument("--aggregate", action="store_true",
                      help="write docs/results.md, docs/results.json and the curves")
  args = parser.parse_args(argv)
  arms = [a for a in args.arms.split(",") if a]
  unknown = [a for a in arms if a not in ARMS]
  if unknown:
    parser.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
  seeds = [int(s) for s in args.seeds.split(",") if s]
  if args.aggregate:
    from bench import learning_results
    learning_results.write_all(args.results, os.path.join(ROOT, "docs"), args.runs)
    return
  for arm in arms:
    for seed in seeds:
      if args.print_commands:
        print(f"# {arm} seed {seed}")
        print("\n".join(shell(c) for c in cell_commands(arm, seed, args.runs)))
      else:
        run_cell(arm, seed, args.runs, args.results)


if __name__ == "__main__":
  main(sys.argv[1:])

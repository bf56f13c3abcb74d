r"""The learning sweeps: cells (arm, seed) of `launch.train` runs and `launch.eval` scores,
resumable across sessions, aggregated by `bench/learning_results.py`.

Two sweeps, SmolLM2-135M-Instruct on CPU:

* issue 12, "does MARFT learn?" (`ARMS`, `SWEEP`): untuned vs single-agent PPO vs MARFT-A vs
  MARFT-T vs GRPO on generated arithmetic (level 1). Arm keys: `untuned_1agent`, ...
* issue 57, "where roles matter" (`TEAM_ARMS`, `TEAM_SWEEP`): on each team task
  (split_facts, verify_correct, grid_path, `envs/team_tasks.py`) the arms `TEAM_ARM_NAMES`,
  arm keys `<task>/<arm>`:

    untuned_team     the task's team (launch/configs/<task>.py), adapters off
    ppo_single       one agent with full information, PPO (<task>_single.py)
    twice_single     one agent answering twice, its own checker, one adapter (<task>_twice.py)
    shared_team      the team, one adapter for both roles (team.shared_adapter)
    marft_a_team     the team, an adapter per role (MARFT-A)
    anonymous_team   marft_a_team with neutral names and no system prompts (team.anonymous)
    grpo_team        the team trained with GRPO (group_size rollouts of each problem)
    majority_single  the untuned single agent, majority vote over `group_size` samples

  and, once marft_a_team and ppo_single have finished, the ablations (`ABLATIONS`):

    swapped_team     marft_a_team's checkpoint with its two role adapters swapped
    alone_<role>     that role's trained adapter alone, in ppo_single's single-agent setting

Equal generated tokens, not equal episodes: every trained arm of a task plays
`episodes` episodes an iteration whose turns may generate `tokens[task]` = (first, last)
tokens in a team of two (the single agent: first + last in its one turn), so each spends
episodes × (first + last) tokens an iteration at most (`token_budget`, printed by
`--budget` and before every cell). GRPO's episodes are problems × group_size. The majority
vote spends group_size × (first + last) tokens a problem at evaluation instead.

A cell trains with `launch.train`, stops at each of `curve_points` for a held-out evaluation
of `curve_problems` problems, and ends with `eval_problems` held-out problems. Seed k of
every arm of a sweep scores the same held-out problems (the evaluation's seed comes from
`config.seed` and every arm plays them in calls of the same size; the majority vote's calls
hold its samples of as many problems), so arms are compared by paired differences per seed.
Each cell keeps, beside its eval.json, problems.json (each problem's 0/1 score by its seed),
for a team of two analysis.json (`role_analysis`: how often the last role overrules the
first, and whether it is right), and on grid_path choice.json (`candidate_choice`: how often
the graded path copies a listed candidate, and which). `--reanalyse` rewrites those two from
the transcripts in the finished cells' workdirs.

Resume: workdirs live outside the repository (`--runs`, default /root/marft_runs/<key>/seed<k>);
`launch.train` resumes from the checkpoint there, and a cell whose eval.json exists in
`--results` (default docs/results/<key>/seed<k>/) is skipped. A running cell's files (its
curve points too) stay in its workdir; `--results` gets them when the cell has finished.
Rerunning the same command continues a sweep that spans sessions. Only small files enter
`--results`.

  python -m bench.learning --sweep=team --budget                  # the token budget per arm
  python -m bench.learning --sweep=team --print_commands           # every cell's commands
  python -m bench.learning --sweep=team --tasks=grid_path --arms=untuned_team,ppo_single \
      --seeds=0                                                    # run (or resume) cells
  python -m bench.learning --sweep=team --aggregate                # docs/results/team.json
  python -m bench.learning --aggregate                             # issue 12's tables
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional, Sequence

from bench import learning_results
from marft_jax.envs import grid_path, team_tasks
from marft_jax.jsonl import iter_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = "launch/configs"


@dataclasses.dataclass(frozen=True)
class Arm:
  config: str  # file in launch/configs/
  trained: bool
  agents: int
  flags: tuple[tuple[str, object], ...] = ()  # its own --config.* overrides
  samples: int = 1  # evaluation replies per problem: > 1, a majority vote at the temperature
  ablation: str = ""  # "swapped" or "alone:<role>": an evaluation of marft_a_team's adapters


# --- issue 12: arithmetic --------------------------------------------------------------------

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

# --- issue 57: the team tasks ----------------------------------------------------------------

TASKS = ("split_facts", "verify_correct", "grid_path")
TEAM_SWEEP = dict(
    episodes=16,  # per iteration, every trained arm (GRPO: 4 problems x group_size)
    # (first, last) turn caps of a team of two; the single agent's one turn gets the sum
    # (split_facts' answerer and grid_path's executor have 32 of their own: docs/team_tasks.md)
    tokens={"split_facts": (48, 32), "verify_correct": (48, 16), "grid_path": (48, 32)},
    group_size=4,  # GRPO's rollouts of each problem, and the majority vote's samples
    temperature=0.3,  # sampling in training and the majority vote's samples
    lora_rank=8,
    minibatches=4,
    # 16 iterations so that a cell (training, two evaluations) fits in ~45 min on 2 shared
    # CPU cores; issue 12's arms gained most of their held-out accuracy by iteration 16
    iterations=16,
    checkpoint_every=2,
    eval_problems=100,
    eval_batch=40,  # episodes per sampler call (majority vote: its samples of as many problems)
    curve_problems=40,
    curve_points=(8,),
)
TEAM_ARM_NAMES = ("untuned_team", "ppo_single", "twice_single", "shared_team", "marft_a_team",
                  "anonymous_team", "grpo_team", "majority_single")
# The team's roles in order, as launch/configs/<task>.py declares them (the ablations' names).
TEAM_ROLES = {"split_facts": ("reporter", "answerer"), "verify_correct": ("solver", "checker"),
              "grid_path": ("planner", "executor")}


def _team_arms(task: str) -> dict[str, Arm]:
  team, single, twice = f"{task}.py", f"{task}_single.py", f"{task}_twice.py"
  return {
      "untuned_team": Arm(team, False, 2),
      "ppo_single": Arm(single, True, 1),
      "twice_single": Arm(twice, True, 2),
      "shared_team": Arm(team, True, 2, (("team.shared_adapter", True),)),
      "marft_a_team": Arm(team, True, 2),
      "anonymous_team": Arm(team, True, 2, (("team.anonymous", True),)),
      "grpo_team": Arm(team, True, 2, (("algorithm", "grpo"),)),
      "majority_single": Arm(single, False, 1, samples=TEAM_SWEEP["group_size"]),
  }


def _ablations(task: str) -> dict[str, Arm]:
  out = {"swapped_team": Arm(f"{task}.py", False, 2, ablation="swapped")}
  for role in TEAM_ROLES[task]:
    out[f"alone_{role}"] = Arm(f"{task}_single.py", False, 1, ablation=f"alone:{role}")
  return out


TEAM_ARMS = {f"{t}/{a}": spec for t in TASKS for a, spec in _team_arms(t).items()}
ABLATIONS = {f"{t}/{a}": spec for t in TASKS for a, spec in _ablations(t).items()}
SWEEPS = {"arithmetic": ARMS, "team": {**TEAM_ARMS, **ABLATIONS}}


def spec_of(key: str) -> Arm:
  return {**ARMS, **TEAM_ARMS, **ABLATIONS}[key]


def task_of(key: str) -> Optional[str]:
  """The team task of a team-sweep key ("grid_path/ppo_single" -> "grid_path"), else None."""
  return key.split("/", 1)[0] if "/" in key else None


def turn_caps(key: str) -> tuple[int, ...]:
  """The generated-token cap of each turn of one episode of arm `key`."""
  task, spec = task_of(key), spec_of(key)
  first, last = TEAM_SWEEP["tokens"][task] if task else (SWEEP["reasoner_tokens"],
                                                           SWEEP["actor_tokens"])
  return (first + last,) if spec.agents == 1 else (first, last)


def token_budget(key: str) -> int:
  """Generated tokens at most: per training iteration (a trained arm: episodes × the turns'
  caps), or per held-out problem (an evaluated arm: samples × the caps)."""
  spec = spec_of(key)
  episodes = (TEAM_SWEEP if task_of(key) else SWEEP)["episodes"]
  return (episodes if spec.trained else spec.samples) * sum(turn_caps(key))


def budget_lines(keys: Sequence[str]) -> list[str]:
  lines = []
  for key in keys:
    spec, caps = spec_of(key), turn_caps(key)
    what = "an iteration" if spec.trained else "a held-out problem"
    times = (TEAM_SWEEP if task_of(key) else SWEEP)["episodes"] if spec.trained else spec.samples
    lines.append(f"{key}: {token_budget(key)} generated tokens {what} at most "
                 f"({times} x turns {' + '.join(map(str, caps))})")
  return lines


# --- commands ----------------------------------------------------------------------------------


def overrides(key: str, seed: int, sweep: Optional[dict] = None) -> list[str]:
  """The `--config.*` flags of `key`'s cells (training and evaluation alike)."""
  spec, task = spec_of(key), task_of(key)
  s = sweep or (TEAM_SWEEP if task else SWEEP)
  flags = {"seed": seed, "rollout.num_envs": s["episodes"], "team.temperature": s["temperature"],
           "lora.rank": s["lora_rank"], "optimizer.minibatches": s["minibatches"],
           "iterations": s["iterations"], "checkpoint_every": s["checkpoint_every"],
           "task.eval_problems": s["eval_problems"],
           # held-out curves come from launch.eval at `curve_points`, not from the loop
           "eval_every": 0}
  if not task:
    flags["task.level"] = s["level"]
  caps = turn_caps(key)
  if len(caps) == 1:
    flags["team.last_max_new_tokens"] = caps[0]
  else:
    flags["team.max_new_tokens"], flags["team.last_max_new_tokens"] = caps
  flags.update(spec.flags)
  return [f"--config.{k}={v}" for k, v in flags.items()]


def workdir(runs: str, key: str, seed: int) -> str:
  return os.path.join(runs, key, f"seed{seed}")


def train_command(key: str, seed: int, runs: str, iterations: Optional[int] = None,
                  sweep: Optional[dict] = None) -> list[str]:
  """`launch.train` for the cell, stopping after `iterations` (default: the sweep's)."""
  flags = overrides(key, seed, sweep)
  if iterations is not None:
    flags = [f for f in flags if not f.startswith("--config.iterations=")]
    flags.append(f"--config.iterations={iterations}")
  return [sys.executable, "-m", "launch.train", f"--config={CONFIGS}/{spec_of(key).config}",
          *flags, f"--workdir={workdir(runs, key, seed)}"]


def _problems_per_call(problems: int, most: int) -> int:
  """As `launch.eval` spreads `problems` over its fewest calls of at most `most`."""
  calls = -(-problems // most)
  return -(-problems // calls)


def eval_command(key: str, seed: int, runs: str, problems: Optional[int] = None,
                 sweep: Optional[dict] = None) -> list[str]:
  """`launch.eval` for the cell: its checkpoint, or the base for an untuned arm."""
  spec, task = spec_of(key), task_of(key)
  command = [sys.executable, "-m", "launch.eval", f"--config={CONFIGS}/{spec.config}",
             *overrides(key, seed, sweep), f"--workdir={workdir(runs, key, seed)}"]
  if not spec.trained:
    command.append("--untuned")
  if problems is not None:
    command.append(f"--problems={problems}")
  if task:
    s = sweep or TEAM_SWEEP
    batch = s["eval_batch"]
    if spec.samples > 1:  # as many problems a call as the greedy arms: the same problems
      per_call = _problems_per_call(problems or s["eval_problems"], batch)
      batch = spec.samples * per_call
      command += [f"--samples_per_problem={spec.samples}", f"--temperature={s['temperature']}"]
    command.append(f"--eval_batch={batch}")
  return command


def ablation_command(key: str, seed: int, runs: str) -> list[str]:
  """The ablation's evaluation of marft_a_team's (and ppo_single's) runs of the seed."""
  return [sys.executable, "-m", "bench.learning_ablations", key, str(seed), runs]


def cell_commands(key: str, seed: int, runs: str, sweep: Optional[dict] = None
                  ) -> list[list[str]]:
  """Every command of a cell, in order (what `run_cell` runs when nothing is done yet)."""
  spec = spec_of(key)
  if spec.ablation:
    return [ablation_command(key, seed, runs)]
  if not spec.trained:
    return [eval_command(key, seed, runs, sweep=sweep)]
  s = sweep or (TEAM_SWEEP if task_of(key) else SWEEP)
  commands = []
  for stop in s["curve_points"]:
    commands += [train_command(key, seed, runs, stop, sweep),
                 eval_command(key, seed, runs, s["curve_problems"], sweep)]
  return commands + [train_command(key, seed, runs, sweep=sweep),
                     eval_command(key, seed, runs, sweep=sweep)]


def shell(command: Sequence[str]) -> str:
  """The command as one would type it in the repository root."""
  return " ".join(shlex.quote("python" if i == 0 else c) for i, c in enumerate(command))


# --- per-role analysis of a team's transcripts -------------------------------------------------


def first_answer(task: str, reply: str, problem) -> tuple[Optional[str], bool]:
  """(the first role's answer, read as the task grades its last role, or None; whether it is
  right): the solver's result, the planner's path; split_facts' reporter gives no answer,
  its relay is right when every count of the facts is in its reply."""
  if task == "split_facts":
    counts = [w for w in problem.meta["facts"].replace(".", " ").split() if w.isdigit()]
    said = reply.replace(".", " ").split()
    return None, all(c in said for c in counts)
  if task == "grid_path":
    moves, _ = grid_path.read_path(reply)
    if moves is None:  # a planner that writes the letters without the form
      letters = "".join(w for w in reply.replace(",", " ").split() if w in grid_path.MOVES)
      moves = letters or None
    return moves, moves is not None and grid_path.follow(problem.meta["rows"], moves)
  value, _ = team_tasks.read_integer(reply)
  return (None if value is None else str(value)), value is not None and \
      value == int(problem.answer)


def graded_answer(episode: dict) -> tuple[Optional[str], bool]:
  """(the graded role's answer as its task read it, or None; whether it is right) at the
  episode's end; (None, False) for a dropped episode or one that ended without a grade."""
  info = episode["infos"][-1] if episode["infos"] and not episode.get("dropped") else {}
  role = next(iter(info.get("correct", {})), None)
  return (info["prediction"][role], bool(info["correct"][role])) if role else (None, False)


def role_analysis(task: str, episodes: Sequence[dict]) -> dict:
  """Who fixes what, over a team of two's held-out transcripts (greedy: one per problem):
  the first role right, the last right; the last role overruling the first (a different
  answer) and being right ("fixes"), overruling a right first answer ("breaks"), and
  keeping it (the same answer). split_facts: the reporter's relay right (every count)."""
  source = team_tasks.problems(task, "test")
  counts = collections.Counter()
  for e in episodes:
    if e.get("dropped") or len(e["turns"]) < 2:
      continue
    problem = source.problem_for_seed(int(e["seed"]))
    first, first_right = first_answer(task, e["turns"][0]["reply"], problem)
    last, last_right = graded_answer(e)
    counts["episodes"] += 1
    counts["first_right"] += first_right
    counts["last_right"] += last_right
    if task != "split_facts":
      overrule = last is not None and last != first
      counts["overrules"] += overrule
      counts["fixes"] += overrule and last_right and not first_right
      counts["breaks"] += overrule and first_right and not last_right
      counts["keeps"] += last is not None and last == first
    else:
      counts["right_without_relay"] += last_right and not first_right
  n = max(counts["episodes"], 1)
  return {"episodes": counts["episodes"],
          **{f"{k}_rate": counts[k] / n for k in counts if k != "episodes"}}


def candidate_choice(task: str, episodes: Sequence[dict]) -> Optional[dict]:
  """Where the graded path comes from, over a grid_path cell's greedy held-out transcripts
  (None for another task, or a grid with no candidates listed): one of the task's listed
  candidates, by its place in the list, another path or no path; and how often a copied
  candidate is the right one (a pick that ignores the grid is right 1 in `CANDIDATES`)."""
  if task != "grid_path":
    return None
  source = team_tasks.problems(task, "test")
  counts = collections.Counter()
  for e in episodes:
    if e.get("dropped"):
      continue
    listed = source.problem_for_seed(int(e["seed"])).meta["candidates"]
    if not listed:
      return None
    path, right = graded_answer(e)
    counts["episodes"] += 1
    if path in listed:
      counts["candidate"] += 1
      counts[f"place_{listed.index(path) + 1}"] += 1
      counts["candidate_right"] += right
    else:
      counts["other_path" if path else "no_path"] += 1
  n = max(counts["episodes"], 1)
  return {"episodes": counts["episodes"], "candidates": len(listed),
          **{f"{k}_rate": counts[k] / n for k in
             ("candidate", *(f"place_{i + 1}" for i in range(len(listed))), "other_path",
              "no_path")},
          "right_when_candidate": counts["candidate_right"] / max(counts["candidate"], 1)}


def problem_scores(episodes: Sequence[dict], samples: int) -> dict[str, float]:
  """{problem seed: 0/1}: each problem's greedy score, or with samples > 1 its majority
  vote's (the most common graded answer, ties to the one drawn first; no answer no vote)."""
  by_seed: dict[str, list] = {}
  for e in episodes:
    by_seed.setdefault(str(e["seed"]), []).append(graded_answer(e))
  out = {}
  for seed, group in by_seed.items():
    if samples == 1:
      out[seed] = float(group[0][1])
      continue
    votes = collections.Counter(p for p, _ in group if p is not None)
    if not votes:
      out[seed] = 0.0
      continue
    top = max(votes.values())
    winner = next(p for p, _ in group if votes.get(p) == top)
    out[seed] = float(next(c for p, c in group if p == winner))
  return out


# --- running a cell ----------------------------------------------------------------------------


def _run(command: list[str], log_path: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {shell(command)}", flush=True)
  with open(log_path, "a", encoding="utf-8") as log:
    log.write(f"\n$ {shell(command)}\n")
    log.flush()
    code = subprocess.call(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  if code:
    raise SystemExit(f"error: exit status {code}: {shell(command)} (log: {log_path})")


def _result_stem(key: str) -> str:
  spec, s = spec_of(key), TEAM_SWEEP
  if spec.samples > 1:
    return f"eval_untuned_n{spec.samples}_t{s['temperature']:g}"
  return "eval" if spec.trained or spec.ablation else "eval_untuned"


def _eval_json(work: str, key: str) -> dict:
  with open(os.path.join(work, f"{_result_stem(key)}.json"), encoding="utf-8") as f:
    return json.load(f)


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file (none when it does not exist yet; a torn last line skipped)."""
  return list(iter_records(path)) if os.path.exists(path) else []


def _training_seconds(metrics_path: str) -> float:
  """Wall time of the training iterations (rollout + update, compile included)."""
  return sum(r.get("time/iteration_s", 0.0) for r in read_jsonl(metrics_path))


def run_cell(key: str, seed: int, runs: str, results: str, sweep: Optional[dict] = None) -> None:
  """Runs (or resumes, or skips when its eval.json is in `results`) one cell."""
  spec, task = spec_of(key), task_of(key)
  s = sweep or (TEAM_SWEEP if task else SWEEP)
  out = os.path.join(results, key, f"seed{seed}")
  if os.path.exists(os.path.join(out, "eval.json")):
    print(f"{key} seed {seed}: done ({out}/eval.json)", flush=True)
    return
  if task:
    print("budget: " + budget_lines([key])[0], flush=True)
  work = workdir(runs, key, seed)
  os.makedirs(work, exist_ok=True)
  log = os.path.join(work, "driver.log")
  start = time.time()
  # A running cell's curve points stay in its workdir, so that `results` (the repository)
  # holds finished cells only; a cell begun before they moved there brings its points along.
  curve_path = os.path.join(work, "heldout.jsonl")
  if os.path.exists(os.path.join(out, "heldout.jsonl")) and not os.path.exists(curve_path):
    shutil.move(os.path.join(out, "heldout.jsonl"), curve_path)
  if spec.trained:
    for stop in s["curve_points"]:
      if any(r["iteration"] >= stop for r in read_jsonl(curve_path)):
        continue
      _run(train_command(key, seed, runs, stop, sweep), log)
      _run(eval_command(key, seed, runs, s["curve_problems"], sweep), log)
      result = _eval_json(work, key)
      with open(curve_path, "a", encoding="utf-8") as f:  # the step evaluated (a resumed
        # run that is already past `stop` evaluates where it is)
        f.write(json.dumps({"iteration": result["checkpoint_step"], "accuracy": result["accuracy"],
                            "problems": result["episodes"]}) + "\n")
    _run(train_command(key, seed, runs, sweep=sweep), log)
  _run(cell_commands(key, seed, runs, sweep)[-1], log)
  result = _eval_json(work, key)
  result["driver_wall_s"] = time.time() - start  # this session's share (a resume: less)
  os.makedirs(out, exist_ok=True)
  if spec.trained:
    metrics = os.path.join(work, "metrics.jsonl")
    shutil.copyfile(metrics, os.path.join(out, "metrics.jsonl"))
    result["train_wall_s"] = _training_seconds(metrics)
    result["iterations"] = s["iterations"]
    with open(curve_path, "a", encoding="utf-8") as f:
      f.write(json.dumps({"iteration": s["iterations"], "accuracy": result["accuracy"],
                          "problems": result["episodes"]}) + "\n")
    shutil.copyfile(curve_path, os.path.join(out, "heldout.jsonl"))
  if task:
    _write_task_files(key, work, out, result)
  result["commands"] = [shell(c) for c in cell_commands(key, seed, runs, sweep)]
  with open(os.path.join(out, "eval.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"{key} seed {seed}: accuracy={result['accuracy']:.4f} ({out}/eval.json)", flush=True)


def _write_task_files(key: str, work: str, out: str, result: dict) -> None:
  """problems.json (each problem's score) and, for a team of two, analysis.json; the
  token budget into `result`."""
  spec = spec_of(key)
  episodes = read_jsonl(os.path.join(work, f"{_result_stem(key)}_transcripts.jsonl"))
  scores = problem_scores(episodes, spec.samples)
  result["accuracy"] = float(sum(scores.values()) / len(scores))  # maj@n for a vote
  result["token_budget"] = token_budget(key)
  with open(os.path.join(out, "problems.json"), "w", encoding="utf-8") as f:
    json.dump(scores, f, sort_keys=True)
  write_analyses(key, episodes, out)


def write_analyses(key: str, episodes: Sequence[dict], out: str) -> list[str]:
  """A greedy cell's analyses of its held-out transcripts: analysis.json (`role_analysis`)
  for a team of two, choice.json (`candidate_choice`) on grid_path. Returns the files
  written."""
  spec, task = spec_of(key), task_of(key)
  if spec.samples != 1:
    return []
  analyses = {"analysis": role_analysis(task, episodes) if spec.agents == 2 else None,
              "choice": candidate_choice(task, episodes)}
  written = [name for name, analysis in analyses.items() if analysis is not None]
  for name in written:
    with open(os.path.join(out, f"{name}.json"), "w", encoding="utf-8") as f:
      json.dump(analyses[name], f, indent=2)
  return written


def reanalyse(keys: Sequence[str], seeds: Sequence[int], runs: str, results: str) -> list[str]:
  """Rewrites the analyses (`write_analyses`) of the finished cells whose workdir still holds
  their held-out transcripts, so that an analysis added later covers cells run before it;
  their scores and eval.json are left as they are. Returns the cells rewritten."""
  done = []
  for key in keys:
    for seed in seeds:
      out = os.path.join(results, key, f"seed{seed}")
      path = os.path.join(workdir(runs, key, seed), f"{_result_stem(key)}_transcripts.jsonl")
      if task_of(key) and os.path.exists(os.path.join(out, "eval.json")) and \
          os.path.exists(path) and write_analyses(key, read_jsonl(path), out):
        done.append(f"{key} seed {seed}")
  return done


def cells(sweep: str, arms: Sequence[str], tasks: Sequence[str]) -> list[str]:
  """The arm keys to run, in order: every task's arms for the team sweep."""
  if sweep == "arithmetic":
    return list(arms)
  return [f"{t}/{a}" for t in tasks for a in arms]


def main(argv: Sequence[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sweep", default="arithmetic", choices=tuple(SWEEPS),
                      help="which sweep: the arithmetic arms, or the team tasks' arms")
  parser.add_argument("--arms", default="", help="comma-separated arms (default: all)")
  parser.add_argument("--tasks", default=",".join(TASKS), help="team sweep: its tasks")
  parser.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                      help="comma-separated seeds; seed k of every arm scores the same "
                           "held-out problems")
  parser.add_argument("--runs", default="/root/marft_runs", help="workdirs (checkpoints)")
  parser.add_argument("--results", default=os.path.join(ROOT, "docs", "results"),
                      help="where finished cells' results go (a cell with eval.json is skipped)")
  parser.add_argument("--print_commands", action="store_true", help="print, run nothing")
  parser.add_argument("--budget", action="store_true", help="print each arm's token budget")
  parser.add_argument("--aggregate", action="store_true", help="write the results files")
  parser.add_argument("--reanalyse", action="store_true",
                      help="team sweep: rewrite finished cells' transcript analyses from "
                           "their workdirs' transcripts (those that still have them)")
  args = parser.parse_args(argv)
  names = list(ARMS) if args.sweep == "arithmetic" else sorted(
      {k.split("/", 1)[1] for k in SWEEPS["team"]})
  arms = [a for a in args.arms.split(",") if a] or (
      list(ARMS) if args.sweep == "arithmetic" else list(TEAM_ARM_NAMES))
  tasks = [t for t in args.tasks.split(",") if t]
  bad = sorted(set(arms) - set(names)) + sorted(set(tasks) - set(TASKS))
  if bad:
    parser.error(f"unknown arms or tasks {bad}; arms: {names}, tasks: {list(TASKS)}")
  seeds = [int(s) for s in args.seeds.split(",") if s]
  keys = [k for k in cells(args.sweep, arms, tasks) if k in SWEEPS[args.sweep]]
  if args.aggregate:
    if args.sweep == "arithmetic":
      learning_results.write_all(args.results, os.path.join(ROOT, "docs"), ARMS, {
          a: [shell(c) for c in cell_commands(a, 0, args.runs)] for a in ARMS})
    else:
      learning_results.write_team(args.results, os.path.join(ROOT, "docs"), TASKS,
                                  TEAM_ARM_NAMES, {t: list(_ablations(t)) for t in TASKS},
                                  readme=os.path.join(ROOT, "README.md"))
    return
  if args.budget:
    print("\n".join(budget_lines(keys)))
    return
  if args.reanalyse:
    done = reanalyse(keys, seeds, args.runs, args.results)
    print("\n".join(f"reanalysed {cell}" for cell in done) or "no finished cell with its "
          f"transcripts under {args.runs}")
    return
  for key in keys:
    for seed in seeds:
      if args.print_commands:
        print(f"# {key} seed {seed}")
        print("\n".join(shell(c) for c in cell_commands(key, seed, args.runs)))
      else:
        run_cell(key, seed, args.runs, args.results)


if __name__ == "__main__":
  main(sys.argv[1:])

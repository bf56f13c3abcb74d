"""The team sweep's ablations (`bench/learning.py`'s `ABLATIONS`): a trained MARFT-A team's
adapters evaluated where they were not trained, through the public `marft_jax.restore`.

  swapped_team   the team's checkpoint with its two role adapters swapped (the first role
                 speaks with the last role's adapter and the other way round)
  alone_<role>   that role's adapter alone in the single-agent setting: the ppo_single
                 cell's run of the same seed (its config, prompt and full information), its
                 adapter replaced by the role's (the same rank and targets: one sweep)

Each writes what `launch.eval` writes for a trained arm, eval.json (accuracy, the graded
role's answer-format rate, the checkpoint step) and eval_transcripts.jsonl, into the cell's
workdir; `bench.learning` then copies the small files into docs/results. The held-out
problems are the sweep's (the same seed, `--eval_batch` and count as the other arms).

  python -m bench.learning_ablations grid_path/swapped_team 0 /root/marft_runs
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import numpy as np

import marft_jax
from bench import learning
from marft_jax.rollout import write_transcripts


def with_adapters(run, layers):
  """`run` (a `marft_jax.restore` result) playing with the LoRA factors `layers` instead."""
  return dataclasses.replace(run, policy=dataclasses.replace(run.policy, layers=layers))


def swapped(layers):
  """The two adapters of every target's factors ([L, A, ...], A = 2) in the other order."""
  return jax.tree.map(lambda x: x[:, ::-1], layers)


def only(layers, adapter: int):
  """Adapter `adapter` of every target's factors alone ([L, 1, ...])."""
  return jax.tree.map(lambda x: x[:, adapter:adapter + 1], layers)


def summary(episodes, graded: str, step: int) -> dict:
  """eval.json's fields of the greedy `episodes` (one per problem)."""
  finals = [e.infos[-1] if e.infos and e.dropped is None else {} for e in episodes]
  correct = [bool(f.get("correct", {}).get(graded)) for f in finals]
  formatted = [f.get("metrics", {}).get("formatted_answer", 0.0) for f in finals]
  return {"episodes": len(episodes), "accuracy": float(np.mean(correct)),
          f"accuracy/{graded}": float(np.mean(correct)),
          f"answer_format_rate/{graded}": float(np.mean(formatted)),
          "checkpoint_step": step, "decoding": "greedy"}


def evaluate_cell(key: str, seed: int, runs: str) -> dict:
  """Plays ablation `key` on seed `seed`'s held-out problems; writes its eval files."""
  task, spec = learning.task_of(key), learning.spec_of(key)
  s = learning.TEAM_SWEEP
  team = marft_jax.restore(learning.workdir(runs, f"{task}/marft_a_team", seed))
  if spec.ablation == "swapped":
    run = with_adapters(team, swapped(team.policy.layers))
  else:
    role = spec.ablation.split(":", 1)[1]
    single = marft_jax.restore(learning.workdir(runs, f"{task}/ppo_single", seed))
    adapter = learning.TEAM_ROLES[task].index(role)
    run = with_adapters(single, only(team.policy.layers, adapter))
  episodes = run.play(s["eval_problems"], s["eval_batch"], progress=True)
  graded = next(p.role for p in run.team if p.graded)
  result = summary(episodes, graded, team.step)
  work = learning.workdir(runs, key, seed)
  os.makedirs(work, exist_ok=True)
  with open(os.path.join(work, "eval.json"), "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  write_transcripts(os.path.join(work, "eval_transcripts.jsonl"), episodes)
  print(f"{key} seed {seed}: accuracy={result['accuracy']:.4f}", flush=True)
  return result


if __name__ == "__main__":
  evaluate_cell(sys.argv[1], int(sys.argv[2]), sys.argv[3])

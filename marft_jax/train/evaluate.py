"""Held-out evaluation: the team, greedy, on problems training never sees.

`evaluate(config, model, policy)` plays `config.task.eval_problems` episodes of the config's
task and agent graph on its held-out split with every agent decoding greedily: generated
arithmetic's `split="test"`, whose problems the training split never produces; for the file
tasks (math_jsonl, code) `task.test_path`, or when none is given the fixed held-out part of
`task.path` (`envs.splits`), never a problem training draws. A file's held-out set is played
once, each problem one episode, when it holds fewer problems than asked for. It returns

  accuracy                    the mean final score of an episode (the environment's reward)
  accuracy/<role>             the fraction of episodes whose graded <role> answered right
  answer_format_rate/<role>   the fraction whose answer had its task's final-answer form (the
                              env's `info["formatted"]`; else a math form, boxed, ####, "the
                              answer is", named in `info["answer_format"]`)
  reply_tokens/<role>         the mean length of <role>'s replies (stop token included)
  episodes, dropped           how many were played, and how many could not be scored

Every rate is over all episodes played: a dropped episode counts as wrong.

Sampled evaluation (`play(samples=n, temperature=T)`, launch.eval's --samples_per_problem):
each problem's n episodes are one group of the batch (`EnvBatch(group_size=n)`), so they
are decoded together in the same sampler calls, and a call holds at most batch_size // n
problems' groups (launch.eval's --eval_batch), the problems spread evenly over the fewest
calls (`problems_per_call`: few episodes beyond those asked for are played): on 2 CPU cores a
call of 40 rows decoded 3.1 times the samples per second of one of 10 (`bench/passk.py`). For a
problem file the problems and their order do not depend on the batch (`EnvBatch`'s epoch
order; generated arithmetic's do: its task seeds hash the env's group); the sampled replies
do (the sampler draws one key per call for all its rows), greedy ones only through float
rounding. A problem's samples encode the prompt tokens they share once (`RolloutConfig`'s
`share_group_prompts`). `summarize_samples` adds, per graded role, pass@k for each k asked
(the unbiased estimator of Chen et al. 2021, `pass_at_k`, averaged over problems), and
`decoding` states how the replies were drawn: "greedy" or "n=<n> T=<T>". With n > 1,
accuracy/<role> is the mean over all samples, and a math task (one whose final step names
each graded role's extracted `prediction`) adds maj@<n>/<role>: the share of problems whose
majority answer over their n samples is right (`majority_correct`).
`policy=None` evaluates the untuned team (every agent the base model, adapters off).
`restore_policy(config, model, workdir)` gives a run's adapters from its latest checkpoint, to
be scored on any task and data set: only the model, the adapters' shape and the team must be
those the run trained (`config.saved.EVAL_MUST_MATCH`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Collection, Optional

import jax
import numpy as np
from absl import logging

from marft_jax import envs as envs_lib
from marft_jax.architecture import precision
from marft_jax.configs import to_config_dict
from marft_jax.envs.math_grading import FORMATTED, vote_key
from tqdm import tqdm

from marft_jax.train import eval_progress
from marft_jax.train import run as run_lib
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build.envs import rollout_settings
from marft_jax.train.build.team import build_team
from marft_jax.train.checkpoint import (CheckpointMismatchError, Checkpointer,
                                        config_differences, under)
from marft_jax.train.config import saved as saved_lib
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.sections import RoleSection, TaskSection, TeamSection
from marft_jax.train.config.teams import role_bases
from marft_jax.train.heldout import EVAL_SEED_OFFSET


def greedy_team(config: TrainConfig):
  """The config's team and structure with every agent (the orchestrator too) greedy."""
  team, structure = build_team(config)
  team = envs_lib.with_sampling(team, temperature=0.0)
  if isinstance(structure, envs_lib.Orchestrator):  # a DAG has no agent of its own
    profile = envs_lib.with_sampling((structure.profile,), temperature=0.0)[0]
    structure = dataclasses.replace(structure, profile=profile)
  return team, structure


def sampling_team(config: TrainConfig, temperature: float):
  """`greedy_team`, or (temperature > 0) the team with every agent sampling at `temperature`
  (each role's top_p kept)."""
  team, structure = greedy_team(config)
  if temperature > 0:
    team = envs_lib.with_sampling(team, temperature=float(temperature))
  return team, structure


def play(config: TrainConfig, model, policy: Optional[Any] = None,
         num_problems: Optional[int] = None, batch_size: int = 32,
         progress: bool = False, rollout_weights: Optional[tuple] = None,
         samples: int = 1, temperature: float = 0.0,
         trained: Collection[str] = (), calls_dir: Optional[str] = None,
         calls_settings: Optional[dict] = None) -> list:
  """The `Episode`s of `num_problems` (default `config.task.eval_problems`) held-out tasks,
  played by the config's team with `policy` (None: adapters off): greedily, or `samples`
  episodes per task at `temperature`, each task's decoded together in one group.
  `batch_size`: episodes per rollout call at most, rounded down to a multiple of `samples`
  (at least one task's): the samples of several tasks decode together, and the tasks are
  spread evenly over the fewest calls (`problems_per_call`), so that the last call plays few
  tasks beyond those asked for (each call's shape is the same: no compile for a last,
  smaller one).
  `rollout_weights`: `run.rollout_weights(config, model)` if the caller has it (else made).
  `trained`: fingerprints of problems a checkpoint trained on (`trained_problems`), left out
  of the held-out problems.
  `calls_dir`: each finished call is kept there, and the calls found there are read back
  instead of played again (`eval_progress.CallLog`; `calls_settings`: what else they depend
  on, the policy and the config, beside this function's own arguments)."""
  total = config.task.eval_problems if num_problems is None else int(num_problems)
  _check_samples(num_problems, total, samples, temperature)
  team, structure = sampling_team(config, temperature)
  play_all = run_lib.player(config, model, team, structure,
                            rollout_weights or run_lib.rollout_weights(config, model))
  envs, total = _heldout_envs(config, team, total, samples, max(1, batch_size // samples),
                              trained)
  total *= samples
  # A problem's n samples encode their shared prompt once (the planner's whole prompt; the
  # task in a later agent's): the same samples to f32 rounding, for less prefill.
  settings = dataclasses.replace(rollout_settings(config), share_group_prompts=True)
  calls, episodes, played_calls, bar = None, [], 0, None
  try:
    if calls_dir is not None:
      calls = eval_progress.CallLog(calls_dir, {
          **(calls_settings or {}), "seed": config.seed, "episodes": total, "samples": samples,
          "temperature": float(temperature), "envs_per_call": len(envs)})
      episodes, played_calls = _read_back(calls, envs, calls_dir)
    if progress:
      bar = tqdm(total=total, initial=len(episodes), desc="evaluating", unit="ep")
    with precision.scope(config.model.matmul_precision, config.run_dtype):
      key = jax.random.key(config.seed)
      while len(episodes) < total:
        result = play_all(envs, policy, jax.random.fold_in(key, len(episodes)), settings)
        new = result.episodes[:total - len(episodes)]
        episodes += new
        if calls is not None:
          calls.record(played_calls, new, envs.state_dict())
          played_calls += 1
        if bar is not None:
          bar.update(len(new))
  finally:
    envs.close()
    if bar is not None:
      bar.close()
  return episodes


def _check_samples(num_problems, total: int, samples, temperature: float) -> None:
  """`play`'s arguments: at least one problem, `samples` an int >= 1, sampled above 0."""
  if total < 1:
    raise ValueError(f"num_problems={num_problems!r}: evaluate at least one problem")
  if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
    raise ValueError(f"samples={samples!r}: must be an int >= 1")
  if samples > 1 and not temperature > 0:
    raise ValueError(f"samples={samples} at temperature {temperature}: greedy samples are all "
                     "the same; sample at a temperature > 0")


def _heldout_envs(config: TrainConfig, team, total: int, samples: int, most: int,
                  trained: Collection[str]) -> tuple[Any, int]:
  """(the held-out `EnvBatch` of `total` tasks, `samples` episodes each (one group a task:
  one greedy episode per task also for GRPO, whose config insists on groups), at most `most`
  tasks a call; the tasks it plays: `total`, or a smaller file's every problem once)."""
  build = lambda problems: envs_build.build_envs(
      config, team, seed=config.seed + EVAL_SEED_OFFSET, split="test", group_size=samples,
      num_envs=samples * problems_per_call(problems, most), trained=trained)
  envs = build(total)
  if envs.num_tasks is not None and envs.num_tasks < total:  # each held-out problem once
    total = envs.num_tasks
    if samples * problems_per_call(total, most) != len(envs):  # a file smaller than asked
      envs.close()
      envs = build(total)
  return envs, total


def _read_back(calls: eval_progress.CallLog, envs, calls_dir: str) -> tuple[list, int]:
  """(the episodes of the calls `calls` kept, how many calls), with `envs`' data cursor
  after the last."""
  episodes, count = [], 0
  for played, cursor in calls.played():
    episodes += played
    envs.load_state_dict(cursor)
    count += 1
  if count:
    logging.warning("%s: %d finished calls (%d episodes) read back; playing the rest",
                    calls_dir, count, len(episodes))
  return episodes, count


def problems_per_call(problems: int, most: int) -> int:
  """Problems in each of the fewest calls of at most `most` that play `problems`, spread
  evenly: ceil(problems / calls), calls = ceil(problems / most). The calls play fewer than
  `calls` problems beyond `problems` (164 HumanEval problems at most 40 a call: 5 calls of
  33, one extra, where calls of 40 would play 36 extra; 2 a call: 82 calls, none extra)."""
  calls = -(-problems // most)
  return -(-problems // calls)


def evaluate(config: TrainConfig, model, policy: Optional[Any] = None,
             num_problems: Optional[int] = None, batch_size: int = 32,
             progress: bool = False, rollout_weights: Optional[tuple] = None) -> dict:
  """The metrics of the module docstring on `num_problems` held-out tasks (see `play`)."""
  episodes = play(config, model, policy, num_problems, batch_size, progress, rollout_weights)
  return summarize(episodes, greedy_team(config)[0])


def summarize(episodes, team) -> dict:
  """The metrics of the module docstring from played episodes (dropped ones score 0)."""
  graded = [p.role for p in team if p.graded]
  scored = [e for e in episodes if e.dropped is None and e.infos]
  n = max(len(episodes), 1)
  out = {"episodes": len(episodes), "dropped": len(episodes) - len(scored)}
  out["accuracy"] = sum(float(np.mean(e.rewards[-1])) for e in scored) / n
  final = [e.infos[-1] for e in scored]
  for role in graded:
    out[f"accuracy/{role}"] = sum(float(bool(i.get("correct", {}).get(role))) for i in final) / n
    if any("formatted" in i or "answer_format" in i for i in final):
      out[f"answer_format_rate/{role}"] = sum(float(_formatted(i, role)) for i in final) / n
  for profile in team:
    lengths = [t.num_tokens for e in scored for t in e.turns if t.role == profile.role]
    out[f"reply_tokens/{profile.role}"] = float(np.mean(lengths)) if lengths else 0.0
  return out


def _formatted(info: dict, role: str) -> bool:
  """Whether `role`'s graded answer was in its task's final-answer form: the env's own verdict
  (`info["formatted"]`, as each task's form differs: grid_path's is a path), else a math form
  named in `info["answer_format"]` (an env of a user's that reports only that)."""
  if "formatted" in info:
    return bool(info["formatted"].get(role))
  return info.get("answer_format", {}).get(role) in FORMATTED


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased estimate of pass@k from n samples of which c passed (Chen et al. 2021):
  1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement include a
  pass; computed as a product, stable for large n."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): needs 0 <= c <= n and 1 <= k <= n")
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_correct(predictions, correct) -> bool:
  """Whether the majority answer of one problem's n samples is right (maj@n).

  predictions: [n] each sample's extracted answer, or None (no answer, or a dropped episode:
  no vote); correct: [n] bools, whether each sample was graded right. Answers vote under
  `math_grading.vote_key` (a plain number by value, else the text without spaces). The
  answer with the most votes wins; a tie goes to the tied answer drawn first (lowest sample
  index). Its correctness is that of its first sample (every sample giving the same answer
  is graded the same, a grading timeout aside). No answer at all: wrong."""
  votes: dict = {}  # key -> [votes, first sample]
  for i, prediction in enumerate(predictions):
    if prediction is not None:
      votes.setdefault(vote_key(prediction), [0, i])[0] += 1
  if not votes:
    return False
  _, first = max(votes.values(), key=lambda v: (v[0], -v[1]))
  return bool(correct[first])


def summarize_samples(episodes, team, samples: int, temperature: float,
                      ks: tuple = (1,)) -> dict:
  """`summarize`'s metrics (over every sample: with n > 1, accuracy is the mean over samples)
  and, per graded role, pass@k for each k in `ks` (each <= samples), the mean over problems
  of `pass_at_k` on that problem's samples (a dropped one counts as failed); with n > 1 on a
  math task (final infos holding `prediction`), maj@<samples>/<role>, the mean over problems
  of `majority_correct`; and `decoding`: "greedy" or "n=<samples> T=<temperature>"."""
  bad = [k for k in ks if not 1 <= k <= samples]
  if bad:
    raise ValueError(f"pass@k for k={bad}: k must be between 1 and the {samples} samples "
                     "per problem")
  out = summarize(episodes, team)
  out["decoding"] = "greedy" if samples == 1 and not temperature > 0 else (
      f"n={samples} T={temperature:g}")
  out["samples_per_problem"] = samples
  by_task: dict = {}
  for episode in episodes:  # a group's episodes share their task's seed
    by_task.setdefault(episode.seed, []).append(episode)
  out["problems"] = len(by_task)
  final = lambda e: e.infos[-1] if e.dropped is None and e.infos else {}
  voting = samples > 1 and any("prediction" in final(e) for e in episodes)
  for role in [p.role for p in team if p.graded]:
    correct = [[bool(final(e).get("correct", {}).get(role)) for e in group]
               for group in by_task.values()]
    for k in ks:
      out[f"pass@{k}/{role}"] = float(np.mean([pass_at_k(len(c), sum(c), k) for c in correct]))
    if voting:
      answers = [[final(e).get("prediction", {}).get(role) for e in group]
                 for group in by_task.values()]
      out[f"maj@{samples}/{role}"] = float(np.mean(
          [majority_correct(a, c) for a, c in zip(answers, correct)]))
  return out


def restore_policy(config: TrainConfig, model, workdir: str):
  """(the policy adapters of `workdir`'s latest checkpoint, its step), for evaluating them
  under `config`, on any task and data.

  Only what shapes the adapters and the team that runs them must match the run that wrote
  the checkpoint: the keys of `config.saved.EVAL_MUST_MATCH` and the team `build_team` makes
  (each role's name and adapter, the orchestrator's adapter); anything else (task, data
  files, seed, sampling budgets, algorithm, critic, ...) may differ. The checkpoint is read
  into a state shaped by its own saved config (read by `config.saved.read_saved_config`). A
  difference is a `CheckpointMismatchError` naming the keys. The settings that shape the
  episodes (`config.saved.EVAL_SHOWS_IF_CHANGED`) and differ from the run's are logged as one
  warning (`changed_settings`): an evaluation plays under `config`, not the checkpoint's.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(f"{workdir}: no checkpoints folder to evaluate (train first, or "
                            "evaluate the untuned model)")
  # read_only: the run may still be training and writing there
  with Checkpointer(workdir, read_only=True) as checkpointer:
    step = checkpointer.latest_step()
    if step is None:
      raise FileNotFoundError(f"{workdir}: no checkpoint to evaluate (train first, or "
                              "evaluate the untuned model)")
    saved = saved_config(checkpointer.read_meta(step), f"{workdir}: step {step}")
    _check_same_adapters(saved, config, f"{workdir}: step {step}")
    state = restore_state(checkpointer, saved, model, step)
  changed = changed_settings(saved, config)
  if changed:
    logging.warning("%s: step %d is evaluated with settings other than it trained with: %s",
                    workdir, step, "; ".join(changed))
  return run_lib.policy(saved, state), step


def changed_settings(trained: TrainConfig, config: TrainConfig) -> list[str]:
  """"key: trained with X, now Y" for each key under `config.saved.EVAL_SHOWS_IF_CHANGED` whose
  value in `config` differs from the training run's (`trained`: its saved config), both read
  as a resume reads them (`config.saved.resume_view`: a setting that cannot change this model's
  numbers is no difference). Left out: sampling settings (temperature, top_p), since the
  evaluation plays greedily, and `task.eval_problems`, the evaluation's own count, which
  training never read (its held-out evaluation plays `eval_episodes`)."""
  as_dict = lambda c: saved_lib.resume_view(to_config_dict(
      _without_what_eval_ignores(saved_lib.as_recorded(c))).to_dict(), c.run_dtype)
  brief = lambda value: repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
  return [f"{key}: trained with {brief(was)}, now {brief(now)}"
          for key, was, now in config_differences(as_dict(trained), as_dict(config))
          if under(key, saved_lib.EVAL_SHOWS_IF_CHANGED)]


def _without_what_eval_ignores(config: TrainConfig) -> TrainConfig:
  """`config` with the team's and every role's temperature and top_p, and
  `task.eval_problems`, at their defaults (see `changed_settings`)."""
  roles = tuple(dataclasses.replace(r, temperature=RoleSection.temperature, top_p=RoleSection.top_p)
                for r in config.team.roles)
  team = dataclasses.replace(config.team, temperature=TeamSection.temperature,
                             top_p=TeamSection.top_p, roles=roles)
  task = dataclasses.replace(config.task, eval_problems=TaskSection.eval_problems)
  return dataclasses.replace(config, team=team, task=task)


def restore_state(checkpointer: Checkpointer, saved: TrainConfig, model, step: int):
  """The `TrainState` of `step` (a team on several backbones: {backbone: TrainState}), read
  into a fresh state of its own saved config `saved` on `model` (its base, or {backbone:
  base}); `init_from` is not read (the checkpoint holds the adapters)."""
  start = dataclasses.replace(saved, init_from="")
  return checkpointer.restore(run_lib.new_state(start, model), step=step)[0]


def saved_config(meta: dict, where: str) -> TrainConfig:
  """A checkpoint meta's saved config as this version reads it (`config.saved.read_saved_config`);
  `where` (e.g. "runs/x: step 8") prefixes a `CheckpointMismatchError`."""
  if "config" not in meta:
    raise CheckpointMismatchError(f"{where} has no saved config (the run that wrote it did "
                                  "not store meta['config'])")
  return saved_lib.read_saved_config(meta["config"], where)


def _team_shape(config: TrainConfig) -> tuple:
  """(role, adapter) per agent, the orchestrator's adapter (or None), the adapter count."""
  team, structure = greedy_team(config)
  roles = tuple((p.role, envs_lib.adapter_index(team, i)) for i, p in enumerate(team))
  router = structure.profile.adapter if isinstance(structure, envs_lib.Orchestrator) else None
  return roles, router, config.num_adapters


def _check_same_adapters(saved: TrainConfig, config: TrainConfig, where: str) -> None:
  """CheckpointMismatchError naming every `EVAL_MUST_MATCH` key and team shape that differ."""
  get = lambda c, key: functools.reduce(getattr, key.split("."), c)
  differing = [f"{key}: saved {get(saved, key)!r}, now {get(config, key)!r}"
               for key in saved_lib.EVAL_MUST_MATCH if get(saved, key) != get(config, key)]
  was, now = role_bases(saved), role_bases(config)
  differing += [f"team.roles.{role}.backbone: saved {was[role]!r}, now {now[role]!r}"
                for role in was if role in now and was[role] != now[role]]
  if not differing:
    for name, was, now in zip(("team roles (role, adapter)", "orchestrator adapter",
                               "adapters"), _team_shape(saved), _team_shape(config)):
      if was != now:
        differing.append(f"{name}: saved {was!r}, now {now!r}")
  if differing:
    raise CheckpointMismatchError(
        f"{where} holds adapters of another shape or team ({'; '.join(differing)}). Evaluate "
        "with the model, LoRA and team settings the run was trained with; the task, data and "
        "sampling may differ.")

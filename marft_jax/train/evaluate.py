"""Held-out evaluation: the team, greedy, on problems training never sees.

`evaluate(config, model, policy)` plays `config.task.eval_problems` episodes of the config's
task and agent graph on its held-out split (generated arithmetic: `split="test"`, whose
problems the training split never produces; JSONL tasks: the file at `task.path`, so point it
at your test file) with every agent decoding greedily, and returns

  accuracy                    the mean final score of an episode (the environment's reward)
  accuracy/<role>             the fraction of episodes whose graded <role> answered right
  answer_format_rate/<role>   the fraction whose answer had a final-answer form (boxed, ####,
                              "the answer is"; math tasks)
  reply_tokens/<role>         the mean length of <role>'s replies
  episodes, dropped           how many were played, and how many could not be scored

`policy=None` evaluates the untuned team (every agent the base model).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from marft_jax import envs as envs_lib
from marft_jax.envs.math_grading import FORMATTED
from marft_jax.rollout import RolloutConfig, rollout
from marft_jax.train.config import TrainConfig

EVAL_SEED_OFFSET = 1_000_003  # held-out episodes never share a seed with training's


def greedy_team(config: TrainConfig):
  """The config's team and structure with every agent (the orchestrator too) greedy."""
  from marft_jax.train.loop import build_team
  team, structure = build_team(config)
  team = envs_lib.with_sampling(team, temperature=0.0)
  if structure is not None:
    profile = envs_lib.with_sampling((structure.profile,), temperature=0.0)[0]
    structure = dataclasses.replace(structure, profile=profile)
  return team, structure


def evaluate(config: TrainConfig, model, policy: Optional[Any] = None,
             num_problems: Optional[int] = None, batch_size: int = 32,
             progress: bool = False) -> dict:
  """Scores the team on `num_problems` (default `config.task.eval_problems`) held-out tasks."""
  from marft_jax.train.loop import _rollout_model, build_envs
  total = config.task.eval_problems if num_problems is None else int(num_problems)
  if total < 1:
    raise ValueError(f"num_problems={num_problems!r}: evaluate at least one problem")
  team, structure = greedy_team(config)
  params, model_config = _rollout_model(model, config)
  batch_size = min(batch_size, total)
  eval_config = dataclasses.replace(
      config, rollout=dataclasses.replace(config.rollout, num_envs=batch_size, group_size=1))
  envs = build_envs(eval_config, team, seed=config.seed + EVAL_SEED_OFFSET, split="test")
  settings = RolloutConfig(context_mode=config.rollout.context_mode, horizon=config.task.horizon,
                           max_context=config.rollout.max_context)
  episodes = []
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=total, desc="evaluating", unit="ep")
  try:
    key = jax.random.key(config.seed)
    while len(episodes) < total:
      result = rollout(envs, team, structure, params, model_config, model.tokenizer,
                       jax.random.fold_in(key, len(episodes)), lora=policy, config=settings)
      new = result.episodes[:total - len(episodes)]
      episodes += new
      if bar is not None:
        bar.update(len(new))
  finally:
    envs.close()
    if bar is not None:
      bar.close()
  return summarize(episodes, team)


def summarize(episodes, team) -> dict:
  """The metrics of the module docstring from played episodes (dropped ones score 0)."""
  graded = [p.role for p in team if p.graded]
  scored = [e for e in episodes if e.dropped is None and e.infos]
  n = max(len(episodes), 1)
  out = {"episodes": len(episodes), "dropped": len(episodes) - len(scored)}
  out["accuracy"] = sum(float(np.mean(e.rewards[-1])) for e in scored) / n
  for role in graded:
    final = [e.infos[-1] for e in scored]
    out[f"accuracy/{role}"] = sum(float(bool(i.get("correct", {}).get(role))) for i in final) / n
    if any("answer_format" in i for i in final):
      out[f"answer_format_rate/{role}"] = sum(
          float(i.get("answer_format", {}).get(role) in FORMATTED) for i in final) / n
  for profile in team:
    lengths = [t.num_tokens for e in scored for t in e.turns if t.role == profile.role]
    out[f"reply_tokens/{profile.role}"] = float(np.mean(lengths)) if lengths else 0.0
  return out

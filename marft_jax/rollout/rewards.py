"""Rewards beyond the environment's exact answers: an LLM judge, and a user's own function.

Both run after the team has played (`rollout`) and before the trainer credits the rewards,
on this process's episodes; both change `episode.rewards` ([S env steps][N roles]).

Judge: one more agent, not part of the team and never trained, reads each episode's task and
its graded roles' final replies and writes a verdict, parsed into a score in [0, 1]
(`parse_verdict`: "Score: 7/10", "7/10", "yes" / "no"). All episodes are judged in one call
of the same jitted sampler (`sampler.generate`), greedily, with the policy's base (or a second
model's weights), with or without the judge's own adapter. The last env step's rewards become

    r ← (1 − w) · r_env + w · score        (w = `JudgeConfig.weight`; every role alike)

An unparseable verdict scores 0 and is counted. What it cost lands in the metrics
(`judge/seconds`, `judge/tokens`, `judge/score`, `judge/unparseable`), the verdict text in the
episode's last info (`info["judge"]`, and so in the transcripts).

User function: `fn(episode, team) -> rewards` returning, per env step, a reward per role (a
list of N floats, the team's order) or one float for every role; None keeps the episode's.
Per-role rewards are what `advantage.credit="per_step"` credits to each role's turns.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from marft_jax.models import sampler

DEFAULT_PROMPT = ("You grade a team's answer to a task. Read the task and the answer, then "
                  "reply with one line: 'Score: N/10', where 10 means certainly correct and 0 "
                  "certainly wrong.")
_SCORE = re.compile(r"(?:score\s*[:=]?\s*)?(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", re.I)
_PLAIN_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.I)
_YES_NO = re.compile(r"\b(yes|correct|no|incorrect|wrong)\b", re.I)

RewardFn = Callable[[Any, Sequence[Any]], Optional[Sequence]]


def parse_verdict(text: str) -> Optional[float]:
  """A verdict's score in [0, 1], or None when it says none.

  "Score: 7/10" and "7/10" → 0.7 (clipped to [0, 1]); "Score: 0.8" → 0.8 (a plain score is
  read on [0, 1] when ≤ 1, else on [0, 10]); otherwise the first of yes/correct (1) or
  no/incorrect/wrong (0)."""
  found = _SCORE.search(text)
  if found and float(found.group(2)) > 0:
    return float(np.clip(float(found.group(1)) / float(found.group(2)), 0.0, 1.0))
  found = _PLAIN_SCORE.search(text)
  if found:
    value = float(found.group(1))
    return float(np.clip(value if value <= 1 else value / 10, 0.0, 1.0))
  found = _YES_NO.search(text)
  if found:
    return 1.0 if found.group(1).lower() in ("yes", "correct") else 0.0
  return None


@dataclasses.dataclass(frozen=True)
class Judge:
  """What the judge runs: weights (the policy's base, or a second model's), its tokenizer,
  its adapter (one `Adapters`, or None: the plain weights), prompt and budget."""

  params: Any
  model_config: Any
  tokenizer: Any
  adapter: Any = None
  prompt: str = DEFAULT_PROMPT
  max_new_tokens: int = 16
  weight: float = 1.0
  parse: Callable[[str], Optional[float]] = parse_verdict


def judge_prompt(tokenizer, prompt: str, task: str, answers: Sequence[tuple[str, str]]):
  """Token ids: the judge's instructions, the task and each graded role's final reply."""
  shown = "\n\n".join(f"{role}'s answer:\n{text.strip()}" for role, text in answers)
  messages = [{"role": "system", "content": prompt},
              {"role": "user", "content": f"Task:\n{task.strip()}\n\n{shown}"}]
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  return tokenizer(text, add_special_tokens=False)["input_ids"]


def final_answers(episode, team) -> list[tuple[str, str]]:
  """(role, reply) of each graded role's last turn."""
  last = {}
  for turn in episode.turns:
    if turn.agent < len(team) and team[turn.agent].graded:
      last[team[turn.agent].role] = turn.reply
  return [(role, last.get(role, "")) for role in (p.role for p in team if p.graded)]


def apply_judge(episodes: Sequence[Any], team, judge: Judge, rng: jax.Array) -> dict:
  """Scores every kept episode (one greedy sampler call) and blends the score into its last
  env step's rewards. Returns the judge's metrics."""
  kept = [e for e in episodes if e.dropped is None and e.rewards]
  if not kept:
    return {}
  start = time.perf_counter()
  prompts = [judge_prompt(judge.tokenizer, judge.prompt, e.task, final_answers(e, team))
             for e in kept]
  width = max(len(p) for p in prompts)
  pad = judge.tokenizer.pad_token_id
  pad = judge.tokenizer.eos_token_id if pad is None else pad
  tokens = np.full((len(prompts), width), pad, np.int32)
  for r, p in enumerate(prompts):
    tokens[r, :len(p)] = p
  out = sampler.generate(
      judge.params, tokens, judge.model_config, rng=rng, max_new_tokens=judge.max_new_tokens,
      prompt_lens=np.asarray([len(p) for p in prompts], np.int32), temperature=0.0,
      lora=judge.adapter, adapter_ids=None if judge.adapter is None else np.zeros(len(prompts),
                                                                                 np.int32),
      eos_ids=judge.tokenizer.eos_token_id, pad_id=pad, compile_ahead=True)  # every iteration
  new_tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  scores, unparseable = [], 0
  for r, episode in enumerate(kept):
    text = judge.tokenizer.decode(new_tokens[r, :lengths[r]], skip_special_tokens=True)
    score = judge.parse(text)
    if score is None:
      unparseable, score = unparseable + 1, 0.0
    scores.append(score)
    env = np.asarray(episode.rewards[-1], np.float64)
    episode.rewards[-1] = list((1 - judge.weight) * env + judge.weight * score)
    episode.infos[-1] = dict(episode.infos[-1], judge=text, judge_score=score)
  return {"judge/seconds": time.perf_counter() - start, "judge/tokens": float(lengths.sum()),
          "judge/score": float(np.mean(scores)), "judge/unparseable": unparseable / len(kept)}


def load_reward_fn(path: str) -> RewardFn:
  """The function `path` ("package.module:function", `config.reward.fn`) names, checked
  (`check_reward_fn`); a ValueError naming `reward.fn` if it cannot be imported or called.
  The one place both `train` and the launch script read `reward.fn` from."""
  module_name, _, name = path.partition(":")
  try:
    fn = getattr(importlib.import_module(module_name), name)
  except (ImportError, AttributeError) as e:
    raise ValueError(f"reward.fn={path!r}: {type(e).__name__}: {e}") from None
  try:
    check_reward_fn(fn)
  except ValueError as e:
    raise ValueError(f"reward.fn={path!r}: {e}") from None
  return fn


def check_reward_fn(fn: RewardFn) -> None:
  """Refuses what cannot be called as `fn(episode, team)` with a ValueError, before a
  rollout is spent on it."""
  if not callable(fn):
    raise ValueError(f"reward function {fn!r}: not callable")
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without one: its first call will tell
    return
  try:
    signature.bind(None, None)
  except TypeError as e:
    raise ValueError(f"reward function {getattr(fn, '__qualname__', fn)}{signature}: it is "
                     f"called as fn(episode, team) ({e})") from None


def apply_reward_fn(episodes: Sequence[Any], team, fn: RewardFn) -> None:
  """Replaces each kept episode's rewards with `fn`'s (see the module docstring)."""
  for episode in episodes:
    if episode.dropped is not None:
      continue
    rewards = fn(episode, team)
    if rewards is None:
      continue
    if np.ndim(rewards) == 0:  # e.g. one float for a one-step episode
      raise ValueError(f"reward function: returned {rewards!r} for env {episode.env_index}: "
                       f"return one entry per env step ({len(episode.rewards)} here), each a "
                       "float or a list of one float per role")
    if len(rewards) != len(episode.rewards):
      raise ValueError(f"reward function: {len(rewards)} env steps of rewards for an episode "
                       f"of {len(episode.rewards)} (env {episode.env_index})")
    episode.rewards = [[float(r)] * len(team) if np.ndim(r) == 0 else _per_role(r, team)
                       for r in rewards]


def _per_role(rewards, team) -> list[float]:
  if len(rewards) != len(team):
    raise ValueError(f"reward function: {len(rewards)} rewards for a team of {len(team)} "
                     f"roles ({', '.join(p.role for p in team)})")
  return [float(r) for r in rewards]

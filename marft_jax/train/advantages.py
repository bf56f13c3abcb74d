"""Advantages and value targets of a `TrainBatch`, per algorithm, with `marft_jax.ppo`.

Every episode is laid out as one chain in execution order, and `ppo.masked_gae` runs over it
(vmapped over episodes, padded to one width: one compile per width):

  action level (MARFT-A, single-agent PPO): one position per agent turn, valued at the state
    before the turn's first token. The hop after turn k discounts by γ_agent inside an env
    step and by γ·(1 − done) into the next env step (`ppo.action_level_advantages`' chain,
    generalised to any number of turns a step: a DAG's layers, an orchestrator's calls).
  token level (MARFT-T, the shared-stream PPO): one position per generated token; hops inside
    a reply discount by γ_token, the hop out of a reply as above.
  GRPO: no critic. A turn's return (its reward-to-go) is normalised within its group (the G
    rollouts of one task) and its agent (`ppo.agent_group_normalize`): each role is compared
    with the same role on the same task.

Rewards come from the environment per env step and agent, and are credited to turns
(`credit`): "equal" puts the team reward on the env step's last turn (the critic and GAE share
it out), "step_discount" gives turn i of n the reward · γ_c^(n−1−i), "per_step" gives each turn
its own role's reward. An episode ends when the environment or the horizon ends it; the
horizon counts as terminal (bootstrap 0).

Several processes: each computes the advantages of the episodes it played, on its block of
the batch's rows (GAE runs along one episode; a GRPO group lies within one process). Only the
batch-wide whitening (`normalize`) needs every process: every process gathers the whole
batch's un-whitened advantages and masks (`Blocks`; a float and a flag per position of the
[B, T] and [B, K] arrays, nothing else of the batch), lays them out in the one-process
batch's row order and whitens them with the one-process code, so each block gets the bits one
process would have computed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import multihost, ppo
from marft_jax.rollout.episode import Episode
from marft_jax.train.batching import TrainBatch, bucket_length

CREDITS = ("equal", "step_discount", "per_step")
LEVELS = ("action", "token", "grpo")
NORMALIZE_EPS = 1e-5  # added to the batch's advantage standard deviation


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A multi-process job's batch, seen from one process: the rows are split into one equal,
  contiguous block per process, in process order, and this process holds block `index`
  (`multihost.ProcessRows`)."""

  index: int  # this process's block (jax.process_index())
  # Every process's equally long block -> their concatenation in process order (a collective).
  gather: Callable[[np.ndarray], np.ndarray] = multihost.gather_blocks


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """Discounts and credit (see the module docstring)."""

  level: str = "action"  # "action", "token" or "grpo"
  gamma: float = 1.0  # across env steps
  lambda_: float = 0.95
  gamma_agent: Optional[float] = None  # across turns of one env step (None: gamma)
  lambda_agent: Optional[float] = None
  gamma_token: float = 1.0  # between tokens of one reply (token level)
  lambda_token: float = 1.0
  credit: str = "equal"
  credit_discount: float = 1.0  # γ_c of step_discount
  normalize: bool = True  # whiten the advantages over the batch (not GRPO: it is normalised)

  def __post_init__(self):
    if self.level not in LEVELS:
      raise ValueError(f"level={self.level!r}: use one of {LEVELS}")
    if self.credit not in CREDITS:
      raise ValueError(f"credit={self.credit!r}: use one of {CREDITS}")
    for key in ("gamma", "lambda_", "gamma_agent", "lambda_agent", "gamma_token",
                "lambda_token", "credit_discount"):
      value = getattr(self, key)
      if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{key}={value!r}: must be in [0, 1]")


def _turns(episodes: Sequence[Episode], batch: TrainBatch):
  """Per episode, its turns in execution order: (row, k, env_step, agent).

  Rows were stacked episode by episode, sequence by sequence, so an episode's rows come in
  the order its turns were played (per-agent view), and spans run in order within a row
  (shared stream).
  """
  rows_of = {}
  for r, e in enumerate(np.asarray(batch.row_episode)):
    if e >= 0:
      rows_of.setdefault(int(e), []).append(r)
  out = []
  for e, episode in enumerate(episodes):
    turns = []
    for r, sequence in zip(rows_of.get(e, []), episode.sequences):
      for k, span in enumerate(sequence.spans):
        if batch.turn_valid[r, k]:
          turns.append((r, k, span.env_step, span.agent))
    out.append(turns)
  return out


def _turn_rewards(episode: Episode, turns, config: AdvantageConfig, num_team: int):
  """[n] per-turn rewards and [n] 'last turn of its env step' flags."""
  n = len(turns)
  rewards, last_of_step = np.zeros(n, np.float32), np.zeros(n, bool)
  for i, (_, _, step, agent) in enumerate(turns):
    if i == n - 1 or turns[i + 1][2] != step:
      last_of_step[i] = True
  for step, step_rewards in enumerate(episode.rewards):
    in_step = [i for i, t in enumerate(turns) if t[2] == step]
    if not in_step:
      continue
    team = float(np.mean(step_rewards))
    if config.credit == "equal":
      rewards[in_step[-1]] += team
    elif config.credit == "step_discount":
      for j, i in enumerate(in_step):
        rewards[i] += team * config.credit_discount ** (len(in_step) - 1 - j)
    else:  # per_step: each turn its own role's reward (an orchestrator's turns get none)
      for i in in_step:
        agent = turns[i][3]
        rewards[i] += float(step_rewards[agent]) if agent < num_team else 0.0
  return rewards, last_of_step


def _hops(episode: Episode, turns, last_of_step, config: AdvantageConfig):
  """Discount and λ of the hop leaving each turn: [n] each."""
  g_agent = config.gamma if config.gamma_agent is None else config.gamma_agent
  l_agent = config.lambda_ if config.lambda_agent is None else config.lambda_agent
  discount = np.full(len(turns), g_agent, np.float32)
  lambdas = np.full(len(turns), l_agent, np.float32)
  for i, (_, _, step, _) in enumerate(turns):
    if last_of_step[i]:
      done = step >= len(episode.dones) or episode.dones[step]
      discount[i] = 0.0 if done else config.gamma
      lambdas[i] = config.lambda_
  return discount, lambdas


def compute_advantages(batch: TrainBatch, episodes: Sequence[Episode],
                       config: AdvantageConfig, num_team: int,
                       groups: Optional[Sequence[int]] = None,
                       blocks: Optional[Blocks] = None) -> TrainBatch:
  """The batch with advantages and returns filled in, from `batch.act_old_value` (the
  critic's values at rollout time, per decision; zeros for GRPO).

  Args:
    episodes: the batch's episodes, in `batch.row_episode` order.
    num_team: N, the number of team agents (an orchestrator is agent N).
    groups: GRPO only: each episode's group (episodes of one task share a group).
    blocks: a multi-process job's layout: `batch` is then this process's block of the rows
      and `episodes` its episodes (possibly none), and the whitening is the whole batch's
      (`_normalize`). None: the batch is the whole batch.
  """
  turns = _turns(episodes, batch)
  if config.level == "grpo":
    return _grpo(batch, episodes, turns, config, num_team, groups)
  token = config.level == "token"
  values = np.asarray(batch.act_old_value, np.float32)
  chains = []  # per episode: (rewards, discounts, lambdas, values, positions)
  for e, episode in enumerate(episodes):
    tt = turns[e]
    if not tt:
      chains.append(None)
      continue
    rewards, last = _turn_rewards(episode, tt, config, num_team)
    discount, lambdas = _hops(episode, tt, last, config)
    r_, g_, l_, v_, pos = [], [], [], [], []
    for i, (row, k, _, _) in enumerate(tt):
      start = int(batch.turn_value_pos[row, k])
      length = int(batch.turn_length[row, k]) if token else 1
      for j in range(length):
        end = j == length - 1
        r_.append(rewards[i] if end else 0.0)
        g_.append(discount[i] if end else config.gamma_token)
        l_.append(lambdas[i] if end else config.lambda_token)
        v_.append(values[row, start + j])
        pos.append((row, start + j, k))
    chains.append((r_, g_, l_, v_, pos))
  adv = _gae(chains)
  act_adv, act_ret = np.zeros_like(values), np.zeros_like(values)
  turn_adv = np.zeros(batch.turn_valid.shape, np.float32)
  turn_ret, turn_val = np.zeros_like(turn_adv), np.zeros_like(turn_adv)
  for e, chain in enumerate(chains):
    if chain is None:
      continue
    for j, (row, p, k) in enumerate(chain[4]):
      act_adv[row, p], act_ret[row, p] = adv[e, j], adv[e, j] + chain[3][j]
      if p == batch.turn_value_pos[row, k]:
        turn_adv[row, k], turn_ret[row, k] = adv[e, j], adv[e, j] + chain[3][j]
        turn_val[row, k] = chain[3][j]
  if not token:  # an action's advantage applies to every token of it
    act_adv = _spread(batch, turn_adv)
  if config.normalize:
    rows = None if blocks is None else blocks.gather(np.asarray(batch.row_episode))
    act_adv = _normalize(act_adv, np.asarray(batch.act_mask), rows, blocks)
    turn_adv = _normalize(turn_adv, np.asarray(batch.turn_valid), rows, blocks)
  return batch.replace(act_advantage=act_adv, act_return=act_ret, turn_advantage=turn_adv,
                       turn_return=turn_ret, turn_old_value=turn_val)


def _gae(chains) -> np.ndarray:
  """[E, W] advantages of each episode's chain (None: no chain), W its bucketed width."""
  lengths = [len(c[0]) for c in chains if c is not None]
  if not lengths:  # nothing to train in this block (another process may have)
    return np.zeros((len(chains), 0), np.float32)
  width = bucket_length(max(lengths), 16)
  arrays = np.zeros((4, len(chains), width), np.float32)
  valid = np.zeros((len(chains), width), bool)
  arrays[1:3] = 1.0  # padding: transparent identity hops
  for e, chain in enumerate(chains):
    if chain is None:
      continue
    n = len(chain[0])
    arrays[:, e, :n] = np.asarray(chain[:4], np.float32)
    valid[e, :n] = True
  return np.asarray(jax.vmap(ppo.masked_gae, in_axes=(0, 0, 0, 0, 0, None))(
      *map(jnp.asarray, arrays), jnp.asarray(valid), 0.0))


def _normalize(x: np.ndarray, mask: np.ndarray, row_episode: Optional[np.ndarray],
               blocks: Optional[Blocks]) -> np.ndarray:
  """`ppo.normalize` over the batch: x' = (x − μ) / (σ + eps) on the valid entries.

  With `blocks`, `x` and `mask` are this process's block and `row_episode` is every block's
  (concatenated): μ and σ are the whole batch's. Each process gathers every block of `x`
  and `mask` (5 bytes a position, what the whitening reads and nothing more: kilobytes to a
  few MB a batch), puts the rows in the order one process's `make_batch` would (every
  block's episode rows in process order, then the padding rows), whitens that with the same
  call as one process, and keeps its own rows: the bits one process computes, with no
  cross-process sum in another order."""
  if blocks is None:
    return np.asarray(ppo.normalize(x, mask, eps=NORMALIZE_EPS))
  whole_x, whole_mask = blocks.gather(x), blocks.gather(mask)
  order = np.argsort(row_episode < 0, kind="stable")  # one process's rows: padding last
  out = np.empty_like(whole_x)
  out[order] = np.asarray(ppo.normalize(whole_x[order], whole_mask[order], eps=NORMALIZE_EPS))
  size = x.shape[0]
  return out[blocks.index * size:(blocks.index + 1) * size]


def _spread(batch: TrainBatch, per_turn: np.ndarray) -> np.ndarray:
  """[B, K] per-turn values -> [B, T] on each turn's decisions (0 elsewhere)."""
  turn = np.asarray(batch.act_turn)
  picked = np.take_along_axis(per_turn, np.maximum(turn, 0), axis=1)
  return np.where(turn >= 0, picked, 0.0).astype(np.float32)


def _grpo(batch, episodes, turns, config, num_team, groups):
  if groups is None:
    raise ValueError("GRPO needs each episode's group (the rollouts of one task)")
  turn_ret = np.zeros(batch.turn_valid.shape, np.float32)
  group_of = np.full(batch.turn_valid.shape, 0, np.int32)
  for e, episode in enumerate(episodes):
    tt = turns[e]
    if not tt:
      continue
    rewards, last = _turn_rewards(episode, tt, config, num_team)
    discount, _ = _hops(episode, tt, last, config)
    to_go = 0.0
    for i in reversed(range(len(tt))):  # reward-to-go along the chain
      to_go = rewards[i] + (discount[i] * to_go if i < len(tt) - 1 else 0.0)
      row, k = tt[i][0], tt[i][1]
      turn_ret[row, k], group_of[row, k] = to_go, groups[e]
  num_agents = int(max(num_team, np.max(batch.turn_agent) + 1))
  turn_adv = np.asarray(ppo.agent_group_normalize(
      turn_ret, batch.turn_valid, group_of, np.maximum(batch.turn_agent, 0),
      int(max(groups, default=0)) + 1, num_agents))
  return batch.replace(act_advantage=_spread(batch, turn_adv), turn_advantage=turn_adv,
                       turn_return=turn_ret)

"""Advantages and value targets of a `TrainBatch`, per algorithm, with `marft_jax.ppo`.

The host lays every episode's trained turns out in execution order (`build_chains`: which
env step, which earlier turns' replies each prompt holds, how many positions, which rewards,
which values); the maths is
`ppo.turn_chain_advantages`, vmapped over the episodes (padded to bucketed widths):

  action level (MARFT-A, single-agent PPO): one position per agent turn, valued at the state
    before the turn's first token.
  token level (MARFT-T, the shared-stream PPO): one position per generated token; hops inside
    a reply discount by γ_token, λ_token.
  GRPO: no critic. A turn's return (its Monte Carlo reward-to-go: no values, λ = 1) is
    normalised within its group (the G rollouts of one task) and its agent
    (`ppo.agent_group_normalize`): each role is compared with the same role on the same task.

A turn's hop leads to its first descendant in execution order: the earliest later turn of
its env step whose prompt contains its reply (`ppo.turn_successors`; who sees whom comes from
the graph, `envs.agent_sees`: in a DAG a role's prompt holds its ancestors' replies). In a
chain or an orchestrator's calls that is the next turn. In a DAG a fork's predecessor hops to
its first child, a branch to the first turn that sees it (the join), never to a sibling,
whose prompt never saw the branch's reply: the state a turn bootstraps from must contain the
turn's reply, and the earliest such state is its one-step successor (`ppo.chains` says more).
A turn that no later turn of its step sees (a sink: the step's last turn in a chain or a
diamond; each of the ends of a DAG with several) hops to the next env step's first turn, or
ends the episode. The hop discounts by γ_agent inside an env step and by γ·(1 − done) into
the next one. Each branch is trained on its own row: exactly the tokens it saw and wrote.

Rewards come from the environment per env step and agent, and are credited to turns
(`credit`, `ppo.turn_credit`, on the same successors): "equal" puts the team reward on every
sink of the env step (each turn's path collects it once; the critic and GAE share it out),
"step_discount" gives a turn h hops from its sink along its path the reward · γ_c^h,
"per_step" gives each turn its own role's reward. An episode ends when the environment or the
horizon ends it; the horizon counts as terminal (bootstrap 0).

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
import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import multihost, ppo
from marft_jax.ppo.kl import KL_ESTIMATORS
from marft_jax.rollout.episode import Episode
from marft_jax.train.batching import TrainBatch, bucket_length, trained_masks

CREDITS = ppo.CREDITS
LEVELS = ("auto", "action", "token", "grpo")
NORMALIZE_EPS = 1e-5  # added to the batch's advantage standard deviation

# The batch whitening as one program: called eagerly on host arrays, each of its ~20 array ops
# was compiled on its own for every new batch shape (a tiny marft_a run's first iteration
# compiled 76 programs; 19 with this). Its checks (eps,
# equal shapes) are on static values and shapes, so they still run. GRPO's group whitening
# stays eager: its group and agent ids are concrete there and are checked.
_whiten = jax.jit(functools.partial(ppo.normalize, eps=NORMALIZE_EPS))


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
  """Discounts, credit and reward shaping of the advantages (`marft_jax.train.advantages`)."""

  # The advantages: "action" (one per agent turn), "token" (one per token) or "grpo" (returns
  # normalised per task and agent, no critic); "auto": the algorithm's
  level: str = "auto"
  gamma: float = 1.0  # γ in [0, 1]: the discount across env steps
  lambda_: float = 0.95  # GAE's λ across env steps, in [0, 1] (grpo: 1)
  gamma_agent: Optional[float] = None  # γ across the turns of one env step, in [0, 1]; None: gamma
  lambda_agent: Optional[float] = None  # λ across one env step's turns, in [0, 1]; None: lambda_
  gamma_token: float = 1.0  # γ between the tokens of one reply (token level), in [0, 1]
  lambda_token: float = 1.0  # λ between the tokens of one reply (token level), in [0, 1]
  # How an env step's rewards reach its turns: "equal" (the team reward on each of the step's
  # last turns, those no later turn of it sees; the critic and GAE share it out),
  # "step_discount" (a turn h hops before such a turn gets reward · credit_discount^h) or
  # "per_step" (each turn its own role's reward)
  credit: str = "equal"
  credit_discount: float = 1.0  # γ_c of credit "step_discount", in [0, 1]
  # Reward shaping before credit, AReaL's order: r' = clip((r + reward_bias) · reward_scale,
  # ±reward_clip), on the team reward (the mean over roles) and on each role's own. Finite,
  # not 0 (AReaL's MARFT math recipe: scale 10, bias −0.5).
  reward_scale: float = 1.0
  reward_bias: float = 0.0  # added before reward_scale multiplies, finite
  reward_clip: Optional[float] = None  # the shaped reward's bound, > 0; None: no clip
  # KL-in-reward β >= 0 (AReaL's kl_ctl): every trained token's reward gets −β · k(log π_old,
  # log π_base), the frozen base as reference; at the action level a turn gets its tokens'
  # sum. 0: off (a KL penalty in the loss instead: loss.kl_coef).
  kl_reward_coef: float = 0.0
  kl_reward_estimator: str = "k3"  # its estimator k: "k1", "k2" or "k3" (AReaL's release: k3)
  # Whiten the advantages over the batch (True or False); None: the algorithm's (on, except
  # grpo: its advantages are normalised per group already)
  normalize: Optional[bool] = None
  # True: the whitening runs as one jitted program, its reductions fused; False: op by op,
  # each op compiled per batch shape (slower; f32 results about 1e-7 apart). A resumed run
  # keeps the value its checkpoint was written with.
  jit_whitening: bool = True

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
    for key in ("reward_scale", "reward_bias"):
      if not math.isfinite(getattr(self, key)):
        raise ValueError(f"{key}={getattr(self, key)!r}: must be finite")
    if self.reward_scale == 0:  # a negative one is a cost to minimise; 0 is no signal
      raise ValueError("reward_scale=0.0: every shaped reward would be 0, nothing to learn from")
    if not (math.isfinite(self.kl_reward_coef) and self.kl_reward_coef >= 0):
      raise ValueError(f"kl_reward_coef={self.kl_reward_coef!r}: must be >= 0")
    if self.kl_reward_estimator not in ("k1", "k2", "k3"):
      raise ValueError(f"kl_reward_estimator={self.kl_reward_estimator!r}: use 'k1', 'k2' "
                       "or 'k3'")
    if self.reward_clip is not None and not self.reward_clip > 0:
      raise ValueError(f"reward_clip={self.reward_clip!r}: must be > 0 (or None: no clip)")


def _turns(episodes: Sequence[Episode], batch: TrainBatch):
  """Per episode, its trained turns in execution order: (row, k, env_step, agent).

  Rows were stacked episode by episode, sequence by sequence, so an episode's rows come in
  the order its turns were played (per-agent view), and spans run in order within a row
  (shared stream). A turn that sampled no token has no decision and is left out: its reward
  goes to the turns the credit rule picks among the others.
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


@dataclasses.dataclass
class Chains:
  """Every episode's turns as the padded [E, n] and [E, W] arrays of
  `ppo.turn_chain_advantages`, and where each position lives in the batch."""

  # [E, n] arrays: step, valid, length, team_reward, own_reward, done; and [E, n, n] sees:
  # sees[e, j, k], turn j's prompt holds turn k's reply (k < j, one env step)
  turn: dict
  team_turn: np.ndarray  # [E, n] bool: a team agent's turn (not an orchestrator's)
  values: np.ndarray  # [E, W] the critic's values at the positions
  places: list  # per episode: (row, column, k) of each position, in order
  kl_reward: np.ndarray  # [E, W] KL rewards at the positions (zeros without KL-in-reward)


def build_chains(batch: TrainBatch, episodes: Sequence[Episode], turns, token: bool,
                 num_team: int, agent_sees: Optional[Sequence[Sequence[bool]]],
                 kl_reward: Optional[np.ndarray] = None) -> Chains:
  """Host-side layout: each episode's turns and positions, in execution order.

  Turn j sees an earlier turn k of its env step when its agent sees k's (`agent_sees[a][b]`,
  `envs.agent_sees`: a DAG's ancestors); with None (an orchestrator, no graph), or for an
  agent outside the table, every earlier turn of the step. Action level: one position a
  turn, at `turn_value_pos` (the state before its first token); token level: one per token.
  Values come from `batch.act_old_value`.
  """
  values = np.asarray(batch.act_old_value, np.float32)
  n = bucket_length(max([len(t) for t in turns] + [1]), 8)
  lengths = [[int(batch.turn_length[r, k]) if token else 1 for r, k, _, _ in tt]
             for tt in turns]
  width = bucket_length(max([sum(x) for x in lengths] + [1]), 16)
  E = len(episodes)
  arrays = {name: np.zeros((E, n), dtype) for name, dtype in (
      ("step", np.int32), ("valid", bool), ("length", np.int32),
      ("team_reward", np.float32), ("own_reward", np.float32), ("done", bool))}
  arrays["sees"] = np.zeros((E, n, n), bool)
  sees = lambda a, b: (agent_sees is None or max(a, b) >= len(agent_sees)
                       or bool(agent_sees[a][b]))
  chain_values, places = np.zeros((E, width), np.float32), []
  team_turn = np.zeros((E, n), bool)
  extra = np.zeros((E, width), np.float32)  # per-position KL rewards
  turn_of = np.asarray(batch.act_turn)
  for e, (episode, tt) in enumerate(zip(episodes, turns)):
    own_places, position = [], 0
    for i, (row, k, step, agent) in enumerate(tt):
      for j, (_, _, earlier_step, earlier) in enumerate(tt[:i]):
        arrays["sees"][e, i, j] = earlier_step == step and sees(agent, earlier)
      step_rewards = episode.rewards[step] if step < len(episode.rewards) else [0.0]
      for name, value in (("step", step), ("valid", True),
                          ("length", lengths[e][i]),
                          ("team_reward", float(np.mean(step_rewards))),
                          ("own_reward", float(step_rewards[agent]) if agent < num_team
                           else 0.0),
                          ("done", step >= len(episode.dones) or episode.dones[step])):
        arrays[name][e, i] = value
      team_turn[e, i] = agent < num_team
      start = int(batch.turn_value_pos[row, k])
      if kl_reward is not None and not token:  # the turn's decisions' sum
        extra[e, position] = float(np.sum(kl_reward[row][turn_of[row] == k]))
      for j in range(lengths[e][i]):
        chain_values[e, position] = values[row, start + j]
        if kl_reward is not None and token:
          extra[e, position] = kl_reward[row, start + j]
        own_places.append((row, start + j, k))
        position += 1
    places.append(own_places)
  return Chains(arrays, team_turn, chain_values, places, extra)


def compute_advantages(batch: TrainBatch, episodes: Sequence[Episode],
                       config: AdvantageConfig, num_team: int,
                       groups: Optional[Sequence[int]] = None,
                       blocks: Optional[Blocks] = None,
                       agent_sees: Optional[Sequence[Sequence[bool]]] = None,
                       kl_reward: Optional[np.ndarray] = None,
                       active: Optional[np.ndarray] = None) -> TrainBatch:
  """The batch with advantages and returns filled in, from `batch.act_old_value` (the
  critic's values at rollout time, per decision; zeros for GRPO).

  Args:
    episodes: the batch's episodes, in `batch.row_episode` order.
    num_team: N, the number of team agents (an orchestrator is agent N).
    groups: GRPO only: each episode's group (episodes of one task share a group).
    blocks: a multi-process job's layout: `batch` is then this process's block of the rows
      and `episodes` its episodes (possibly none), and the whitening is the whole batch's
      (`_normalize`). None: the batch is the whole batch.
    agent_sees: who sees whom within an env step, [A][A]: agent a's prompt holds agent b's
      earlier reply (`envs.agent_sees`: a DAG's ancestors); None: every earlier turn of the
      step (a chain, an orchestrator).
    kl_reward: optional [B, T] per-decision rewards added before the backup (KL-in-reward,
      `kl_rewards`); a turn's position gets its decisions' sum at the action level.
    active: [A] bool, the adapters trained this iteration (agent-by-agent schedule); None:
      every adapter. The whitening's mean and deviation are over the turns that train
      (`batching.trained_masks`: not a `base` role's, not a frozen adapter's), which alone
      get whitened advantages (0 elsewhere): an untrained role must not shift the trained
      ones'. Every turn keeps its return, and its value serves its predecessor's bootstrap.
  """
  if config.level not in ("action", "token", "grpo"):
    raise ValueError(f"advantage.level={config.level!r}: resolve the config's algorithm "
                     "first (marft_jax.train.config.resolve)")
  turns = _turns(episodes, batch)
  grpo, token = config.level == "grpo", config.level == "token"
  # --- the chains: each episode's turns and positions, in execution order ---
  chains = build_chains(batch, episodes, turns, token, num_team, agent_sees, kl_reward)
  chains = _shaped(chains, config, grpo)
  # --- advantages along the chains, written back at the batch's positions ---
  adv, ret = _chain_advantages(chains, config, grpo)
  act_adv, act_ret, turn_adv, turn_ret, turn_val = _at_positions(batch, chains, adv, ret)
  if grpo:
    return _grpo(batch, turn_ret, chains, turns, num_team, groups)
  if not token:  # an action's advantage applies to every token of it
    act_adv = _spread(batch, turn_adv)
  # --- the batch's whitening, over the turns that train ---
  if config.normalize is None or config.normalize:  # None: on (GRPO returned above)
    act_adv, turn_adv = _whitened(batch, act_adv, turn_adv, config, blocks, active)
  return batch.replace(act_advantage=act_adv, act_return=act_ret, turn_advantage=turn_adv,
                       turn_return=turn_ret, turn_old_value=turn_val)


def _shaped(chains: Chains, config: AdvantageConfig, grpo: bool) -> Chains:
  """`chains` with its [E, n] team and own rewards shaped (`ppo.shape_rewards`) and, for
  GRPO, its [E, W] values zeroed (Monte Carlo reward-to-go along the successors: no values,
  λ = 1)."""
  shape = lambda r: np.asarray(ppo.shape_rewards(r, config.reward_scale, config.reward_bias,
                                                 config.reward_clip))
  turn = dict(chains.turn, team_reward=shape(chains.turn["team_reward"]),
              # An orchestrator's turns have no reward of their own to shape.
              own_reward=np.where(chains.team_turn, shape(chains.turn["own_reward"]), 0.0))
  values = np.zeros_like(chains.values) if grpo else chains.values
  return dataclasses.replace(chains, turn=turn, values=values)


def _at_positions(batch: TrainBatch, chains: Chains, adv: np.ndarray, ret: np.ndarray):
  """[E, W] per-position advantages and returns -> the batch's: ([B, T] advantages, [B, T]
  returns) at every position (`chains.places`; 0 elsewhere), and ([B, K] advantages,
  returns, the chains' values) at each turn's value position (`batch.turn_value_pos`)."""
  values = np.asarray(batch.act_old_value, np.float32)
  act_adv, act_ret = np.zeros_like(values), np.zeros_like(values)
  turn_adv = np.zeros(batch.turn_valid.shape, np.float32)
  turn_ret, turn_val = np.zeros_like(turn_adv), np.zeros_like(turn_adv)
  for e, places in enumerate(chains.places):
    for j, (row, p, k) in enumerate(places):
      act_adv[row, p], act_ret[row, p] = adv[e, j], ret[e, j]
      if p == batch.turn_value_pos[row, k]:
        turn_adv[row, k], turn_ret[row, k] = adv[e, j], ret[e, j]
        turn_val[row, k] = chains.values[e, j]
  return act_adv, act_ret, turn_adv, turn_ret, turn_val


def _whitened(batch: TrainBatch, act_adv: np.ndarray, turn_adv: np.ndarray,
              config: AdvantageConfig, blocks: Optional[Blocks],
              active: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """([B, T] per-decision, [B, K] per-turn) advantages whitened over the whole batch's
  trained decisions and turns (`batching.trained_masks` of `active`; 0 elsewhere),
  `_normalize` (with `blocks`, every process's rows)."""
  rows = None if blocks is None else blocks.gather(np.asarray(batch.row_episode))
  act_on, turn_on = trained_masks(batch, active)
  whiten = _whiten if config.jit_whitening else functools.partial(ppo.normalize,
                                                                    eps=NORMALIZE_EPS)
  act_adv = _normalize(act_adv, np.asarray(act_on), rows, blocks, whiten)
  turn_adv = _normalize(turn_adv, np.asarray(turn_on), rows, blocks, whiten)
  return act_adv, turn_adv


def _chain_advantages(chains: Chains, config: AdvantageConfig, grpo: bool):
  """([E, W] advantages, [E, W] returns): `ppo.turn_chain_advantages` over the episodes."""
  if not chains.places:  # nothing to train in this block (another process may have)
    return np.zeros((0, 0), np.float32), np.zeros((0, 0), np.float32)
  hops = dict(credit=config.credit, credit_discount=config.credit_discount,
              gamma=config.gamma, gamma_agent=config.gamma_agent,
              gamma_token=config.gamma_token,
              lambda_=1.0 if grpo else config.lambda_,
              lambda_agent=1.0 if grpo else config.lambda_agent,
              lambda_token=1.0 if grpo else config.lambda_token)
  t = chains.turn
  adv, ret = _vmapped_chains(t["step"], t["sees"], t["valid"], t["length"],
                             t["team_reward"], t["own_reward"], t["done"], chains.values,
                             chains.kl_reward, tuple(sorted(hops.items())))
  return np.asarray(adv), np.asarray(ret)


@functools.partial(jax.jit, static_argnums=(9,))
def _vmapped_chains(step, sees, valid, length, team, own, done, values, kl, hops):
  run = lambda *xs: ppo.turn_chain_advantages(*xs[:-1], kl_reward_t=xs[-1], **dict(hops))
  return jax.vmap(run)(step, sees, valid, length, team, own, done, values, kl)


def kl_rewards(old_logp: np.ndarray, ref_logp: np.ndarray, act_mask: np.ndarray,
               config: AdvantageConfig) -> Optional[np.ndarray]:
  """[B, T] KL-in-reward at the trained decisions (`ppo.kl_reward`: −β k(log π_old, log
  π_ref)), or None when `kl_reward_coef` is 0."""
  if not config.kl_reward_coef:
    return None
  return np.asarray(ppo.kl_reward(jnp.asarray(old_logp), jnp.asarray(ref_logp),
                                  jnp.asarray(act_mask), config.kl_reward_coef,
                                  KL_ESTIMATORS[config.kl_reward_estimator]))


def _normalize(x: np.ndarray, mask: np.ndarray, row_episode: Optional[np.ndarray],
               blocks: Optional[Blocks], whiten=_whiten) -> np.ndarray:
  """`ppo.normalize` over the batch: x' = (x − μ) / (σ + eps) on the valid entries
  (`whiten`: jitted or op by op, `AdvantageConfig.jit_whitening`).

  With `blocks`, `x` and `mask` are this process's block and `row_episode` is every block's
  (concatenated): μ and σ are the whole batch's. Each process gathers every block of `x`
  and `mask` (5 bytes a position, what the whitening reads and nothing more: kilobytes to a
  few MB a batch), puts the rows in the order one process's `make_batch` would (every
  block's episode rows in process order, then the padding rows), whitens that with the same
  call as one process, and keeps its own rows: the bits one process computes, with no
  cross-process sum in another order."""
  if blocks is None:
    return np.asarray(whiten(x, mask))
  whole_x, whole_mask = blocks.gather(x), blocks.gather(mask)
  order = np.argsort(row_episode < 0, kind="stable")  # one process's rows: padding last
  out = np.empty_like(whole_x)
  out[order] = np.asarray(whiten(whole_x[order], whole_mask[order]))
  size = x.shape[0]
  return out[blocks.index * size:(blocks.index + 1) * size]


def _spread(batch: TrainBatch, per_turn: np.ndarray) -> np.ndarray:
  """[B, K] per-turn values -> [B, T] on each turn's decisions (0 elsewhere)."""
  turn = np.asarray(batch.act_turn)
  picked = np.take_along_axis(per_turn, np.maximum(turn, 0), axis=1)
  return np.where(turn >= 0, picked, 0.0).astype(np.float32)


def _grpo(batch, turn_ret, chains, turns, num_team, groups):
  """GRPO: each turn's reward-to-go normalised within its group (the G rollouts of one task)
  and its agent (`ppo.agent_group_normalize`)."""
  if groups is None:
    raise ValueError("GRPO needs each episode's group (the rollouts of one task)")
  group_of = np.zeros(batch.turn_valid.shape, np.int32)
  for e, tt in enumerate(turns):
    for row, k, _, _ in tt:
      group_of[row, k] = groups[e]
  num_agents = int(max(num_team, np.max(batch.turn_agent) + 1))
  turn_adv = np.asarray(ppo.agent_group_normalize(
      turn_ret, batch.turn_valid, group_of, np.maximum(batch.turn_agent, 0),
      int(max(groups, default=0)) + 1, num_agents))
  return batch.replace(act_advantage=_spread(batch, turn_adv), turn_advantage=turn_adv,
                       turn_return=turn_ret)

"""A team split over several backbones: each role on the base model it names
(`team.roles.<role>.backbone`, `model.backbones`), trained together in one run.

A team on one backbone never comes here (`train.run` chooses): it runs as it always has.
With several:

  rollout     `rollout.rollout_backbones`: text between backbones, one sampler call per
              backbone a turn, each turn's own token ids kept.
  batch       one batch of the whole team (host NumPy, team-wide agent and adapter ids), so
              that the advantages are computed once for the whole team: the chain and DAG
              credit are the same functions as on one backbone.
  per backbone `sub_batch` takes its roles' rows, with its own pad id and its local agent and
              adapter ids; its critic values them and its learner gives π_old (both read
              back into the team's batch before the advantages), then one jitted update of
              its own, over its rows, with its adapters' share of the agent-by-agent schedule.

State: {backbone name: `update.TrainState`} (its adapters, its critic, their optimizer
states), checkpointed as one tree. A per-agent critic (`critic.mode` 'per_agent_head' or
'per_agent_lora') lives on each backbone, for its roles: a successor's first-token value,
read at its own row, comes from the critic on its own backbone. A shared critic lives on
`critic.backbone` alone (its state's critic; the others' are None) and values every role's
turns re-tokenized in its own vocabulary (`shared_critic`): a successor's first-token value
is then that critic's at the successor's prompt. It trains in an update of its own, over
every role's turns; the backbones' updates train their policies alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import multihost, sharding
from marft_jax.envs.profiles import adapter_index
from marft_jax.rollout import Backbone, rollout_backbones
from marft_jax.train import shared_critic
from marft_jax.train.advantages import compute_advantages, kl_rewards
from marft_jax.train.batching import PADDING, TrainBatch, make_batch, padding_fields
from marft_jax.train.batching import per_row_adapters
from marft_jax.train.build.learner import Learner, make_learner
from marft_jax.train.build.model import Model
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.sections import MAIN_BACKBONE
from marft_jax.train.config.teams import declared
from marft_jax.train.update import TrainState, prepare


@dataclasses.dataclass(frozen=True)
class Split:
  """Which backbone each agent and adapter of a team runs on, and its index there.

  names: the backbones, main first (`TrainConfig.used_backbones`).
  agent_backbone: [agents] each agent id's backbone (an index into `names`).
  adapter_backbone: [A] each team-wide adapter id's backbone.
  """

  names: tuple[str, ...]
  agent_backbone: tuple[int, ...]
  adapter_backbone: tuple[int, ...]

  def agents(self, b: int) -> tuple[int, ...]:
    """The team-wide agent ids on backbone `b`, in order."""
    return tuple(a for a, x in enumerate(self.agent_backbone) if x == b)

  def adapters(self, b: int) -> tuple[int, ...]:
    """The team-wide adapter ids on backbone `b`, in order (its stacked adapters)."""
    return tuple(a for a, x in enumerate(self.adapter_backbone) if x == b)

  @property
  def adapter_local(self) -> tuple[int, ...]:
    """[A] each team-wide adapter id's index among its backbone's adapters."""
    return tuple(self.adapters(b).index(a) for a, b in enumerate(self.adapter_backbone))

  @property
  def agent_local(self) -> tuple[int, ...]:
    """[agents] each agent id's index among its backbone's agents."""
    return tuple(self.agents(b).index(a) for a, b in enumerate(self.agent_backbone))


def split_team(config: TrainConfig, team) -> Split:
  """The `Split` of `team` (`build.team.build_team`'s profiles, in order: a chain or a DAG)."""
  names = config.used_backbones
  roles, _ = declared(config.team, config.task.name)
  agent_backbone = tuple(names.index(r.backbone or MAIN_BACKBONE) for r in roles)
  adapter_backbone = [-1] * config.num_adapters
  for agent, b in enumerate(agent_backbone):
    adapter = adapter_index(team, agent)
    if adapter >= 0:
      adapter_backbone[adapter] = b
  return Split(names, agent_backbone, tuple(adapter_backbone))


# --- rollout -------------------------------------------------------------------------------


def player(models: Mapping[str, Model], policies, team, structure, split: Split,
           weights: Mapping[str, tuple]):
  """`fn(envs, rng, settings, policy_version=0, cancel=None)`: one rollout of `team` on its
  backbones (sampler weights `weights`: `run.rollout_weights`) with `policies`
  ({backbone: adapters}; None: every agent the base)."""
  backbones = [Backbone(*weights[name], models[name].tokenizer,
                        None if policies is None else policies[name]) for name in split.names]

  def play_all(envs, rng, settings, policy_version=0, cancel=None):
    return rollout_backbones(envs, team, structure, backbones, split.agent_backbone,
                             split.adapter_local, rng, config=settings,
                             policy_version=policy_version, cancel=cancel)
  return play_all


# --- batches -------------------------------------------------------------------------------


def row_backbones(episodes, split: Split) -> np.ndarray:
  """[R] the backbone of each row `make_batch(episodes)` makes (one turn a row: its agent's)."""
  return np.asarray([split.agent_backbone[s.spans[0].agent] for e in episodes
                     for s in e.sequences], np.int32)


def _lookup(ids: np.ndarray, table: Sequence[int]) -> np.ndarray:
  """`ids` mapped through `table`, -1 kept."""
  table = np.asarray(list(table) + [-1], np.int32)  # index -1: the appended -1
  return table[np.asarray(ids)]


def sub_batch(batch: TrainBatch, rows: np.ndarray, num_rows: int, pad_id: int,
              split: Split) -> TrainBatch:
  """The team batch's `rows` (one backbone's), padded to `num_rows` rows, as that backbone's
  learner reads them: its pad id in every padding position, its local adapter and agent ids
  (`Split.adapter_local`, `Split.agent_local`: its stacked adapters', its critic heads')."""
  if len(rows) > num_rows:
    raise ValueError(f"{len(rows)} rows for a backbone batch of {num_rows}")
  B, T = batch.tokens.shape
  pad = padding_fields(num_rows - len(rows), T, batch.turn_valid.shape[1],
                       batch.act_positions.shape[1], pad_id)
  fields = {name: np.concatenate([np.asarray(getattr(batch, name))[rows], pad[name]])
            for name in PADDING}
  fields["tokens"] = np.where(fields["mask"], fields["tokens"], pad_id).astype(np.int32)
  fields["adapter_ids"] = _lookup(fields["adapter_ids"], split.adapter_local)
  for name in ("act_agent", "turn_agent"):
    fields[name] = _lookup(fields[name], split.agent_local)
  return per_row_adapters(TrainBatch(**fields))


def scatter_rows(into: np.ndarray, rows: np.ndarray, values) -> np.ndarray:
  """`into` with its `rows` set to the first len(rows) rows of `values` (a backbone's)."""
  into = np.array(into)
  into[rows] = np.asarray(values)[:len(rows)]
  return into


# --- learning ------------------------------------------------------------------------------


def learners(config: TrainConfig, models: Mapping[str, Model], split: Split, mesh,
             policy_optimizer, critic_optimizer, turns_per_agent: int,
             state_shardings: Mapping[str, Any]
             ) -> tuple[list[Learner], Optional[shared_critic.SharedCritic]]:
  """(an `Learner` per backbone, in `split.names` order; the shared critic's
  learner, or None: per-agent critics train in their backbones' updates). `turns_per_agent`:
  the rows one agent fills in an episode (its turns: one per env step); `state_shardings`:
  each backbone's state's (`lora.follow_adapters`), kept by its update."""
  rows = lambda agents: config.rollout.num_envs * turns_per_agent * len(agents)
  critic = shared_critic.make_shared_critic(
      config, split, models, mesh, critic_optimizer, rows(split.agent_backbone),
      state_shardings[config.critic_backbone])
  policy_only = lambda s: s.replace(critic=None, critic_opt=None) if critic else s
  return [make_learner(
      config, name, models[name], len(split.adapters(b)), rows(split.agents(b)), mesh,
      policy_optimizer, critic_optimizer, policy_only(state_shardings[name]),
      with_critic=critic is None)
      for b, name in enumerate(split.names)], critic


def learn(states, kept, iteration, key, *, config: TrainConfig, split: Split,
          learners: Sequence[Learner], mesh, envs, num_roles: int, agent_sees,
          reply_budgets, active: np.ndarray,
          critic: Optional[shared_critic.SharedCritic] = None):
  """One update of every backbone from the team's `kept` episodes.

  The team's batch is valued and scored by each backbone on its rows (or valued by the
  shared `critic` on every row), the advantages are computed once over the whole team (as on
  one backbone), then each backbone updates over its rows, and the shared critic over every
  row. Returns (new states, the backbones' metrics (`merge_metrics`), the team's batch, the
  KL rewards or None)."""
  batch = jax.tree.map(np.asarray, make_batch(
      kept, 0, reply_budgets=reply_budgets, row_length_step=config.optimizer.row_length_step))
  owner = row_backbones(kept, split)
  placed = lambda b: jax.device_put(b, sharding.batch_shardings(mesh, b))
  parts, values, old_logp, ref_logp = _score_parts(states, batch, owner, learners, split,
                                                    config, placed)
  if critic is not None:
    critic_rows, critic_extras, values = _value_shared(critic, states[critic.name].critic,
                                                       kept, batch, owner, placed)
  batch = batch.replace(act_old_value=values)
  with_ref = config.advantage.kl_reward_coef > 0
  kl = kl_rewards(old_logp, ref_logp, batch.act_mask, config.advantage) if with_ref else None
  groups = [envs.group(e.env_index) for e in kept]
  batch = compute_advantages(batch, kept, config.advantage, num_roles, groups,
                             agent_sees=agent_sees, kl_reward=kl, active=active)
  states, metrics = _update_parts(states, batch, parts, learners, split, config, iteration,
                                  active, key, placed, policy_only=critic is not None)
  merged = merge_metrics(metrics, split)
  if critic is not None:
    states[critic.name], critic_metrics = _train_critic(
        critic, states[critic.name], critic_rows, critic_extras, batch,
        config.advantage.level == "token", placed, jax.random.fold_in(key, len(learners)))
    merged = {k: v for k, v in merged.items()  # the policy updates' critic metrics: zeros
              if not k.endswith(("value_loss", "critic_grad_norm"))}
    merged.update(critic_metrics)
    merged["nonfinite"] += critic_metrics["critic_nonfinite"]
  return states, merged, batch, kl


def _score_parts(states, batch: TrainBatch, owner: np.ndarray, learners: Sequence[Learner],
                 split: Split, config: TrainConfig, placed):
  """Each backbone's rows of the team `batch` through its learner: ([(rows, its sub-batch,
  its `Extras`)] per backbone, [B, T] the team's critic values at rollout time (per-agent
  critics; zeros else), [B, T] π_old's log-probs, [B, T] the reference's or None)."""
  read = multihost.to_host
  parts, old_logp, ref_logp = [], np.zeros_like(batch.act_behaviour_logp), None
  values = np.zeros_like(batch.act_old_value)
  with_ref = config.advantage.kl_reward_coef > 0
  for b, learner in enumerate(learners):
    rows = np.flatnonzero(owner == b)
    sub = sub_batch(batch, rows, learner.num_rows, learner.pad_id, split)
    state, params = states[learner.name], learner.model.params
    extras = prepare(params, state.policy, placed(sub), learner.model.config, config.loss,
                     None if learner.critic_hidden is None else
                     functools.partial(learner.critic_hidden, state.critic),
                     config.optimizer.minibatches, with_ref=with_ref)
    if learner.old_values is not None:
      values = scatter_rows(values, rows, read(learner.old_values(state.critic, params,
                                                                  placed(sub), extras)))
    old_logp = scatter_rows(old_logp, rows, read(extras.old_logp))
    if with_ref:
      ref = np.zeros_like(old_logp) if ref_logp is None else ref_logp
      ref_logp = scatter_rows(ref, rows, read(extras.ref_logp))
    parts.append((rows, sub, extras))
  return parts, values, old_logp, ref_logp


def _update_parts(states, batch: TrainBatch, parts, learners: Sequence[Learner], split: Split,
                  config: TrainConfig, iteration: int, active: np.ndarray, key, placed,
                  policy_only: bool) -> tuple[dict, list[dict]]:
  """Each backbone's jitted update over its rows, with the team's advantages filled in
  (`policy_only`: its policy alone, the shared critic training apart). (the new states,
  each backbone's metrics)"""
  warm = jnp.asarray(iteration >= config.critic.warmup_iterations)
  states, metrics = dict(states), []
  for b, (learner, (rows, sub, extras)) in enumerate(zip(learners, parts)):
    filled = sub.replace(**{name: scatter_rows(getattr(sub, name), np.arange(len(rows)),
                                               np.asarray(getattr(batch, name))[rows])
                            for name in _ADVANTAGE_FIELDS})
    mine = np.asarray(active)[list(split.adapters(b))]
    state = states[learner.name]
    if policy_only:  # the shared critic trains apart, on every backbone's turns
      state = state.replace(critic=None, critic_opt=None)
    new, m = learner.update(state, learner.model.params, placed(filled), extras,
                            jnp.asarray(mine), warm, jax.random.fold_in(key, b))
    if policy_only:
      new = new.replace(critic=states[learner.name].critic,
                        critic_opt=states[learner.name].critic_opt)
    states[learner.name] = new
    metrics.append({k: float(v) for k, v in m.items()})
  return states, metrics


def _value_shared(critic: shared_critic.SharedCritic, params, kept, batch: TrainBatch,
                  owner: np.ndarray, placed):
  """The shared critic (parameters `params`) over every turn of the team `batch`: (its
  `CriticBatch`, its extras, [B, T] the team's values at rollout time)."""
  rows = critic.batch(kept, batch, owner)
  extras = critic.extras(params, placed(rows))
  values = critic.values(params, critic.model.params, placed(rows), extras)
  return rows, extras, shared_critic.team_values(multihost.to_host(values), rows, batch)


def _train_critic(critic: shared_critic.SharedCritic, state: TrainState, rows, extras, batch,
                  token_level: bool, placed, key) -> tuple[TrainState, dict]:
  """The shared critic's update over every turn (`rows`, with the team `batch`'s targets):
  (its backbone's state with the new critic, its metrics, with the turns it could not read
  to the end, `CriticBatch.unaligned`)."""
  filled = shared_critic.with_targets(rows, batch, token_level)
  new, new_opt, metrics = critic.update(state.critic, state.critic_opt, critic.model.params,
                                        placed(filled), extras, key)
  return (state.replace(critic=new, critic_opt=new_opt),
          {**{k: float(v) for k, v in metrics.items()},
           "critic/unaligned_turns": float(np.sum(rows.unaligned))})


# The fields `compute_advantages` fills in.
_ADVANTAGE_FIELDS = ("act_advantage", "act_return", "act_old_value", "turn_advantage",
                     "turn_return", "turn_old_value")
# Metrics that count (summed over the backbones) or bound (their maximum); the others are
# averaged.
_SUMMED = ("nonfinite", "kl_skipped", "minibatches_trained")


def merge_metrics(per_backbone: Sequence[dict], split: Split) -> dict:
  """The backbones' update metrics as one update's: counts summed, maxima maximised, the
  rest averaged, each backbone's also under "backbone/<name>/"; a backbone's
  "adapter<a>/..." named by the team-wide adapter id."""
  out = {}
  renamed = []
  for b, metrics in enumerate(per_backbone):
    adapters = split.adapters(b)
    mine = {}
    for key, value in metrics.items():
      if key.startswith("adapter"):
        local, rest = key[len("adapter"):].split("/", 1)
        key = f"adapter{adapters[int(local)]}/{rest}"
        out[key] = value
      mine[key] = value
      out[f"backbone/{split.names[b]}/{key}"] = value
    renamed.append(mine)
  for key in renamed[0]:
    if key.startswith("adapter"):
      continue
    values = [m[key] for m in renamed if key in m]
    out[key] = (sum(values) if key in _SUMMED else max(values) if "max" in key
                else float(np.mean(values)))
  return out

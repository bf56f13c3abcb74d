"""A team split over several backbones (issue 41): each role on the base model it names
(`team.roles.<role>.backbone`, `model.backbones`), trained together in one run.

A team on one backbone never comes here: `loop` runs it as it always has. With several:

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

from marft_jax import lora as lora_lib
from marft_jax import multihost, sharding
from marft_jax.envs.profiles import adapter_index
from marft_jax.rollout import Backbone, rollout_backbones
from marft_jax.train import assembly
from marft_jax.train import critic as critic_lib
from marft_jax.train import shared_critic, teams
from marft_jax.train.advantages import compute_advantages, kl_rewards
from marft_jax.train.batching import PADDING, TrainBatch, make_batch, padding_fields
from marft_jax.train.batching import per_row_adapters
from marft_jax.train.config import MAIN_BACKBONE, TrainConfig
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


def check_backbones(config: TrainConfig) -> None:
  """Refuses, naming the key, what a team split over several backbones cannot run (of a
  resolved config; one backbone: nothing). Replies pass between backbones as text, so each
  turn is its own sequence (the per-agent view); an adapter, a critic and an orchestrator
  live on one backbone each."""
  used = config.used_backbones
  if len(used) == 1:
    return
  where = f"with the roles on backbones {used}"
  if config.rollout.context_mode != "per_agent":  # named first: the split is the file's choice
    raise ValueError(f"model.backbones={sorted(config.model.backbones)} {where}, but "
                     f"rollout.context_mode={config.rollout.context_mode!r} (algorithm="
                     f"{config.algorithm!r}): one token stream cannot hold two vocabularies; "
                     "use an algorithm of the per-agent view")
  if config.team.graph == "orchestrator":
    raise ValueError(f"team.graph='orchestrator' {where}: not supported (a chain or a DAG)")
  if config.team.shared_adapter:
    raise ValueError(f"team.shared_adapter=True {where}: an adapter fits one backbone")
  by_backbone = config.role_backbones
  shared = sorted({by_backbone[r.name] for r in config.team.roles if r.adapter == "shared"})
  if len(shared) > 1:
    raise ValueError(f"team.roles: adapter='shared' on roles of backbones {shared}: an "
                     "adapter fits one backbone (share it within one)")
  for name in used:
    roles = [r for r in config.team.roles if (r.backbone or MAIN_BACKBONE) == name]
    if all(r.adapter == "base" for r in roles):
      raise ValueError(f"team.roles {[r.name for r in roles]}: every role on backbone "
                       f"{name!r} has adapter='base': nothing on it would train")
  unsupported = (("init_from", config.init_from, ""),
                 ("reward.judge", config.reward.judge, False))
  for key, value, off in unsupported:
    if value != off:
      raise ValueError(f"{key}={value!r} {where}: not supported yet (issue 41)")


def split_team(config: TrainConfig, team) -> Split:
  """The `Split` of `team` (`assembly.build_team`'s profiles, in order: a chain or a DAG)."""
  names = config.used_backbones
  roles, _ = teams.declared(config.team, config.task.name)
  agent_backbone = tuple(names.index(r.backbone or MAIN_BACKBONE) for r in roles)
  adapter_backbone = [-1] * config.num_adapters
  for agent, b in enumerate(agent_backbone):
    adapter = adapter_index(team, agent)
    if adapter >= 0:
      adapter_backbone[adapter] = b
  return Split(names, agent_backbone, tuple(adapter_backbone))


def load_models(config: TrainConfig):
  """The run's base: one `assembly.Model` for a team on one backbone (as `assembly.load`),
  else {name: Model} of every backbone a role runs on."""
  names = config.used_backbones
  if len(names) == 1:
    return assembly.load(config)
  return {name: assembly.load(config, name) for name in names}


def role_bases(config: TrainConfig) -> dict[str, tuple[str, str]]:
  """{role: (its backbone, that backbone's source)} of the config's team."""
  roles, _ = teams.declared(config.team, config.task.name)
  return {r.name: (r.backbone or MAIN_BACKBONE,
                   config.model.backbone(r.backbone or MAIN_BACKBONE).source) for r in roles}


# --- state ---------------------------------------------------------------------------------


def init_states(config: TrainConfig, models: Mapping[str, assembly.Model], split: Split,
                policy_optimizer, critic_optimizer) -> dict[str, TrainState]:
  """{backbone: its fresh `TrainState`}: the adapters of its roles (`config.lora`), its
  per-agent critic for its agents (a shared critic: on `config.critic_backbone` alone), their
  optimizer states. Keys fold in the backbone's index, so two backbones of one shape start
  from different adapters."""
  critic_settings = assembly.critic_config(config)
  shared = critic_settings is not None and critic_settings.mode == "shared"
  states = {}
  for b, name in enumerate(split.names):
    key = jax.random.fold_in(jax.random.key(config.seed), 1000 + b)
    model_config = models[name].config
    policy = lora_lib.init_adapters(config.lora, model_config, jax.random.fold_in(key, 1),
                                    len(split.adapters(b)))
    no_critic = critic_settings is None or (shared and name != config.critic_backbone)
    critic = None if no_critic else critic_lib.init_critic(
        critic_settings, model_config, len(split.agents(b)), jax.random.fold_in(key, 2))
    states[name] = TrainState(
        policy=policy, critic=critic, policy_opt=policy_optimizer.init(policy),
        critic_opt=None if critic is None else critic_optimizer.init(critic),
        step=jnp.zeros((), jnp.int32))
  return states


def new_states(config: TrainConfig, models: Mapping[str, assembly.Model]
               ) -> dict[str, TrainState]:
  """The state a run of `config` starts from (or a checkpoint of it restores into)."""
  team, _ = assembly.build_team(config)
  return init_states(config, models, split_team(config, team), *assembly.optimizers(config))


# --- rollout -------------------------------------------------------------------------------


def play(policies: Mapping[str, Any], rng, version: int, *, envs, team, structure,
         weights: Mapping[str, tuple], models: Mapping[str, assembly.Model], split: Split,
         settings, cancel=None):
  """One rollout of the team (`rollout_backbones`), each backbone with its adapters
  (`policies`: {backbone: adapters}, policy version `version`; `cancel`: `rollout`'s)."""
  return player(models, policies, team, structure, split, weights)(envs, rng, settings,
                                                                   version, cancel)


def player(models: Mapping[str, assembly.Model], policies, team, structure, split: Split,
           weights: Mapping[str, tuple]):
  """`fn(envs, rng, settings, policy_version=0, cancel=None)`: one rollout of `team` on its
  backbones (sampler weights `weights`: `assembly.rollout_model`'s) with `policies`
  ({backbone: adapters}; None: every agent the base)."""
  backbones = [Backbone(*weights[name], models[name].tokenizer,
                        None if policies is None else policies[name]) for name in split.names]

  def play_all(envs, rng, settings, policy_version=0, cancel=None):
    return rollout_backbones(envs, team, structure, backbones, split.agent_backbone,
                             split.adapter_local, rng, config=settings,
                             policy_version=policy_version, cancel=cancel)
  return play_all


def evaluation_player(config: TrainConfig, models: Mapping[str, assembly.Model], policies,
                      team, structure, weights: Optional[Mapping[str, tuple]] = None):
  """`player` for `evaluate.play`: the sampler's `weights` ({backbone: its
  `assembly.rollout_model`}; None: made here)."""
  if weights is None:
    weights = {name: assembly.rollout_model(m, config, name) for name, m in models.items()}
  return player(models, policies, team, structure, split_team(config, team), weights)


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


def learners(config: TrainConfig, models: Mapping[str, assembly.Model], split: Split, mesh,
             policy_optimizer, critic_optimizer, turns_per_agent: int,
             state_shardings: Mapping[str, Any]
             ) -> tuple[list[assembly.Learner], Optional[shared_critic.SharedCritic]]:
  """(an `assembly.Learner` per backbone, in `split.names` order; the shared critic's
  learner, or None: per-agent critics train in their backbones' updates). `turns_per_agent`:
  the rows one agent fills in an episode (its turns: one per env step); `state_shardings`:
  each backbone's state's (`lora.follow_adapters`), kept by its update."""
  rows = lambda agents: config.rollout.num_envs * turns_per_agent * len(agents)
  critic = shared_critic.make_shared_critic(
      config, split, models, mesh, critic_optimizer, rows(split.agent_backbone),
      state_shardings[config.critic_backbone])
  policy_only = lambda s: s.replace(critic=None, critic_opt=None) if critic else s
  return [assembly.make_learner(
      config, name, models[name], len(split.adapters(b)), rows(split.agents(b)), mesh,
      policy_optimizer, critic_optimizer, policy_only(state_shardings[name]),
      with_critic=critic is None)
      for b, name in enumerate(split.names)], critic


def learn(states, kept, iteration, key, *, config: TrainConfig, split: Split,
          learners: Sequence[assembly.Learner], mesh, envs, num_roles: int, agent_sees,
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
  if critic is not None:
    critic_rows, critic_extras, values = _value_shared(critic, states[critic.name].critic,
                                                       kept, batch, owner, placed)
  batch = batch.replace(act_old_value=values)
  kl = kl_rewards(old_logp, ref_logp, batch.act_mask, config.advantage) if with_ref else None
  groups = [envs.group(e.env_index) for e in kept]
  batch = compute_advantages(batch, kept, config.advantage, num_roles, groups,
                             agent_sees=agent_sees, kl_reward=kl, active=active)
  warm = jnp.asarray(iteration >= config.critic.warmup_iterations)
  states, metrics = dict(states), []
  for b, (learner, (rows, sub, extras)) in enumerate(zip(learners, parts)):
    filled = sub.replace(**{name: scatter_rows(getattr(sub, name), np.arange(len(rows)),
                                               np.asarray(getattr(batch, name))[rows])
                            for name in _ADVANTAGE_FIELDS})
    mine = np.asarray(active)[list(split.adapters(b))]
    state = states[learner.name]
    if critic is not None:  # the shared critic trains below, on every backbone's turns
      state = state.replace(critic=None, critic_opt=None)
    new, m = learner.update(state, learner.model.params, placed(filled), extras,
                            jnp.asarray(mine), warm, jax.random.fold_in(key, b))
    if critic is not None:
      new = new.replace(critic=states[learner.name].critic,
                        critic_opt=states[learner.name].critic_opt)
    states[learner.name] = new
    metrics.append({k: float(v) for k, v in m.items()})
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


def export(checkpointer, step: int, states: Mapping[str, TrainState], config: TrainConfig,
           split: Split) -> None:
  """Every backbone's adapters as PEFT folders, one per role (named as on one backbone),
  each on its own base (its `adapter_config.json`'s base_model_name_or_path)."""
  names = teams.adapter_names(config.team, config.task.name)
  groups = []
  for b, name in enumerate(split.names):
    adapters = multihost.to_host(states[name].policy)
    groups.append((adapters, [names[a] for a in split.adapters(b)],
                   config.model.backbone(name).source))
  if multihost.is_primary():
    checkpointer.export_peft_groups(step, groups)

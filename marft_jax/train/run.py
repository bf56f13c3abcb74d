"""A team's run on its backbones, one or several: the one place that tells the two apart.

A team on one base model is the one-part case of a team on several (`train.backbones`): each
function here takes the config and decides, by `several(config)`, which it builds. Nothing
outside this module asks. The shapes a caller sees stay the ones old checkpoints and user code
pin:

  model   a `build.model.Model` for a team on one backbone, {backbone: Model} for several
  state   a `TrainState` for one backbone (the tree of every checkpoint of such a run), or
          {backbone: TrainState}
  policy  the stacked `lora.Adapters`, or {backbone: Adapters}

`parts(config, tree)` gives any of these as {backbone: part}, and `joined(config, parts)` the
caller's shape back, so a function that loops over the parts serves both.

`build(config, mesh, model, resuming)` makes a training run's `Run` (its team, environments,
rollout, learner and exports) and the state it starts from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from marft_jax import envs as envs_lib
from marft_jax import lora as lora_lib
from marft_jax import multihost, sharding
from marft_jax.configs import to_config_dict
from marft_jax.rollout import reply_budgets, rollout
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train import backbones, local_batch
from marft_jax.train.advantages import Blocks, compute_advantages, kl_rewards
from marft_jax.train.batching import make_batch, per_row_adapters
from marft_jax.train.build import learner as learner_lib
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import model as model_lib
from marft_jax.train.build.envs import rollout_settings
from marft_jax.train.build.model import (Model, build_judge, learner_model, place_model,
                                         rollout_model)
from marft_jax.train.build.team import build_team, num_agents
from marft_jax.train.config.saved import as_recorded
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.config.teams import adapter_names
from marft_jax.train.update import TrainState, prepare


# --- the choice ------------------------------------------------------------------------------


def several(config: TrainConfig) -> bool:
  """Whether the team runs on several backbones (`TrainConfig.used_backbones`)."""
  return len(config.used_backbones) > 1


def parts(config: TrainConfig, tree) -> dict:
  """{backbone: part} of a model, state or policy in the caller's shape (module docstring)."""
  return dict(tree) if several(config) else {config.used_backbones[0]: tree}


def joined(config: TrainConfig, by_backbone: Mapping[str, Any]):
  """`parts`' inverse: one backbone's part itself, or the mapping."""
  return dict(by_backbone) if several(config) else by_backbone[config.used_backbones[0]]


# --- models ----------------------------------------------------------------------------------


def load_models(config: TrainConfig, given=None):
  """The run's base (`Model`, or {backbone: Model}): `given` checked against the backbones the
  roles run on (`config.used_backbones`), or loaded from `config.model`."""
  names = config.used_backbones
  if given is None:
    return joined(config, {name: model_lib.load(config, name) for name in names})
  if isinstance(given, Model):
    if len(names) > 1:
      raise ValueError(f"model: one base for a team on the backbones {list(names)}: pass "
                       "{name: Model} for each")
    return given
  if sorted(given) != sorted(names):
    raise ValueError(f"model: bases for {sorted(given)}, but the roles run on the backbones "
                     f"{sorted(names)}")
  return joined(config, dict(given))


def place(config: TrainConfig, model, mesh):
  """`model` with each base's weights split over `mesh`."""
  return joined(config, {n: place_model(m, mesh) for n, m in parts(config, model).items()})


def rollout_weights(config: TrainConfig, model):
  """The sampler's copy of each base (`build.model.rollout_model`): (params, model config),
  or {backbone: (params, model config)}."""
  return joined(config, {n: rollout_model(m, config, n) for n, m in parts(config, model).items()})


# --- state -----------------------------------------------------------------------------------


def new_state(config: TrainConfig, model):
  """The state a run of `config` starts from (or a checkpoint of it restores into): each
  backbone's adapters (`init_from`'s, if given), its critic for its agents (a shared critic
  on `config.critic_backbone` alone) and their optimizer states. One backbone's keys are the
  seed's own; several fold in each backbone's index, so two backbones of one shape start
  from different adapters."""
  team, structure = build_team(config)
  optimizers = learner_lib.optimizers(config)
  seed = jax.random.key(config.seed)
  if not several(config):
    return learner_lib.init_state(config, model, config.num_adapters,
                                  num_agents(team, structure), seed, *optimizers)
  split = backbones.split_team(config, team)
  shared = config.uses_critic and config.critic.mode == "shared"
  return {name: learner_lib.init_state(
      config, model[name], len(split.adapters(b)), len(split.agents(b)),
      jax.random.fold_in(seed, 1000 + b), *optimizers,
      with_critic=not (shared and name != config.critic_backbone))
      for b, name in enumerate(split.names)}


def policy(config: TrainConfig, state):
  """The adapters a rollout samples with, in the caller's shape."""
  return joined(config, {n: s.policy for n, s in parts(config, state).items()})


def critic(config: TrainConfig, state):
  """The critics' parameters (None without one), in the caller's shape."""
  return joined(config, {n: s.critic for n, s in parts(config, state).items()})


# --- rollout and export ----------------------------------------------------------------------


def player(config: TrainConfig, model, team, structure, weights, rows=None) -> Callable:
  """`fn(envs, policy, rng, settings, version=0, cancel=None)`: one rollout of every
  environment by `team` with `policy` (None: every agent the base) through the sampler's
  `weights` (`rollout_weights`), at policy version `version`; `rows`: this process's rows
  (`multihost.ProcessRows`, one backbone only)."""
  if not several(config):
    params, model_config = weights

    def play_one(envs, policy, rng, settings, version=0, cancel=None):
      return rollout(envs, team, structure, params, model_config, model.tokenizer, rng,
                     lora=policy, config=settings, policy_version=version, rows=rows,
                     cancel=cancel)
    return play_one
  split = backbones.split_team(config, team)

  def play_several(envs, policy, rng, settings, version=0, cancel=None):
    return backbones.player(model, policy, team, structure, split, weights)(
        envs, rng, settings, version, cancel)
  return play_several


def role_policy(config: TrainConfig, team, model, policy, weights, agent: int) -> tuple:
  """(the base, its adapters, `agent`'s adapter index among them or -1, the sampler's
  weights) that agent `agent` of `team` runs on."""
  adapter = envs_lib.adapter_index(team, agent)
  if not several(config):
    return model, policy, adapter, weights
  split = backbones.split_team(config, team)
  name = split.names[split.agent_backbone[agent]]
  local = split.adapter_local[adapter] if adapter >= 0 else -1
  return model[name], policy[name], local, weights[name]


def export(checkpointer, step: int, state, config: TrainConfig) -> None:
  """Every backbone's adapters as PEFT folders, one per adapter (named by `adapter_names`),
  each on its own base (its `adapter_config.json`'s base_model_name_or_path). A collective:
  every process takes part, process 0 writes."""
  names = adapter_names(config.team, config.task.name)
  split = backbones.split_team(config, build_team(config)[0]) if several(config) else None
  groups = []
  for b, (name, part) in enumerate(parts(config, state).items()):
    mine = names if split is None else [names[a] for a in split.adapters(b)]
    groups.append((multihost.to_host(part.policy), mine, config.model.backbone(name).source))
  if multihost.is_primary():
    checkpointer.export_peft_groups(step, groups)


# --- a training run --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
  """What a training run holds besides its state, built once from the config (`build`)."""

  config: TrainConfig
  model: Any  # the bases in the learner's numerics (`learner_model`), in the caller's shape
  config_dict: dict  # `config.saved.as_recorded(config)`: saved in checkpoints and config.json
  team: tuple  # the roles' profiles
  envs: Any  # `envs.EnvBatch`: this process's environments
  judge: Optional[rewards_lib.Judge]
  play: Callable  # (policy, key, version, weights=, cancel=) -> `rollout.RolloutResult`
  # The sampler's (params, model config) on the learner's mesh; a split team: {backbone: ...};
  # None with a sampler sub-mesh (`mesh.sampler_devices`), whose copy `make_weights` makes.
  weights: Any
  make_weights: Callable[[], Any]  # the sampler's weights made anew (`rollout_weights`)
  learn: Callable  # (state, kept episodes, iteration, key) -> (state, metrics)
  export: Callable  # (checkpointer, step, state): the PEFT exports


def build(config: TrainConfig, mesh, model, resuming: bool) -> tuple[Run, Any]:
  """The run's pieces and the state it starts from (placed on the mesh; `resuming`: a
  template the checkpoint restores into, `init_from` not read)."""
  start = dataclasses.replace(config, init_from="") if resuming else config
  models = {n: learner_model(m, config.model) for n, m in parts(config, model).items()}
  state = new_state(start, joined(config, models))
  shardings = jax.tree.map(lambda s: lora_lib.follow_adapters(mesh, s), parts(config, state),
                           is_leaf=lambda s: isinstance(s, TrainState))
  state = jax.device_put(state, joined(config, shardings))
  if several(config):
    return _build_several(config, mesh, models, shardings), state
  return _build_one(config, mesh, *models.values(), *shardings.values()), state


def _build_one(config: TrainConfig, mesh, model: Model, state_shardings) -> Run:
  """`build`'s run of a team on one backbone, in one process or several."""
  team, structure = build_team(config)
  make_weights = functools.partial(rollout_model, model, config)
  # With a sampler sub-mesh its copy of the base lives there alone (`loop._start_async`): a
  # held-out evaluation on the learner's mesh converts the base for its own call (a copy of
  # the weights while it runs, where the learner's devices would hold one for the whole run).
  weights = None if config.mesh.sampler_devices else make_weights()
  judge = build_judge(config, model, weights)  # none with a sub-mesh
  policy_optimizer, critic_optimizer = learner_lib.optimizers(config)
  learner = learner_lib.make_learner(
      config, config.used_backbones[0], model, config.num_adapters,
      config.rollout.num_envs * _turns_per_episode(config, structure), mesh, policy_optimizer,
      critic_optimizer, state_shardings)
  recorded = to_config_dict(as_recorded(config)).to_dict()
  # The environments come last: they start grading workers or sandboxes, which the loop
  # closes once it holds them (nothing after this may fail and leave them running).
  # Several processes: each plays the environments whose sampler rows its devices hold.
  rows = multihost.ProcessRows(mesh) if jax.process_count() > 1 else None
  envs = envs_build.build_envs(
      config, team, seed=config.seed,
      owned=None if rows is None else rows.block(config.rollout.num_envs))
  learn = functools.partial(
      _learn_one, model=model, config=config, update=learner.update,
      critic_hidden=learner.critic_hidden, old_values_fn=learner.old_values,
      envs=envs, num_roles=len(team), mesh=mesh, layout=rows,
      agent_sees=envs_lib.agent_sees(structure, team),
      reply_budgets=reply_budgets(team, structure), pad_id=learner.pad_id,
      num_rows=learner.num_rows)
  play = functools.partial(_play, config=config, model=model, team=team, structure=structure,
                           envs=envs, settings=rollout_settings(config), rows=rows)
  return Run(config=config, model=model, config_dict=recorded, team=team, envs=envs,
             judge=judge, play=play, weights=weights, make_weights=make_weights, learn=learn,
             export=functools.partial(export, config=config))


def _build_several(config: TrainConfig, mesh, models: dict, state_shardings: dict) -> Run:
  """`build`'s run of a team on several backbones (one process, no judge:
  `config.resolve.check_backbones`): a learner and a sampler copy per backbone."""
  team, structure = build_team(config)
  split = backbones.split_team(config, team)
  policy_optimizer, critic_optimizer = learner_lib.optimizers(config)
  learners, shared = backbones.learners(config, models, split, mesh, policy_optimizer,
                                        critic_optimizer, config.task.horizon, state_shardings)
  envs = envs_build.build_envs(config, team, seed=config.seed)
  learn = functools.partial(
      _learn_several, config=config, split=split, learners=learners, critic=shared, mesh=mesh,
      envs=envs, num_roles=len(team), agent_sees=envs_lib.agent_sees(structure, team),
      reply_budgets=reply_budgets(team, structure))
  weights = rollout_weights(config, models)
  recorded = to_config_dict(as_recorded(config)).to_dict()
  play = functools.partial(_play, config=config, model=models, team=team, structure=structure,
                           envs=envs, settings=rollout_settings(config))
  return Run(config=config, model=models, config_dict=recorded, team=team, envs=envs,
             judge=None, play=play, weights=weights, make_weights=lambda: weights, learn=learn,
             export=functools.partial(export, config=config))


def _play(policy, rng, version, weights, cancel=None, *, config, model, team, structure, envs,
          settings, rows=None):
  """`Run.play`: one rollout of `envs` with `policy` (policy version `version`) through the
  sampler's `weights`, given per call (an asynchronous run's live on the sampler's mesh)."""
  return player(config, model, team, structure, weights, rows)(envs, policy, rng, settings,
                                                               version, cancel)


def _learn_several(state, kept, iteration, key, *, config, **pieces):
  """`backbones.learn`, with the update's summary metrics (`_update_summary`)."""
  state, metrics, batch, kl = backbones.learn(state, kept, iteration, key, config=config,
                                              active=active_adapters(config, iteration),
                                              **pieces)
  return state, _update_summary(metrics, config, kl, batch, None)


def _learn_one(state, kept, iteration, key, *, pad_id, model, config, update, critic_hidden,
               old_values_fn, envs, num_roles, num_rows, mesh, layout, agent_sees,
               reply_budgets=None):
  """Batch → π_old and critic values → advantages → one jitted update. (new state, metrics)

  The batch goes to the devices with its rows split over the mesh; advantages are computed on
  the host, so the critic's values come back to it. Several processes (`layout`): `kept` are
  this process's episodes (maybe none); it builds, places and reads back only its block of
  the rows, and the batch-wide numbers are reduced over the processes."""
  if layout is None:
    batch = jax.tree.map(np.asarray, make_batch(
        kept, pad_id, num_rows=num_rows, reply_budgets=reply_budgets,
        row_length_step=config.optimizer.row_length_step))
    placed = lambda b: jax.device_put(b, sharding.batch_shardings(mesh, b))
    read, blocks = multihost.to_host, None
  else:
    batch = local_batch.local_block(kept, pad_id, num_rows // layout.processes,
                                    config.optimizer.row_length_step)
    placed = lambda b: jax.tree.map(layout.put, b)
    read, blocks = layout.get, Blocks(jax.process_index())
  batch = _per_row_adapters(batch, layout)
  on_devices = placed(batch)
  extras = prepare(model.params, state.policy, on_devices, model.config, config.loss,
                   None if critic_hidden is None else
                   functools.partial(critic_hidden, state.critic),
                   config.optimizer.minibatches,
                   with_ref=config.advantage.kl_reward_coef > 0)
  if old_values_fn is not None:
    old_values = old_values_fn(state.critic, model.params, on_devices, extras)
    batch = batch.replace(act_old_value=read(old_values))
  groups = [envs.group(e.env_index) for e in kept]
  kl = kl_rewards(read(extras.old_logp), read(extras.ref_logp), batch.act_mask,
                  config.advantage)
  active = active_adapters(config, iteration)
  batch = compute_advantages(batch, kept, config.advantage, num_roles, groups, blocks=blocks,
                             agent_sees=agent_sees, kl_reward=kl, active=active)
  state, metrics = update(
      state, model.params, placed(batch), extras, jnp.asarray(active),
      jnp.asarray(iteration >= config.critic.warmup_iterations), key)
  metrics = {k: float(v) for k, v in metrics.items()}
  return state, _update_summary(metrics, config, kl, batch, layout)


def _update_summary(metrics, config, kl, batch, layout) -> dict:
  """The update's metrics with the trainer's: the KL reward, the sampler-learner gap, the
  tokens trained."""
  if kl is not None:  # this process's mean KL reward per trained token
    metrics["kl_reward"] = float(kl.sum() / max(batch.act_mask.sum(), 1))
  tokens = float(batch.mask.sum())
  if layout is not None:  # this process's block -> the whole batch's
    tokens = float(multihost.sum_over_processes(np.asarray([tokens]))[0])
  # The largest |learner − sampler| log-prob over the trained tokens (the update's, over the
  # whole batch): far above ~1e-4 in f32 means the two disagree about the policy. With
  # π_old read from the rollout (loss.old_logp) no learner forward precedes the update: the
  # first minibatch's, before its step, at the policy level (per turn at the action level).
  metrics["logp/sampler_learner_max_gap"] = metrics["behaviour/logp_gap_max"] if \
      config.loss.old_logp != "rollout" else _log_gap(metrics["behaviour/first_ratio_max_dev"])
  # Tokens through the learner's forward + backward: every real token, every epoch.
  metrics["update_tokens"] = tokens * config.optimizer.epochs
  return metrics


def _log_gap(ratio_dev: float) -> float:
  """The largest |log r| that max |r − 1| = `ratio_dev` allows."""
  return float(-np.log1p(-ratio_dev)) if ratio_dev < 1 else float("inf")


def _per_row_adapters(batch, layout):
  """`per_row_adapters`; with several processes only if every process's block allows it
  (their blocks make one array: one shape)."""
  converted = per_row_adapters(batch)
  if layout is None or not multihost.any_process(np.ndim(converted.adapter_ids) == 2):
    return converted
  return batch


def _turns_per_episode(config: TrainConfig, structure) -> int:
  """Rows a per-agent-view episode can fill (one per turn); 1 for a shared stream."""
  if config.rollout.context_mode == "shared_stream":
    return 1
  if isinstance(structure, envs_lib.Orchestrator):
    per_step = 2 * structure.max_calls + 1
  else:  # a chain or a DAG: each role once
    per_step = config.team.num_roles
  return per_step * config.task.horizon


def active_adapters(config: TrainConfig, iteration: int) -> np.ndarray:
  """[A] bool: the adapters the agent-by-agent schedule trains at `iteration`."""
  k, A = config.optimizer.agent_iteration_interval, config.num_adapters
  if k == 0 or config.team.shared_adapter:
    return np.ones((A,), bool)
  return np.arange(A) == (iteration // k) % A

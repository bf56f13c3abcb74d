"""`train(config, workdir)`: the MARFT training loop, top to bottom.

Per iteration: rollout (the team plays one episode per environment through the sampler, in
the fast decoding layout) → batch and advantages (critic values at rollout time, then GAE,
the token-level backup or GRPO's group normalisation) → one jitted update (PPO epochs ×
minibatches) → metrics, transcripts, checkpoints.

Resume: the checkpoint already in `workdir` always wins. It holds the adapters, the critic,
both optimizer states and the step counter; its meta holds the iteration, the environments'
data cursor and the config. Every PRNG key is `fold_in(seed, iteration)`, so a resumed run
continues exactly as an uninterrupted one would. SIGTERM/SIGINT save and exit cleanly: after
the update in progress, or, from inside a rollout (one process), at its next sampler call,
with the state and data cursor from before that iteration (its episodes are played again on
resume), so a scheduler's grace period need not cover a whole rollout and update.

Scale (`config.mesh`, docs/scaling.md): everything runs under one mesh. The base weights are
split over fsdp/tensor, adapters and optimizer moments like their base kernels, the batch rows
over data x fsdp; the same program runs in every process of a multi-process job, each process
writing its shards of the checkpoint and process 0 the shared files (metrics, transcripts,
exports). Host work is split too (`multihost.ProcessRows`): process p of P owns the p-th block
of rollout.num_envs / P environments, the ones whose sampler rows its devices hold. It resets
and steps only those, builds and reads back only their rows of each sampler call, batches only
their episodes into its block of the training batch's rows, and computes their advantages;
what must be global goes through small collectives: the batch widths, the advantages for the
batch whitening (one float a decision, gathered), the metrics and the transcript records
(gathered: process 0 appends them to the transcripts), and the data cursor of the checkpoint
(each process advanced its own envs'; the saved cursor is the whole batch's, so it restores
onto any process count).
One process plays every environment, exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from marft_jax import envs as envs_lib
from marft_jax import lora as lora_lib
from marft_jax import compile_stats, multihost, sharding
from marft_jax.architecture import precision
from marft_jax.configs import to_config_dict
from marft_jax.rollout import (RolloutCancelled, append_transcripts, cut_transcripts,
                               reply_budgets, rollout)
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train import algorithms
from marft_jax.train import assembly
from marft_jax.train import async_rollout
from marft_jax.train import backbones
from marft_jax.train import config_history
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import local_batch
from marft_jax.train import tasks
from marft_jax.train import teams
from marft_jax.train import trained_problems
from marft_jax.train import workdir_lock
from marft_jax.train.advantages import Blocks, compute_advantages, kl_rewards
from marft_jax.train.assembly import Model
from marft_jax.train.batching import make_batch, per_row_adapters
from marft_jax.train.checkpoint import Checkpointer, PreemptionFlag, saved_steps
from marft_jax.train.config import ModelSection, TrainConfig, check_processes
from marft_jax.train.metrics import MetricWriter, iter_metrics, plot_learning_curves
from marft_jax.train.update import TrainState, prepare
from marft_jax.train.write_failures import writing

def active_adapters(config: TrainConfig, iteration: int) -> np.ndarray:
  """[A] bool: the adapters the agent-by-agent schedule trains at `iteration`."""
  k, A = config.optimizer.agent_iteration_interval, config.num_adapters
  if k == 0 or config.team.shared_adapter:
    return np.ones((A,), bool)
  return np.arange(A) == (iteration // k) % A


# --- the loop ----------------------------------------------------------------------------------


def train(config: TrainConfig, workdir: str,
          model: Union[Model, Mapping[str, Model], None] = None,
          progress: bool = True, on_iteration: Optional[Callable] = None,
          reward_fn: Optional[rewards_lib.RewardFn] = None,
          task: Optional[Callable] = None) -> dict:
  """Trains; returns the last iteration's metrics. `model`: a loaded base (tests pass the
  tiny one), or {backbone name: its base} for a team on several backbones (issue 41,
  `train.backbones`); default: loaded from `config.model`. `reward_fn(episode, team)`: your
  reward on each whole episode (`rollout.rewards`); default: the function `config.reward.fn`
  names. `task`: a factory of your own (`train/tasks.py`: defined at a module's top level),
  which config.task.name then names. The config is resolved first (`algorithms.resolve`: the
  algorithm's keys filled in, contradictions refused)."""
  config = algorithms.resolve(tasks.with_factory(config, task))
  finished = finished_run_metrics(config, workdir)
  if finished is not None:
    return finished
  mesh, sampler_mesh = async_rollout.meshes(config)  # one mesh unless mesh.sampler_devices
  check_processes(config, tuple(mesh.shape.values()), jax.process_count())
  # The checkpoint in workdir wins: a resumed run does not read `init_from` again.
  resuming = bool(saved_steps(workdir))
  assembly.check_training_files(config, resuming)  # a bad file fails before the load
  assembly.build_team(config)  # so does a team that cannot play (a cycle, a budget)
  if reward_fn is not None:
    rewards_lib.check_reward_fn(reward_fn)
  elif config.reward.fn:  # the config's own, as the launch script reads it
    reward_fn = rewards_lib.load_reward_fn(config.reward.fn)
  os.makedirs(workdir, exist_ok=True)
  with workdir_lock.exclusive(workdir, multihost.is_primary(), multihost.any_process):
    model = _models(config, model)
    placed = {name: _place_model(m, mesh) for name, m in model.items()} \
        if isinstance(model, dict) else _place_model(model, mesh)
    with jax.set_mesh(mesh), precision.scope(config.model.matmul_precision, config.run_dtype):
      return _train(config, workdir, mesh, placed, progress, on_iteration, reward_fn, resuming,
                    sampler_mesh)


def _models(config: TrainConfig, given) -> Union[Model, dict]:
  """The run's base: one `Model` for a team on one backbone, else {name: Model} for each
  backbone a role runs on; `given` (a Model, a mapping, or None: loaded) checked against
  `config.used_backbones`."""
  names = config.used_backbones
  if given is None:
    return backbones.load_models(config)
  if isinstance(given, Model):
    if len(names) > 1:
      raise ValueError(f"model: one base for a team on the backbones {list(names)}: pass "
                       "{name: Model} for each")
    return given
  if sorted(given) != sorted(names):
    raise ValueError(f"model: bases for {sorted(given)}, but the roles run on the backbones "
                     f"{sorted(names)}")
  return given[names[0]] if len(names) == 1 else dict(given)


def finished_run_metrics(config: TrainConfig, workdir: str) -> Optional[dict]:
  """For a run in `workdir` whose latest checkpoint is at or past `config.iterations` (the
  same command relaunched after it finished, or `iterations` lowered): a warning that
  nothing is left to train, and its last iteration's metrics with the held-out scores that
  followed, as `train` returned them (read from metrics.jsonl). None while there is more to
  train. Nothing is loaded or compiled."""
  steps = saved_steps(workdir)
  if not steps or steps[-1] < config.iterations:
    return None
  last = steps[-1]
  logging.warning("%s: its latest checkpoint is iteration %d and config.iterations=%d: "
                  "nothing left to train (raise config.iterations to continue)", workdir,
                  last, config.iterations)
  path = os.path.join(workdir, "metrics.jsonl")
  metrics = {}
  for row in iter_metrics(path) if os.path.exists(path) else ():
    if row["step"] in (last - 1, last):  # the last iteration's, then its held-out scores
      metrics.update(row)
  metrics.pop("step", None)
  return {k: float("nan") if v is None else v for k, v in metrics.items()}  # JSON's NaN


def _place_model(model: Model, mesh) -> Model:
  return dataclasses.replace(model, params=jax.device_put(
      model.params, sharding.param_shardings(mesh, model.params)))


def _learner_model(model: Model, section: ModelSection) -> Model:
  """`model` with the model section's numerics: the learner's forward recomputes each layer
  in the backward pass (`Layout.remat`), and its LoRA update's precision
  (`lora_update_f32`, which the sampler's copy made from it keeps)."""
  layout = dataclasses.replace(model.config.layout, remat=section.remat)
  return dataclasses.replace(model, config=model.config.replace(
      layout=layout, lora_update_f32=section.lora_update_f32))


@dataclasses.dataclass(frozen=True)
class _Run:
  """What a training run holds besides its state, built once from the config (`_build`)."""

  config: TrainConfig
  config_dict: dict  # `assembly.as_recorded(config)`: saved in checkpoints and config.json
  team: tuple  # the roles' profiles
  envs: Any  # `envs.EnvBatch`: this process's environments
  judge: Optional[rewards_lib.Judge]
  play: Callable  # (policy, key, version, weights=) -> `rollout.RolloutResult`
  # The sampler's (params, model config) on the learner's mesh; a split team: {backbone: ...};
  # None with a sampler sub-mesh (`mesh.sampler_devices`), whose copy `make_weights` makes.
  weights: Any
  make_weights: Callable[[], Any]  # the sampler's weights made anew (`assembly.rollout_model`)
  learn: Callable  # (state, kept episodes, iteration, key) -> (state, metrics)
  heldout: Callable  # (policy, step) -> "heldout/..." metrics
  export: Callable  # (checkpointer, step, state): the PEFT exports


def _train(config, workdir, mesh, model, progress, on_iteration, reward_fn, resuming,
           sampler_mesh=None) -> dict:
  # --- build: the team, its environments, the sampler's weights, the update -------------------
  run, state = _build(config, mesh, model, resuming)
  with contextlib.ExitStack() as cleanup:  # closed in reverse order, whatever fails
    cleanup.callback(run.envs.close)  # grading workers, code sandboxes
    # --- restore: the checkpoint already in workdir wins --------------------------------------
    checkpointer = cleanup.enter_context(Checkpointer(workdir, max_to_keep=config.max_to_keep))
    if (checkpointer.latest_step() is not None) != resuming:  # the state was built for it
      raise RuntimeError(f"{workdir}: its checkpoints changed while the run was being built")
    state, start = _restore(checkpointer, run, state, workdir)
    writer = MetricWriter(workdir, enabled=multihost.is_primary(), resume_step=start)
    cleanup.callback(writer.close)
    _record_config(writer, workdir, start, run.config_dict)
    if multihost.is_primary():  # a resumed run plays the iterations from `start` again
      with writing(workdir, f"transcripts/, cut back to the iterations before {start}"):
        cut_transcripts(os.path.join(workdir, "transcripts"), start)
    bar = _progress(progress, start, config.iterations)
    if bar is not None:
      cleanup.callback(bar.close)
    preempt = cleanup.enter_context(PreemptionFlag())
    # --- the loop: rollout -> rewards -> update -> metrics, held-out scores, checkpoints ------
    metrics: dict = {}
    shown: dict = {}  # the latest held-out evaluation, kept on the progress bar
    compiles = compile_stats.CompileCounter()  # per iteration: time/compiles, time/compile_s
    rollouts = None  # rollout.max_staleness >= 1: a sampler thread plays ahead
    if config.rollout.max_staleness:
      rollouts = _start_async(cleanup, run, state, start, workdir, mesh, sampler_mesh,
                              reward_fn)
    for iteration in range(start, config.iterations):
      key = jax.random.fold_in(jax.random.key(config.seed), iteration)
      # Held-out accuracy of the learner's policy before this iteration's update (at 0: the
      # untuned team); with rollout.max_staleness = η it sampled iteration k + η.
      evaluated = run.heldout(_policy(state), iteration) if _eval_due(config, iteration) else {}
      shown.update(evaluated)
      t0 = time.perf_counter()
      # A signal inside this iteration's rollout (one process: several play it out, their
      # calls being collectives that a signal reaches at different moments), or while the
      # learner waits for an asynchronous one, stops it; the checkpoint is the last
      # iteration's, with the data cursor from before this rollout.
      alone = jax.process_count() == 1
      before = _env_cursor(run.envs) if alone and rollouts is None else None
      try:
        if rollouts is None:
          result, shaped = _play_and_shape(run, reward_fn, iteration, _policy(state), iteration,
                                           cancel=preempt.event if alone else None)
          staleness = {}
        else:
          result, shaped, staleness = rollouts.take(iteration, stop=preempt.event)
      except RolloutCancelled:  # nothing of this iteration is kept
        if iteration > start:  # else the checkpoint resumed from (or none) holds it all
          _checkpoint(checkpointer, iteration, state, run, writer, workdir, rollouts,
                      cursor=before)
        logging.warning("Stopping on a signal during iteration %d's rollout (checkpointed "
                        "after iteration %d)", iteration, iteration - 1)
        break
      t1 = time.perf_counter()
      if multihost.is_primary():  # every process's episodes, in env order
        with writing(workdir, f"the transcripts of iteration {iteration} (transcripts/)"):
          append_transcripts(os.path.join(workdir, "transcripts"), iteration,
                             result.all_episodes)
      kept = [e for e in result.episodes if e.dropped is None]  # this process's
      update_metrics = {}
      if all(e.dropped is not None for e in result.all_episodes):
        logging.warning("Iteration %d: every episode was dropped (%s); no update",
                        iteration, _drop_reasons(result.all_episodes))
      else:
        state, update_metrics = run.learn(state, kept, iteration, jax.random.fold_in(key, 1))
      if rollouts is not None:
        rollouts.publish(iteration + 1, state.policy)
      t2 = time.perf_counter()
      metrics = {**_iteration_metrics(result, update_metrics, run.team, t0, t1, t2),
                 **evaluated, **shaped, **compiles.delta().metrics(), **staleness}
      if staleness:  # the learner's wait for its batch; the host's part of the sampler's
        total = max(t2 - t0, 1e-9)  # rollout (time/rollout_s is the learner's wait here)
        metrics["async/learner_wait_share"] = staleness["async/learner_wait_s"] / total
        metrics["time/rollout_host_share"] = (staleness["async/sampler_rollout_s"]
                                              - result.metrics["sampler_s"]) / total
      writer.write(iteration, metrics)
      if bar is not None:
        bar.update(1)
        bar.set_postfix(_postfix(metrics, shown))
      if on_iteration is not None:
        on_iteration(iteration, metrics)
      done = iteration + 1 == config.iterations
      if done and config.eval_every:  # the trained policy, before the final checkpoint
        final = run.heldout(_policy(state), iteration + 1)
        writer.write(iteration + 1, final)
        metrics = {**metrics, **final}
        shown.update(final)
        if bar is not None:
          bar.set_postfix(_postfix(metrics, shown))
      stop = multihost.any_process(preempt.requested)
      if (iteration + 1) % config.checkpoint_every == 0 or done or stop:
        _checkpoint(checkpointer, iteration + 1, state, run, writer, workdir, rollouts)
      if stop:
        logging.warning("Stopping on a signal after iteration %d (checkpointed)", iteration)
        break
  return metrics


def _policy(state):
  """The adapters a rollout samples with: `state.policy`; a split team's {backbone: policy}."""
  if isinstance(state, TrainState):
    return state.policy
  return {name: backbone_state.policy for name, backbone_state in state.items()}


def _play_and_shape(run: _Run, reward_fn, iteration: int, policy, version: int,
                    cancel=None, weights=None) -> tuple:
  """Iteration `iteration`'s episodes, played with adapters `policy` (version `version`) and
  the sampler's `weights` (None: `run.weights`), and their rewards shaped: (RolloutResult,
  shaped metrics). `cancel`: `rollout`'s (the preemption flag's event, or the sampler
  thread's)."""
  key = jax.random.fold_in(jax.random.key(run.config.seed), iteration)
  result = run.play(policy, jax.random.fold_in(key, 0), version,
                    weights=run.weights if weights is None else weights, cancel=cancel)
  shaped = _shape_rewards(result.episodes, run.team, run.judge, reward_fn,
                          jax.random.fold_in(key, 2))
  return result, shaped


def _start_async(cleanup, run: _Run, state, start, workdir, mesh, sampler_mesh,
                 reward_fn) -> async_rollout.AsyncRollouts:
  """The sampler thread of rollout.max_staleness >= 1 (`async_rollout`), entered in
  `cleanup` (stopped before the environments close), with the versions a resume needs."""
  config = run.config
  eta = config.rollout.max_staleness
  saved = cleanup.enter_context(Checkpointer(async_rollout.versions_dir(workdir),
                                             max_to_keep=config.max_to_keep + 1))
  behind = None if start == 0 else async_rollout.restore_versions(saved, start, state.policy,
                                                                  eta)
  base = run.weights if run.weights is not None else run.make_weights()
  weights = async_rollout.place_weights(base, sampler_mesh)
  del base  # with a sub-mesh: the learner's devices keep no copy of the sampler's base

  def scope():  # JAX's mesh and matmul precision are per thread
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(sampler_mesh or mesh))
    stack.enter_context(precision.scope(config.model.matmul_precision, config.run_dtype))
    return stack

  rollouts = async_rollout.AsyncRollouts(
      functools.partial(_play_and_shape, run, reward_fn, weights=weights), run.envs, eta, start,
      config.iterations, async_rollout.initial_versions(state.policy, start, eta, behind),
      scope=scope, place=async_rollout.placer(sampler_mesh), saved=saved)
  return cleanup.enter_context(rollouts)


def _build(config: TrainConfig, mesh, model: Model, resuming: bool) -> tuple[_Run, TrainState]:
  """The run's pieces and the state it starts from (placed on the mesh; `resuming`: a
  template the checkpoint restores into, `init_from` not read). A team on several
  backbones: `_build_split`."""
  if isinstance(model, dict):
    return _build_split(config, mesh, model)
  model = _learner_model(model, config.model)
  team, structure = assembly.build_team(config)
  make_weights = functools.partial(assembly.rollout_model, model, config)
  # With a sampler sub-mesh its copy of the base lives there alone (`_start_async`): a
  # held-out evaluation on the learner's mesh converts the base for its own call (a copy of
  # the weights while it runs, where the learner's devices would hold one for the whole run).
  rollout_weights = None if config.mesh.sampler_devices else make_weights()
  judge = assembly.build_judge(config, model, rollout_weights)  # none with a sub-mesh
  policy_optimizer, critic_optimizer = assembly.optimizers(config)
  start = dataclasses.replace(config, init_from="") if resuming else config
  state = assembly.init_state(start, model, assembly.num_agents(team, structure),
                              policy_optimizer, critic_optimizer)
  state_shardings = lora_lib.follow_adapters(mesh, state)
  state = jax.device_put(state, state_shardings)
  learner = assembly.make_learner(
      config, config.used_backbones[0], model, config.num_adapters,
      config.rollout.num_envs * _turns_per_episode(config, structure), mesh, policy_optimizer,
      critic_optimizer, state_shardings)
  recorded = to_config_dict(assembly.as_recorded(config)).to_dict()
  # The environments come last: they start grading workers or sandboxes, which `_train`
  # closes once it holds them (nothing after this may fail and leave them running).
  # Several processes: each plays the environments whose sampler rows its devices hold.
  rows = multihost.ProcessRows(mesh) if jax.process_count() > 1 else None
  envs = assembly.build_envs(config, team, seed=config.seed,
                             owned=None if rows is None else rows.block(config.rollout.num_envs))
  learn = functools.partial(
      _learn, model=model, config=config, update=learner.update,
      critic_hidden=learner.critic_hidden, old_values_fn=learner.old_values,
      envs=envs, num_roles=len(team), mesh=mesh, layout=rows,
      agent_sees=envs_lib.agent_sees(structure, team),
      reply_budgets=reply_budgets(team, structure), pad_id=learner.pad_id,
      num_rows=learner.num_rows)
  play = functools.partial(_play, envs=envs, team=team, structure=structure, model=model,
                           settings=assembly.rollout_settings(config), rows=rows)
  run = _Run(config=config, config_dict=recorded, team=team, envs=envs, judge=judge, play=play,
             weights=rollout_weights, make_weights=make_weights,
             learn=learn, heldout=functools.partial(_heldout, config=config, model=model,
                                                    weights=rollout_weights),
             export=functools.partial(_export, config=config))
  return run, state


def _play(policy, rng, version, *, envs, team, structure, model, weights, settings, rows,
          cancel=None):
  """One rollout of the team through the sampler's copy of the base (`weights`), with the
  adapters `policy` (policy version `version`); `cancel`: `rollout`'s."""
  return rollout(envs, team, structure, *weights, model.tokenizer, rng, lora=policy,
                 config=settings, policy_version=version, rows=rows, cancel=cancel)


def _export(checkpointer, step, state, *, config):
  """The adapters as PEFT folders, one per adapter (a collective: every process takes part,
  process 0 writes)."""
  names = teams.adapter_names(config.team, config.task.name)
  adapters = multihost.to_host(state.policy)
  if multihost.is_primary():
    source = config.model.backbone(config.used_backbones[0]).source
    checkpointer.export_peft(step, adapters, names, source)


def _build_split(config: TrainConfig, mesh, models: dict) -> tuple[_Run, dict]:
  """`_build` of a team on several backbones (`train.backbones`; one process, no judge:
  `backbones.check_backbones`): one state, learner and sampler copy per backbone. The state
  is {backbone name: TrainState}."""
  models = {name: _learner_model(m, config.model) for name, m in models.items()}
  team, structure = assembly.build_team(config)
  split = backbones.split_team(config, team)
  policy_optimizer, critic_optimizer = assembly.optimizers(config)
  state = backbones.init_states(config, models, split, policy_optimizer, critic_optimizer)
  state_shardings = {name: lora_lib.follow_adapters(mesh, s) for name, s in state.items()}
  state = jax.device_put(state, state_shardings)
  learners, critic = backbones.learners(config, models, split, mesh, policy_optimizer,
                                        critic_optimizer, config.task.horizon, state_shardings)
  envs = assembly.build_envs(config, team, seed=config.seed)
  learn = functools.partial(
      _learn_split, config=config, split=split, learners=learners, critic=critic, mesh=mesh,
      envs=envs, num_roles=len(team), agent_sees=envs_lib.agent_sees(structure, team),
      reply_budgets=reply_budgets(team, structure))
  weights = {name: assembly.rollout_model(m, config, name) for name, m in models.items()}
  play = functools.partial(backbones.play, envs=envs, team=team, structure=structure,
                           models=models, split=split, settings=assembly.rollout_settings(config))
  heldout = functools.partial(_heldout, config=config, model=models, weights=weights)
  run = _Run(config=config, config_dict=to_config_dict(assembly.as_recorded(config)).to_dict(),
             team=team, envs=envs, judge=None, play=play, weights=weights,
             make_weights=lambda: weights, learn=learn,
             heldout=heldout,
             export=functools.partial(backbones.export, config=config, split=split))
  return run, state


def _learn_split(state, kept, iteration, key, *, config, **pieces):
  """`backbones.learn`, with the update's summary metrics (`_update_summary`)."""
  state, metrics, batch, kl = backbones.learn(state, kept, iteration, key, config=config,
                                              active=active_adapters(config, iteration),
                                              **pieces)
  return state, _update_summary(metrics, config, kl, batch, None)


def _restore(checkpointer: Checkpointer, run: _Run, state: TrainState, workdir: str
             ) -> tuple[TrainState, int]:
  """(the state to train from, the iteration to start at): the latest checkpoint's, with the
  environments' data cursor restored, or `state` and 0 when there is none."""
  if checkpointer.latest_step() is None:
    return state, 0
  where = f"{workdir}: step {checkpointer.latest_step()}"
  known = checkpointer.read_meta(checkpointer.latest_step()).get("changes_known")
  written = checkpointer.written_at(checkpointer.latest_step())
  state, meta = checkpointer.restore(
      state, config=assembly.resume_view(run.config_dict, run.config.run_dtype),
      may_differ=assembly.RESUME_MAY_DIFFER,
      read_config=lambda saved: assembly.read_for_resume(saved, where, known, written))
  start = int(meta["iteration"])
  run.envs.load_state_dict(meta["envs"])
  logging.warning("Resuming %s from its checkpoint after iteration %d of %d",
                  workdir, start, run.config.iterations)
  return state, start


def _learn(state, kept, iteration, key, *, pad_id, model, config, update, critic_hidden,
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


def _record_config(writer: MetricWriter, workdir: str, step: int, config_dict: dict) -> None:
  """The recorded config (`assembly.as_recorded`: the algorithm that actually runs, every key
  it decided filled in, the team written out):
  `config.json` in the run folder and a "config" text in the metrics (TensorBoard's text tab
  and texts.jsonl) at the step the launch starts from."""
  if not multihost.is_primary():
    return
  text = json.dumps(config_dict, indent=2, sort_keys=True)
  with writing(workdir, "config.json"), open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(text + "\n")
  writer.write_text(step, "config", text)


def _shape_rewards(episodes, team, judge, reward_fn, key) -> dict:
  """The judge's and the user's rewards on this process's episodes; their metrics."""
  metrics = {}
  if judge is not None:
    metrics.update(rewards_lib.apply_judge(episodes, team, judge, key))
  if reward_fn is not None:
    rewards_lib.apply_reward_fn(episodes, team, reward_fn)
  if judge is not None or reward_fn is not None:
    kept = [e for e in episodes if e.dropped is None]
    metrics["reward_trained"] = float(np.mean([e.episodic_return for e in kept])) if kept \
        else 0.0
  return metrics


def _eval_due(config: TrainConfig, iteration: int) -> bool:
  return config.eval_every > 0 and iteration % config.eval_every == 0


def _heldout(policy, step, *, config, model, weights) -> dict:
  """`evaluate` on `eval_episodes` held-out problems, greedy, as "heldout/<metric>" keys."""
  start = time.perf_counter()
  result = evaluate_lib.evaluate(config, model, policy, num_problems=config.eval_episodes,
                                 rollout_weights=weights)
  out = {f"heldout/{k}": float(v) for k, v in result.items()}
  out["time/heldout_s"] = time.perf_counter() - start
  logging.info("Held-out accuracy after %d iterations: %.3f (%d problems)", step,
               out["heldout/accuracy"], out.get("heldout/episodes", config.eval_episodes))
  return out


def _postfix(metrics: dict, heldout: dict) -> dict:
  """The progress bar's live figures: the sampled reward, and the latest held-out accuracy."""
  shown = {"reward": f"{metrics['reward']:.3f}"}
  if "heldout/accuracy" in heldout:
    shown["heldout"] = f"{heldout['heldout/accuracy']:.3f}"
  return shown


def _per_row_adapters(batch, layout):
  """`per_row_adapters`; with several processes only if every process's block allows it
  (their blocks make one array: one shape)."""
  converted = per_row_adapters(batch)
  if layout is None or not multihost.any_process(np.ndim(converted.adapter_ids) == 2):
    return converted
  return batch


def _checkpoint(checkpointer, step, state, run: _Run, writer, workdir, rollouts=None,
                cursor=None):
  """`cursor`: the data cursor to save (default: the environments' now). `rollouts`
  (asynchronous runs): the data cursor is the last trained iteration's, and
  the versions behind `step` are saved first (`AsyncRollouts.save_versions`)."""
  config = run.config
  if cursor is None:
    cursor = _env_cursor(run.envs) if rollouts is None else rollouts.cursor(step)
  if rollouts is not None:
    rollouts.save_versions(step)
  meta = {"iteration": step, "envs": cursor, "config": run.config_dict,
          "policy_version": step, "changes_known": config_history.CHANGES_KNOWN}
  meta[trained_problems.KEY] = trained_problems.record(config, meta["envs"], run.envs)
  checkpointer.save(step, state, meta, force=True)  # every process: its own shards
  run.export(checkpointer, step, state)  # collective: every process takes part
  if not multihost.is_primary():
    return
  writer.flush()
  with writing(workdir, "learning_curve.png"):
    plot_learning_curves(os.path.join(workdir, "metrics.jsonl"),
                         os.path.join(workdir, "learning_curve.png"),
                         keys=("reward", "accuracy", "heldout/accuracy", "policy_loss",
                               "value_loss"), unsmoothed=("heldout/accuracy",))


def _env_cursor(envs) -> dict:
  """The whole batch's data cursor: each process advanced only its own environments', so a
  multi-process job gathers every process's block (a collective) before saving it."""
  state = envs.state_dict()
  if jax.process_count() > 1:
    own = np.asarray(state["episodes"][envs.owned.start:envs.owned.stop], np.int64)
    state["episodes"] = [int(n) for n in multihost.gather_blocks(own)]
  return state


def _turns_per_episode(config: TrainConfig, structure) -> int:
  """Rows a per-agent-view episode can fill (one per turn); 1 for a shared stream."""
  if config.rollout.context_mode == "shared_stream":
    return 1
  if isinstance(structure, envs_lib.Orchestrator):
    per_step = 2 * structure.max_calls + 1
  else:  # a chain or a DAG: each role once
    per_step = config.team.num_roles
  return per_step * config.task.horizon


def _drop_reasons(episodes) -> str:
  counts = {}
  for e in episodes:
    counts[e.dropped] = counts.get(e.dropped, 0) + 1
  hint = " (raise rollout.max_context or lower max_new_tokens)" if "context_overflow" in counts \
      else ""
  return ", ".join(f"{n} {reason}" for reason, n in counts.items()) + hint


def _iteration_metrics(result, update_metrics, team, t0, t1, t2) -> dict:
  """Rollout and update metrics, and where the iteration's wall time went."""
  m = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float))}
  m.update(update_metrics)
  m["accuracy"] = m.get("env/accuracy", m["reward"])
  total = max(t2 - t0, 1e-9)
  m["time/iteration_s"], m["time/rollout_s"], m["time/update_s"] = total, t1 - t0, t2 - t1
  m["time/sampler_share"] = result.metrics["sampler_s"] / total
  m["time/rollout_host_share"] = (t1 - t0 - result.metrics["sampler_s"]) / total
  m["time/update_share"] = (t2 - t1) / total
  m["update_tok_s"] = update_metrics.get("update_tokens", 0.0) / max(t2 - t1, 1e-9)
  return m


def _progress(enabled: bool, start: int, total: int):
  if not enabled:
    return None
  from tqdm import tqdm
  return tqdm(total=total, initial=start, desc="training", unit="it", file=sys.stderr)

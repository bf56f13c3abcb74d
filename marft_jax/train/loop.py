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
import numpy as np
from absl import logging
from tqdm import tqdm

from marft_jax import compile_stats, multihost
from marft_jax.architecture import precision
from marft_jax.rollout import RolloutCancelled, append_transcripts, cut_transcripts
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train import async_rollout
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import run as run_lib
from marft_jax.train import tasks
from marft_jax.train import trained_problems
from marft_jax.train import workdir_lock
from marft_jax.train.build import preflight
from marft_jax.train.build.model import Model
from marft_jax.train.build.team import build_team
from marft_jax.train.checkpoint import Checkpointer, PreemptionFlag, saved_steps
from marft_jax.train.config import history as config_history
from marft_jax.train.config import saved as saved_config
from marft_jax.train.config.resolve import resolve
from marft_jax.train.config.schema import TrainConfig
from marft_jax.train.metrics import (MetricWriter, iter_metrics, plot_learning_curves,
                                     return_freed_memory)
from marft_jax.train.run import Run
from marft_jax.train.write_failures import writing


def train(config: TrainConfig, workdir: str,
          model: Union[Model, Mapping[str, Model], None] = None,
          progress: bool = True, on_iteration: Optional[Callable] = None,
          reward_fn: Optional[rewards_lib.RewardFn] = None,
          task: Optional[Callable] = None) -> dict:
  """Trains; returns the last iteration's metrics. `model`: a loaded base (tests pass the
  tiny one), or {backbone name: its base} for a team on several backbones (`train.run`); default: loaded from `config.model`. `reward_fn(episode, team)`: your
  reward on each whole episode (`rollout.rewards`); default: the function `config.reward.fn`
  names. `task`: a factory of your own (`train/tasks.py`: defined at a module's top level),
  which config.task.name then names. The config is resolved first (`config.resolve`: the
  algorithm's keys filled in, contradictions refused)."""
  config = resolve(tasks.with_factory(config, task))
  finished = finished_run_metrics(config, workdir)
  if finished is not None:
    return finished
  mesh, sampler_mesh = async_rollout.meshes(config)  # one mesh unless mesh.sampler_devices
  preflight.check_processes(config, tuple(mesh.shape.values()), jax.process_count())
  # The checkpoint in workdir wins: a resumed run does not read `init_from` again.
  resuming = bool(saved_steps(workdir))
  preflight.check_training_files(config, resuming)  # a bad file fails before the load
  build_team(config)  # so does a team that cannot play (a cycle, a budget)
  if reward_fn is not None:
    rewards_lib.check_reward_fn(reward_fn)
  elif config.reward.fn:  # the config's own, as the launch script reads it
    reward_fn = rewards_lib.load_reward_fn(config.reward.fn)
  os.makedirs(workdir, exist_ok=True)
  with workdir_lock.exclusive(workdir, multihost.is_primary(), multihost.any_process):
    placed = run_lib.place(config, run_lib.load_models(config, model), mesh)
    with jax.set_mesh(mesh), precision.scope(config.model.matmul_precision, config.run_dtype):
      return _train(config, workdir, mesh, placed, progress, on_iteration, reward_fn, resuming,
                    sampler_mesh)


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


@dataclasses.dataclass
class _Session:
  """One launch of a run while it trains: what `_open` set up, closed with its ExitStack."""

  run: Run
  workdir: str
  start: int  # the first iteration this launch trains (a resumed run's checkpoint's)
  checkpointer: Checkpointer
  writer: MetricWriter
  bar: Any  # the progress bar (tqdm), or None
  preempt: PreemptionFlag
  heldout: Callable  # (policy, step) -> "heldout/..." metrics
  reward_fn: Optional[rewards_lib.RewardFn]
  on_iteration: Optional[Callable]
  rollouts: Optional[async_rollout.AsyncRollouts] = None  # max_staleness >= 1: played ahead
  shown: dict = dataclasses.field(default_factory=dict)  # the latest held-out scores, on the bar
  # Per iteration: time/compiles, time/compile_s
  compiles: Any = dataclasses.field(default_factory=compile_stats.CompileCounter)


def _train(config, workdir, mesh, model, progress, on_iteration, reward_fn, resuming,
           sampler_mesh=None) -> dict:
  """build -> restore -> per iteration: rollout, update, metrics, held-out scores,
  checkpoints. Returns the last iteration's metrics."""
  run, state = run_lib.build(config, mesh, model, resuming)
  with contextlib.ExitStack() as cleanup:  # closed in reverse order, whatever fails
    session, state = _open(cleanup, run, state, workdir, resuming, progress, on_iteration,
                           reward_fn)
    if config.rollout.max_staleness:  # a sampler thread plays ahead
      session.rollouts = _start_async(cleanup, run, state, session.start, workdir, mesh,
                                      sampler_mesh, reward_fn)
    metrics: dict = {}
    for iteration in range(session.start, config.iterations):
      played = _rollout(session, state, iteration)
      if played is None:  # a signal during the rollout: checkpointed, nothing of it kept
        break
      state, metrics = _learn_and_record(session, state, iteration, *played)
      if _checkpoint_or_stop(session, state, iteration):
        break
  return metrics


def _open(cleanup, run: Run, state, workdir: str, resuming: bool, progress: bool,
          on_iteration, reward_fn) -> tuple[_Session, Any]:
  """Restores the checkpoint already in `workdir` (it wins), opens the metrics, cuts the
  transcripts back to the iterations before the restored one and starts the progress bar
  and the signal handler, each closed by `cleanup`. (the session, the state to train)"""
  config = run.config
  cleanup.callback(run.envs.close)  # grading workers, code sandboxes
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
  heldout = functools.partial(_heldout, config=config, model=run.model, weights=run.weights)
  return _Session(run=run, workdir=workdir, start=start, checkpointer=checkpointer,
                  writer=writer, bar=bar, preempt=preempt, heldout=heldout,
                  reward_fn=reward_fn, on_iteration=on_iteration), state


def _rollout(session: _Session, state, iteration: int) -> Optional[tuple]:
  """Iteration `iteration`'s held-out scores (when due) and episodes: (evaluated, t0,
  `RolloutResult`, shaped metrics, staleness metrics), or None when a signal stopped the
  rollout (then the last iteration is checkpointed, with the data cursor from before it)."""
  run, config = session.run, session.run.config
  # Held-out accuracy of the learner's policy before this iteration's update (at 0: the
  # untuned team); with rollout.max_staleness = η it sampled iteration k + η.
  evaluated = session.heldout(run_lib.policy(config, state), iteration) \
      if _eval_due(config, iteration) else {}
  session.shown.update(evaluated)
  t0 = time.perf_counter()
  # A signal inside this iteration's rollout (one process: several play it out, their calls
  # being collectives that a signal reaches at different moments), or while the learner
  # waits for an asynchronous one, stops it.
  alone = jax.process_count() == 1
  rollouts = session.rollouts
  before = _env_cursor(run.envs) if alone and rollouts is None else None
  try:
    if rollouts is None:
      result, shaped = _play_and_shape(run, session.reward_fn, iteration,
                                       run_lib.policy(config, state), iteration,
                                       cancel=session.preempt.event if alone else None)
      staleness = {}
    else:
      result, shaped, staleness = rollouts.take(iteration, stop=session.preempt.event)
  except RolloutCancelled:  # nothing of this iteration is kept
    if iteration > session.start:  # else the checkpoint resumed from (or none) holds it all
      _checkpoint(session.checkpointer, iteration, state, run, session.writer, session.workdir,
                  rollouts, cursor=before)
    logging.warning("Stopping on a signal during iteration %d's rollout (checkpointed after "
                    "iteration %d)", iteration, iteration - 1)
    return None
  return evaluated, t0, result, shaped, staleness


def _learn_and_record(session: _Session, state, iteration: int, evaluated: dict, t0: float,
                      result, shaped: dict, staleness: dict) -> tuple[Any, dict]:
  """The transcripts, the update and the iteration's metrics (written, on the progress bar,
  to `on_iteration`), and after the last iteration the trained policy's held-out scores.
  (the new state, the metrics)"""
  run, config, workdir = session.run, session.run.config, session.workdir
  t1 = time.perf_counter()
  if multihost.is_primary():  # every process's episodes, in env order
    with writing(workdir, f"the transcripts of iteration {iteration} (transcripts/)"):
      append_transcripts(os.path.join(workdir, "transcripts"), iteration, result.all_episodes)
  kept = [e for e in result.episodes if e.dropped is None]  # this process's
  update_metrics = {}
  if all(e.dropped is not None for e in result.all_episodes):
    logging.warning("Iteration %d: every episode was dropped (%s); no update", iteration,
                    _drop_reasons(result.all_episodes))
  else:
    key = jax.random.fold_in(jax.random.key(config.seed), iteration)
    state, update_metrics = run.learn(state, kept, iteration, jax.random.fold_in(key, 1))
  if session.rollouts is not None:
    session.rollouts.publish(iteration + 1, state.policy)
  t2 = time.perf_counter()
  metrics = {**_iteration_metrics(result, update_metrics, run.team, t0, t1, t2),
             **evaluated, **shaped, **session.compiles.delta().metrics(), **staleness}
  if staleness:  # the learner's wait for its batch; the host's part of the sampler's
    total = max(t2 - t0, 1e-9)  # rollout (time/rollout_s is the learner's wait here)
    metrics["async/learner_wait_share"] = staleness["async/learner_wait_s"] / total
    metrics["time/rollout_host_share"] = (staleness["async/sampler_rollout_s"]
                                          - result.metrics["sampler_s"]) / total
  session.writer.write(iteration, metrics)
  _show(session, metrics, advance=True)
  if session.on_iteration is not None:
    session.on_iteration(iteration, metrics)
  if iteration + 1 == config.iterations and config.eval_every:  # before the last checkpoint
    final = session.heldout(run_lib.policy(config, state), iteration + 1)
    session.writer.write(iteration + 1, final)
    metrics = {**metrics, **final}
    session.shown.update(final)
    _show(session, metrics)
  return state, metrics


def _show(session: _Session, metrics: dict, advance: bool = False) -> None:
  """The progress bar's figures (and one step of it with `advance`)."""
  if session.bar is not None:
    if advance:
      session.bar.update(1)
    session.bar.set_postfix(_postfix(metrics, session.shown))


def _checkpoint_or_stop(session: _Session, state, iteration: int) -> bool:
  """A checkpoint after iteration `iteration` when one is due (every checkpoint_every, the
  last, or on a signal); whether a signal asks the run to stop."""
  config = session.run.config
  done = iteration + 1 == config.iterations
  stop = multihost.any_process(session.preempt.requested)
  if (iteration + 1) % config.checkpoint_every == 0 or done or stop:
    _checkpoint(session.checkpointer, iteration + 1, state, session.run, session.writer,
                session.workdir, session.rollouts)
  if stop:
    logging.warning("Stopping on a signal after iteration %d (checkpointed)", iteration)
  return stop


def _play_and_shape(run: Run, reward_fn, iteration: int, policy, version: int,
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


def _start_async(cleanup, run: Run, state, start, workdir, mesh, sampler_mesh,
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


def _restore(checkpointer: Checkpointer, run: Run, state, workdir: str) -> tuple[Any, int]:
  """(the state to train from, the iteration to start at): the latest checkpoint's, with the
  environments' data cursor restored, or `state` and 0 when there is none."""
  if checkpointer.latest_step() is None:
    return state, 0
  where = f"{workdir}: step {checkpointer.latest_step()}"
  known = checkpointer.read_meta(checkpointer.latest_step()).get("changes_known")
  written = checkpointer.written_at(checkpointer.latest_step())
  state, meta = checkpointer.restore(
      state, config=saved_config.resume_view(run.config_dict, run.config.run_dtype),
      may_differ=saved_config.RESUME_MAY_DIFFER,
      read_config=lambda saved: saved_config.read_for_resume(saved, where, known, written))
  start = int(meta["iteration"])
  run.envs.load_state_dict(meta["envs"])
  logging.warning("Resuming %s from its checkpoint after iteration %d of %d",
                  workdir, start, run.config.iterations)
  return state, start


def _record_config(writer: MetricWriter, workdir: str, step: int, config_dict: dict) -> None:
  """The recorded config (`config.saved.as_recorded`: the algorithm that actually runs, every key
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


def _checkpoint(checkpointer, step, state, run: Run, writer, workdir, rollouts=None,
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
    return_freed_memory()  # process 0's plot below returns its own
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
  return tqdm(total=total, initial=start, desc="training", unit="it", file=sys.stderr)

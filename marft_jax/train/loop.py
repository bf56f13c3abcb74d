"""`train(config, workdir)`: the MARFT training loop, top to bottom.

Per iteration: rollout (the team plays one episode per environment through the sampler, in
the fast decoding layout) → batch and advantages (critic values at rollout time, then GAE,
the token-level backup or GRPO's group normalisation) → one jitted update (PPO epochs ×
minibatches) → metrics, transcripts, checkpoints.

Resume: the checkpoint already in `workdir` always wins. It holds the adapters, the critic,
both optimizer states and the step counter; its meta holds the iteration, the environments'
data cursor and the config. Every PRNG key is `fold_in(seed, iteration)`, so a resumed run
continues exactly as an uninterrupted one would. SIGTERM/SIGINT save and exit cleanly.

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
(gathered: process 0 writes the one transcript file), and the data cursor of the checkpoint
(each process advanced its own envs'; the saved cursor is the whole batch's, so it restores
onto any process count).
One process plays every environment, exactly as before.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from marft_jax import envs as envs_lib
from marft_jax import lora as lora_lib
from marft_jax import compile_stats, multihost, sharding
from marft_jax.architecture import precision
from marft_jax.configs import to_config_dict
from marft_jax.models import layout as layout_lib
from marft_jax.models import loading
from marft_jax.rollout import RolloutConfig, reply_budgets, rollout, write_transcripts
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train import algorithms
from marft_jax.train import critic as critic_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import optim
from marft_jax.train import teams
from marft_jax.train.advantages import Blocks, compute_advantages, kl_rewards
from marft_jax.train.batching import make_batch, per_row_adapters
from marft_jax.train.checkpoint import Checkpointer, PreemptionFlag
from marft_jax.train import local_batch
from marft_jax.train.config import TrainConfig, check_processes
from marft_jax.train.metrics import MetricWriter, plot_learning_curves
from marft_jax.train.update import TrainState, make_update, prepare


@dataclasses.dataclass
class Model:
  """The frozen base: params (training layout), config, tokenizer."""

  params: Any
  config: Any
  tokenizer: Any


# --- building the run's pieces from the config ------------------------------------------------


def build_team(config: TrainConfig):
  """(team profiles, schedule structure) from the config's team section (`teams.build_team`:
  the declared roles, or the task's shipped team)."""
  return teams.build_team(config.team, config.task.name)


def build_envs(config: TrainConfig, team, seed: int, split: str = "train",
               owned: Optional[range] = None, num_envs: Optional[int] = None,
               group_size: Optional[int] = None):
  """An `EnvBatch` of the task's `split` ("train" or "test"; for problem files, the disjoint
  parts of `envs.splits.task_problems`, each problem once per epoch in a seeded order), with
  one grading worker or sandbox shared by its environments; `owned`: the environments this
  process builds and steps (default all); `num_envs`, `group_size`: instead of the config's
  rollout section (an evaluation plays one episode per task)."""
  graded = [p.role for p in team if p.graded]
  task = config.task
  num_tasks, shared = None, ()
  if task.name == "echo":
    make = lambda i: envs_lib.EchoEnv(graded=graded, high=task.echo_high)
  elif task.name == "code":
    from marft_jax.envs import code_env, sandbox, splits
    problems = splits.task_problems("code", task.path, task.test_path)[split == "test"]
    num_tasks, shared = len(problems), (sandbox.Sandbox(sandbox.Limits(wall_s=5.0)),)
    make = lambda i: code_env.CodeEnv(problems, graded_roles=graded, sandbox=shared[0],
                                      test_timeout_s=5.0, shuffle=False)
  else:
    from marft_jax.envs import arithmetic, problems as problems_lib, splits
    from marft_jax.envs.math_env import MathEnv
    from marft_jax.envs.math_grading import Grader
    if task.name == "arithmetic":
      source = arithmetic.ArithmeticProblems(levels=(task.level,), split=split)
    else:
      part = splits.task_problems("math_jsonl", task.path, task.test_path)[split == "test"]
      source = problems_lib.ProblemSet(part, name=split, shuffle=False)
      num_tasks = len(source)
    shared = (Grader(),)
    make = lambda i: MathEnv(source, graded_roles=graded, horizon=task.horizon,
                             grader=shared[0])
  return envs_lib.EnvBatch(make, num_envs or config.rollout.num_envs, seed=seed,
                           group_size=group_size or config.rollout.group_size, owned=owned,
                           num_tasks=num_tasks, closing=shared)


def rollout_settings(config: TrainConfig) -> RolloutConfig:
  """How the trainer's and the evaluation's episodes are played."""
  return RolloutConfig(context_mode=config.rollout.context_mode, horizon=config.task.horizon,
                       max_context=config.rollout.max_context or None,
                       transition=config.team.transition or RolloutConfig.transition)


def load(config: TrainConfig) -> Model:
  params, model_config, tokenizer = loading.load_model(
      config.model.source, param_dtype=config.model.param_dtype,
      compute_dtype=config.model.param_dtype)
  return Model(params, model_config, tokenizer)


def rollout_model(model: Model, config: TrainConfig):
  """(params, model config) in `model.rollout_layout`'s layout: what the sampler runs (a copy
  of the weights in the decoding layout on CPU; made once per run)."""
  choice = config.model.rollout_layout
  layout = {"auto": layout_lib.decoding(), "decoding": layout_lib.DECODING,
            "training": layout_lib.TRAINING}[choice]
  fast = model.config.replace(layout=layout)
  return layout_lib.convert_params(model.params, model.config.layout, layout), fast


def _critic_config(config: TrainConfig):
  if not config.uses_critic:
    return None
  lora = None
  if config.critic.lora_rank:
    lora = lora_lib.LoraConfig(rank=config.critic.lora_rank, alpha=config.critic.lora_rank)
  return critic_lib.CriticConfig(mode=config.critic.mode, hidden=config.critic.hidden, lora=lora)


def init_state(config: TrainConfig, model: Model, num_agents: int, policy_optimizer,
               critic_optimizer) -> TrainState:
  key = jax.random.key(config.seed)
  lora_config = lora_lib.LoraConfig(rank=config.lora.rank, alpha=config.lora.alpha,
                                    targets=config.lora.targets)
  policy = lora_lib.init_adapters(lora_config, model.config, jax.random.fold_in(key, 1),
                                  config.num_adapters)
  if config.init_from:
    paths = [p for p in config.init_from.split(",") if p]
    policy = lora_lib.load_peft_adapters(paths, model.config)
    if policy.num_adapters != config.num_adapters:
      raise ValueError(f"init_from: {len(paths)} adapter folders for "
                       f"{config.num_adapters} adapters")
  critic = None
  critic_config = _critic_config(config)
  if critic_config is not None:
    critic = critic_lib.init_critic(critic_config, model.config, num_agents,
                                    jax.random.fold_in(key, 2))
  return TrainState(policy=policy, critic=critic, policy_opt=policy_optimizer.init(policy),
                    critic_opt=None if critic is None else critic_optimizer.init(critic),
                    step=jnp.zeros((), jnp.int32))


def new_state(config: TrainConfig, model: Model) -> TrainState:
  """The state a run of `config` starts from (or a checkpoint of it restores into): the
  adapters (`init_from`'s, if given), the critic for the team `build_team` makes, and the
  optimizers' states."""
  team, structure = build_team(config)
  return init_state(config, model, len(team) + (structure is not None), *optimizers(config))


def optimizers(config: TrainConfig):
  """(the policy's optimizer, the critic's), with the learning-rate schedule of `config`."""
  o = config.optimizer
  steps_per_iteration = o.epochs * o.minibatches
  schedule = optim.learning_rate(o.lr, o.warmup_iterations * steps_per_iteration,
                                 config.iterations * steps_per_iteration, o.decay)
  policy = optax.adamw(schedule, eps=1e-5, weight_decay=o.weight_decay)
  critic = optax.adam(config.critic.lr, eps=1e-5)
  return policy, critic


def active_adapters(config: TrainConfig, iteration: int) -> np.ndarray:
  """[A] bool: the adapters the agent-by-agent schedule trains at `iteration`."""
  k, A = config.optimizer.agent_iteration_interval, config.num_adapters
  if k == 0 or config.team.shared_adapter:
    return np.ones((A,), bool)
  return np.arange(A) == (iteration // k) % A


# --- the loop ----------------------------------------------------------------------------------


def train(config: TrainConfig, workdir: str, model: Optional[Model] = None,
          progress: bool = True, on_iteration: Optional[Callable] = None,
          reward_fn: Optional[rewards_lib.RewardFn] = None) -> dict:
  """Trains; returns the last iteration's metrics. `model`: a loaded base (tests pass the
  tiny one); default: `config.model.source`. `reward_fn(episode, team)`: your reward on each
  whole episode (`rollout.rewards`; the launch script imports `config.reward.fn`). The config
  is resolved first (`algorithms.resolve`: the algorithm's keys filled in, contradictions
  refused)."""
  config = algorithms.resolve(config)
  mesh = sharding.mesh_from_config(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  check_processes(config, tuple(mesh.shape.values()), jax.process_count())
  os.makedirs(workdir, exist_ok=True)
  model = load(config) if model is None else model
  with jax.set_mesh(mesh), precision.scope(config.model.matmul_precision,
                                           config.model.param_dtype):
    return _train(config, workdir, mesh, _place_model(model, mesh), progress, on_iteration,
                  reward_fn)


def _place_model(model: Model, mesh) -> Model:
  return dataclasses.replace(model, params=jax.device_put(
      model.params, sharding.param_shardings(mesh, model.params)))


def _with_remat(model: Model, remat: bool) -> Model:
  """The learner's forward recomputes each layer in the backward pass (`Layout.remat`)."""
  layout = dataclasses.replace(model.config.layout, remat=remat)
  return dataclasses.replace(model, config=model.config.replace(layout=layout))


def _train(config, workdir, mesh, model, progress, on_iteration, reward_fn) -> dict:
  model = _with_remat(model, config.model.remat)
  team, structure = build_team(config)
  num_agents = len(team) + (1 if structure is not None else 0)
  rollout_params, rollout_config = rollout_model(model, config)
  judge = build_judge(config, model, (rollout_params, rollout_config))
  # Several processes: each plays the environments whose sampler rows its devices hold.
  layout = multihost.ProcessRows(mesh) if jax.process_count() > 1 else None
  envs = build_envs(config, team, seed=config.seed,
                    owned=None if layout is None else layout.block(config.rollout.num_envs))
  policy_optimizer, critic_optimizer = optimizers(config)
  state = init_state(config, model, num_agents, policy_optimizer, critic_optimizer)
  state_shardings = lora_lib.follow_adapters(mesh, state)
  state = jax.device_put(state, state_shardings)
  critic_config = _critic_config(config)
  critic_values, critic_hidden = critic_lib.value_fns(critic_config, model.config)
  update = make_update(model.config, config.loss, policy_optimizer, critic_optimizer,
                       critic_values, config.num_adapters, config.optimizer.epochs,
                       config.optimizer.minibatches,
                       out_shardings=(state_shardings, sharding.replicated(mesh)))
  old_values_fn = None if critic_values is None else jax.jit(critic_values)
  config_dict = to_config_dict(config).to_dict()
  start = 0
  checkpointer = Checkpointer(workdir, max_to_keep=config.max_to_keep)
  if checkpointer.latest_step() is not None:
    state, meta = checkpointer.restore(state, config=config_dict,
                                       may_differ=("iterations", "checkpoint_every", "mesh",
                                                   "eval_every", "eval_episodes"),
                                       defaults=_resolved_defaults(config))
    start = int(meta["iteration"])
    envs.load_state_dict(meta["envs"])
    logging.warning("Resuming %s from its checkpoint after iteration %d of %d",
                    workdir, start, config.iterations)
  writer = MetricWriter(workdir, enabled=multihost.is_primary(), resume_step=start)
  _record_config(writer, workdir, start, config_dict)
  rows = config.rollout.num_envs * _turns_per_episode(config, structure)
  pad = model.tokenizer.pad_token_id
  pad = model.tokenizer.eos_token_id if pad is None else pad
  metrics: dict = {}
  shown: dict = {}  # the latest held-out evaluation, kept on the progress bar
  bar = _progress(progress, start, config.iterations)
  settings = rollout_settings(config)
  learn = functools.partial(
      _learn, model=model, config=config, update=update, critic_hidden=critic_hidden,
      old_values_fn=old_values_fn, envs=envs, num_roles=len(team), mesh=mesh, layout=layout,
      agent_layers=envs_lib.agent_layers(structure, team),
      reply_budgets=reply_budgets(team, structure),
      # Every minibatch splits evenly over the batch shards (padding rows are all masked).
      num_rows=_round_up(rows, config.optimizer.minibatches * sharding.batch_shards(mesh)))
  heldout = functools.partial(_heldout, config=config, model=model,
                              weights=(rollout_params, rollout_config))
  compiles = compile_stats.CompileCounter()  # per iteration: time/compiles, time/compile_s
  try:
    with PreemptionFlag() as preempt, checkpointer:
      for iteration in range(start, config.iterations):
        key = jax.random.fold_in(jax.random.key(config.seed), iteration)
        # Held-out accuracy of the policy this iteration samples with (at 0: the untuned team).
        evaluated = heldout(state.policy, iteration) if _eval_due(config, iteration) else {}
        shown.update(evaluated)
        t0 = time.perf_counter()
        result = rollout(envs, team, structure, rollout_params, rollout_config,
                         model.tokenizer, jax.random.fold_in(key, 0), lora=state.policy,
                         config=settings, policy_version=iteration, rows=layout)
        shaped = _shape_rewards(result.episodes, team, judge, reward_fn,
                                jax.random.fold_in(key, 2))
        t1 = time.perf_counter()
        if multihost.is_primary():  # every process's episodes, in env order
          write_transcripts(os.path.join(workdir, "transcripts",
                                         f"iteration_{iteration:05d}.jsonl"), result.all_episodes)
        kept = [e for e in result.episodes if e.dropped is None]  # this process's
        update_metrics = {}
        if all(e.dropped is not None for e in result.all_episodes):
          logging.warning("Iteration %d: every episode was dropped (%s); no update",
                          iteration, _drop_reasons(result.all_episodes))
        else:
          state, update_metrics = learn(state, kept, iteration, jax.random.fold_in(key, 1),
                                        pad_id=pad)
        t2 = time.perf_counter()
        metrics = {**_iteration_metrics(result, update_metrics, team, t0, t1, t2), **evaluated,
                   **shaped, **compiles.delta().metrics()}
        writer.write(iteration, metrics)
        if bar is not None:
          bar.update(1)
          bar.set_postfix(_postfix(metrics, shown))
        if on_iteration is not None:
          on_iteration(iteration, metrics)
        done = iteration + 1 == config.iterations
        if done and config.eval_every:  # the trained policy, before the final checkpoint
          final = heldout(state.policy, iteration + 1)
          writer.write(iteration + 1, final)
          metrics = {**metrics, **final}
          shown.update(final)
          if bar is not None:
            bar.set_postfix(_postfix(metrics, shown))
        stop = multihost.any_process(preempt.requested)
        if (iteration + 1) % config.checkpoint_every == 0 or done or stop:
          _checkpoint(checkpointer, iteration + 1, state, envs, config_dict, writer, workdir,
                      config)
        if stop:
          logging.warning("Stopping on a signal after iteration %d (checkpointed)", iteration)
          break
  finally:
    writer.close()
    envs.close()
    if bar is not None:
      bar.close()
  return metrics


def _learn(state, kept, iteration, key, *, pad_id, model, config, update, critic_hidden,
           old_values_fn, envs, num_roles, num_rows, mesh, layout, agent_layers,
           reply_budgets=None):
  """Batch → π_old and critic values → advantages → one jitted update. (new state, metrics)

  The batch goes to the devices with its rows split over the mesh; advantages are computed on
  the host, so the critic's values come back to it. Several processes (`layout`): `kept` are
  this process's episodes (maybe none); it builds, places and reads back only its block of
  the rows, and the batch-wide numbers are reduced over the processes."""
  if layout is None:
    batch = jax.tree.map(np.asarray, make_batch(kept, pad_id, num_rows=num_rows,
                                                reply_budgets=reply_budgets))
    placed = lambda b: jax.device_put(b, sharding.batch_shardings(mesh, b))
    read, blocks = multihost.to_host, None
  else:
    batch = local_batch.local_block(kept, pad_id, num_rows // layout.processes)
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
  batch = compute_advantages(batch, kept, config.advantage, num_roles, groups, blocks=blocks,
                             agent_layers=agent_layers, kl_reward=kl)
  state, metrics = update(
      state, model.params, placed(batch), extras,
      jnp.asarray(active_adapters(config, iteration)),
      jnp.asarray(iteration >= config.critic.warmup_iterations), key)
  metrics = {k: float(v) for k, v in metrics.items()}
  if kl is not None:  # this process's mean KL reward per trained token
    metrics["kl_reward"] = float(kl.sum() / max(batch.act_mask.sum(), 1))
  tokens = float(batch.mask.sum())
  if layout is not None:  # this process's block -> the whole batch's
    tokens = float(multihost.sum_over_processes(np.asarray([tokens]))[0])
  # The largest |learner − sampler| log-prob over the trained tokens (the update's, over the
  # whole batch): far above ~1e-5 in f32 means the two disagree about the policy.
  metrics["logp/sampler_learner_max_gap"] = metrics["behaviour/logp_gap_max"]
  # Tokens through the learner's forward + backward: every real token, every epoch.
  metrics["update_tokens"] = tokens * config.optimizer.epochs
  return state, metrics


def _record_config(writer: MetricWriter, workdir: str, step: int, config_dict: dict) -> None:
  """The resolved config (the algorithm that actually runs, every key it decided filled in):
  `config.json` in the run folder and a "config" text in the metrics (TensorBoard's text tab
  and texts.jsonl) at the step the launch starts from."""
  if not multihost.is_primary():
    return
  text = json.dumps(config_dict, indent=2, sort_keys=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(text + "\n")
  writer.write_text(step, "config", text)


def _resolved_defaults(config: TrainConfig) -> dict:
  """The algorithm's resolved defaults: what a key missing from an older checkpoint's config
  meant when that checkpoint was written (its fields predate the key)."""
  return to_config_dict(algorithms.resolve(TrainConfig(algorithm=config.algorithm))).to_dict()


def build_judge(config: TrainConfig, model: Model, weights) -> Optional[rewards_lib.Judge]:
  """The LLM judge of `config.reward` (None when off): the policy's base in the rollout's
  layout (`weights`), or a second model's, with its adapter if one is given."""
  r = config.reward
  if not r.judge:
    return None
  params, model_config, tokenizer = *weights, model.tokenizer
  if r.judge_model:
    judge_model = Model(*loading.load_model(r.judge_model, param_dtype=config.model.param_dtype,
                                            compute_dtype=config.model.param_dtype))
    params, model_config = rollout_model(judge_model, config)
    tokenizer = judge_model.tokenizer
  adapter = None
  if r.judge_adapter:
    adapter = lora_lib.load_peft_adapters([r.judge_adapter], model_config)
  return rewards_lib.Judge(params, model_config, tokenizer, adapter, prompt=r.judge_prompt,
                           max_new_tokens=r.judge_max_new_tokens, weight=r.judge_weight,
                           parse=rewards_lib.parse_verdict)


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


def _checkpoint(checkpointer, step, state, envs, config_dict, writer, workdir, config):
  meta = {"iteration": step, "envs": _env_cursor(envs), "config": config_dict,
          "policy_version": step}
  checkpointer.save(step, state, meta, force=True)  # every process: its own shards
  names = teams.adapter_names(config.team, config.task.name)
  adapters = multihost.to_host(state.policy)  # collective: every process takes part
  if not multihost.is_primary():
    return
  checkpointer.export_peft(step, adapters, names, config.model.source)
  writer.flush()
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


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


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

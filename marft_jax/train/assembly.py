"""The run's pieces, built from its config: the base model, the team and its graph, the
environments, the sampler's copy of the weights, the judge, the optimizers and the state a
run starts from. One place for `loop.train`, `evaluate` and the launch scripts, so training
and evaluation build the same team from the same keys.

Which saved keys a checkpoint must share with the config that reads it is also decided here:
a resumed run every key but `RESUME_MAY_DIFFER`; an evaluation only `EVAL_MUST_MATCH` (the
adapters' shape and the team that runs them), so a trained team can be scored on any task.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import math
import shutil
from typing import Any, Collection, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

from marft_jax import envs as envs_lib
from marft_jax import lora as lora_lib
from marft_jax import sharding
from marft_jax.architecture import precision
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.models import layout as layout_lib
from marft_jax.models import loading
from marft_jax.models.tokenizer import check_tokenizer_fits
from marft_jax.rollout import RolloutConfig, check_reply_budgets
from marft_jax.rollout import rewards as rewards_lib
from marft_jax.train import algorithms
from marft_jax.train import config_history
from marft_jax.train import critic as critic_lib
from marft_jax.train import optim
from marft_jax.train import tasks
from marft_jax.train import teams
from marft_jax.train.checkpoint import CheckpointMismatchError
from marft_jax.train.config import TrainConfig
from marft_jax.train.update import TrainState, make_update


def as_recorded(config: TrainConfig) -> TrainConfig:
  """The config as a run records it (checkpoint meta, config.json): resolved
  (`algorithms.resolve`: the algorithm's "auto" keys filled in), and an empty `team.roles`
  written out as the task's shipped team, so the record names every role's prompt, adapter
  and sampling, and a config file that spells the same team out records the same config."""
  config = algorithms.resolve(config)
  if config.team.roles:
    return config
  team = dataclasses.replace(config.team, **teams.shipped(config.task.name,
                                                          config.team.num_roles))
  return dataclasses.replace(config, team=team)


def read_saved_config(saved: Mapping[str, Any], where: str,
                      written_at: Optional[datetime.datetime] = None) -> TrainConfig:
  """A checkpoint's saved config (meta["config"]) as this version of the library reads it:
  keys added since it was written take the values that reproduce the code that wrote it
  (`config_history.fill_missing`: e.g. loss.behaviour_correction "off", not "auto"; its
  write time `written_at`, `Checkpointer.written_at`, decides where keys cannot), then
  `as_recorded`, so that it compares equal to the config that trains today as it did.
  `where` (e.g. "runs/x: step 8") prefixes a `CheckpointMismatchError`."""
  try:
    return as_recorded(from_config_dict(TrainConfig,
                                        config_history.fill_missing(saved, written_at)))
  except ValueError as e:
    raise CheckpointMismatchError(f"{where}: its saved config does not load: {e}") from None


def read_for_resume(saved: Mapping[str, Any], where: str,
                    changes_known: Optional[int] = None,
                    written_at: Optional[datetime.datetime] = None) -> dict:
  """A checkpoint's saved config as a resumed run compares it with its own (`resume_view` of
  `read_saved_config`). A behaviour of the run that wrote it that no value of today's keys
  reproduces (`config_history.unreproducible`, and the changes without a key after
  `changes_known`, its meta's record: `config_history.changed_since`) is a
  `CheckpointMismatchError` naming the key."""
  refused = config_history.unreproducible(saved)
  if not refused:
    config = read_saved_config(saved, where, written_at)
    refused = config_history.changed_since(changes_known, config)
  if refused:
    reasons = "; ".join(f"{key}: {why}" for key, why in refused)
    raise CheckpointMismatchError(
        f"{where} was written by an earlier version that this one cannot continue as it "
        f"trained ({reasons}). Resume it with that version, or start again in a fresh workdir")
  return resume_view(to_config_dict(config).to_dict(), config.run_dtype)


def resume_view(config: Mapping[str, Any], run_dtype: str) -> dict:
  """A recorded config with its settings that mean the same behaviour written one way:
  `model.matmul_precision` "auto" as the precision it resolves to for the model's dtype;
  `model.lora_update_f32` True where the run loads no bf16 backbone (`run_dtype`,
  `TrainConfig.run_dtype`: the key changes bf16 models only)."""
  config = copy.deepcopy(dict(config))
  model = config["model"] = dict(config["model"])
  model["matmul_precision"] = precision.resolve(model["matmul_precision"],
                                                model["param_dtype"])
  if run_dtype == "float32":
    model["lora_update_f32"] = True
  return config


# Keys a resumed run may change (extend the run, re-shard it, evaluate more or less often);
# any other difference from the checkpoint's saved config is refused, naming the key.
RESUME_MAY_DIFFER = ("iterations", "checkpoint_every", "mesh", "eval_every", "eval_episodes")
# Keys an evaluation of a checkpoint must share with the run that wrote it: the base model and
# the adapters' shape, and the team running them (`evaluate.restore_policy` also compares the
# roles and adapters `build_team` makes). Everything else, the task and data above all, may
# differ.
EVAL_MUST_MATCH = ("model.source", "lora.rank", "lora.alpha", "lora.use_rslora", "lora.targets",
                   "team.num_roles", "team.shared_adapter", "team.graph")
# Keys (or sections) that shape the episodes an evaluation plays: an evaluation under other
# values than the run trained with says which (`evaluate.restore_policy`), since the launch
# takes its settings from the config file and flags, not from the checkpoint.
EVAL_SHOWS_IF_CHANGED = ("task", "team", "rollout.context_mode", "rollout.max_context",
                         "model.param_dtype", "model.matmul_precision", "model.lora_update_f32")


@dataclasses.dataclass
class Model:
  """The frozen base: params (in `config.layout`), config, tokenizer.

  Checked when made, for a base put together by hand (`train(model=...)`): params of another
  model or layout, or a tokenizer with ids the embedding has no row for, are a ValueError
  naming them here, not a message about adapters or token ids in the first rollout."""

  params: Any
  config: Any
  tokenizer: Any

  def __post_init__(self):
    try:
      layout_lib.check_params_layout(self.params, self.config.layout, self.config)
    except ValueError as e:
      raise ValueError(f"Model: {e}") from None
    check_tokenizer_fits(self.tokenizer, self.config.vocab_size, "Model")


def build_team(config: TrainConfig):
  """(team profiles, schedule structure) from the config's team section (`teams.build_team`:
  the declared roles, or the task's shipped team), checked against `rollout.max_context` when
  the config sets it (the model's positions are checked when the rollout knows them)."""
  team, structure = teams.build_team(config.team, config.task.name)
  if config.rollout.context_mode == "shared_stream" and \
      isinstance(structure, envs_lib.AgentGraph) and not structure.is_sequential():
    # The rollout would refuse it too, but only after the model has loaded.
    raise ValueError(f"rollout.context_mode='shared_stream' (algorithm={config.algorithm!r}) "
                     f"with team.graph='dag' and team.edges={config.team.edges!r}: parallel "
                     "branches each see only their ancestors, which one stream cannot show; "
                     "use rollout.context_mode='per_agent' (an algorithm that allows it) or "
                     "edges that order every role")
  if config.rollout.context_mode == "shared_stream" and \
      config.task.name in envs_lib.team_tasks.PRIVATE_VIEWS:
    raise ValueError(f"rollout.context_mode='shared_stream' (algorithm={config.algorithm!r}) "
                     f"with task.name={config.task.name!r}: each role sees a view of its own, "
                     "which one stream would show to every later role; use "
                     "rollout.context_mode='per_agent' (an algorithm that allows it)")
  if config.rollout.max_context:
    check_reply_budgets(team, structure, config.rollout.max_context)
  return team, structure


def read_task_data(config: TrainConfig) -> None:
  """Reads and checks what the task needs (its entry, `tasks.lookup`): its problem files
  ("math_jsonl", "code": a missing file or a malformed line is an error naming it, OSError
  or ValueError, before anything slow starts; the problems stay cached for `build_envs`), its
  sandbox mode (`check_sandbox`), a factory of your own (`tasks.check`: imported, built for
  each split)."""
  from marft_jax.envs import splits
  entry = tasks.lookup(config.task.name)
  if entry.problem_file:
    splits.task_problems(config.task.name, config.task.path, config.task.test_path)
  if entry.sandbox:
    check_sandbox(config.task.sandbox)
  tasks.check(config.task)


# A code env step's tests share a budget of this many tests' wall-clock limits (a step runs
# up to 10 tests per graded role, `TEST_PARALLEL` at a time).
BUDGET_TESTS = 12
TEST_PARALLEL = 2


def build_sandbox(settings):
  """The code task's `envs.sandbox.Sandbox` in `settings`' mode and limits (`task.sandbox`,
  a `config.SandboxSection`); its environments share it."""
  from marft_jax.envs import sandbox
  limits = sandbox.Limits(wall_s=settings.wall_s, memory_mb=settings.memory_mb,
                          processes=settings.processes, file_mb=settings.file_mb)
  return sandbox.Sandbox(limits, mode=settings.mode, max_parallel=settings.parallel)


def check_sandbox(settings) -> None:
  """With `task.sandbox.mode='bwrap'`: a ValueError naming the key where bubblewrap is not
  installed, or cannot run a program here (a probe run, about 0.1 s), so that a run asking
  for it fails before its model loads, not in its first rollout. Other modes choose what
  works when the sandbox is first used."""
  if settings.mode != "bwrap":
    return
  if shutil.which("bwrap") is None:
    raise ValueError("task.sandbox.mode='bwrap': bubblewrap is not installed here (no bwrap "
                     "on PATH: apt-get install bubblewrap), or set task.sandbox.mode='auto'")
  box = build_sandbox(settings)
  try:
    box.plan  # probes: raises RuntimeError when no bwrap plan runs its test program
  except RuntimeError as e:
    raise ValueError(f"task.sandbox.mode='bwrap': bwrap cannot run programs here "
                     f"({str(e).strip()[-300:]}); set task.sandbox.mode='auto'") from None
  finally:
    box.close()


def check_training_files(config: TrainConfig, resuming: bool = False) -> None:
  """Checks every file a training run reads besides its base model, before anything slow
  starts: the task's problem files (`read_task_data`), `init_from`'s PEFT folders (unless
  `resuming`: the checkpoint wins, and they are not read) and, with the judge on,
  `reward.judge_model` and `reward.judge_adapter` (found and well formed: the folders'
  configs are read, their tensors are not). A bad one is an OSError or ValueError naming the
  config key and the file."""
  if not tasks.lookup(config.task.name).trains:  # humaneval
    raise ValueError("task.name='humaneval': a benchmark to evaluate on (launch.eval), never "
                     "trained on; train on task.name='code' and evaluate with "
                     "--config.task.name=humaneval")
  read_task_data(config)
  if not resuming:
    check_init_from(config)
  if config.reward.judge_adapter:
    with _naming("reward.judge_adapter", config.reward.judge_adapter):
      lora_lib.check_peft_folder(config.reward.judge_adapter)
  if config.reward.judge_model:
    with _naming("reward.judge_model", config.reward.judge_model):
      loading.source_kind(config.reward.judge_model)


def check_init_from(config: TrainConfig) -> None:
  """Each `init_from` folder holds an adapter of `config.lora`'s rank, scale and targets
  (read from its config and its weights file's tensor names; no tensor is read).

  The run trains, records and checkpoints the adapters as `config.lora` describes them, and
  an evaluation rebuilds them from that record: an adapter of another scale would train
  under its own scale and be scored under the config's. A difference is a ValueError naming
  the folder and the `lora.*` values that would match it; `lora.dropout_rate` is the run's
  own (a training setting, not part of the adapter)."""
  want = config.lora
  targets = lambda c: ", ".join(c.target_names())
  for folder in config.init_from_folders:
    with _naming("init_from", folder):
      found = lora_lib.read_peft_lora_config(folder)
      # The alpha that gives the folder's scale at its rank, under the config's rsLoRA choice.
      alpha = found.scale * (math.sqrt(found.rank) if want.use_rslora else found.rank)
      differences, fixes = [], []
      if found.rank != want.rank:
        differences.append(f"rank {found.rank} (config.lora: {want.rank})")
        fixes.append(f"lora.rank={found.rank}")
      if not math.isclose(found.scale, want.scale, rel_tol=1e-6):
        differences.append(f"scale {found.scale:g} (config.lora: {want.scale:g})")
      if not math.isclose(alpha, want.alpha, rel_tol=1e-6):
        fixes.append(f"lora.alpha={alpha:g}")
      if targets(found) != targets(want):
        differences.append(f"targets {targets(found)} (config.lora: {targets(want)})")
        fixes.append(f"lora.targets='{'|'.join(found.target_names())}'")
      if differences:
        raise ValueError(f"its adapter is not the one config.lora describes: "
                         f"{'; '.join(differences)}. Set {' '.join(fixes)} to train from it")
      layers = lora_lib.check_peft_folder(folder)[0].get("layers_to_transform")
      if layers is not None:  # the other layers load as a = b = 0: no gradient ever moves them
        raise ValueError(f"its adapter covers only layers {layers} (layers_to_transform); "
                         "config.lora trains every layer, and the layers it lacks could "
                         "not train from zero factors")


@contextlib.contextmanager
def _naming(key: str, value: str):
  """Prefixes an OSError or ValueError raised inside with `key=value`."""
  try:
    yield
  except (OSError, ValueError) as e:
    kind = (FileNotFoundError if isinstance(e, FileNotFoundError)
            else OSError if isinstance(e, OSError) else ValueError)
    raise kind(f"{key}={value!r}: {e}") from None


def build_envs(config: TrainConfig, team, seed: int, split: str = "train",
               owned: Optional[range] = None, num_envs: Optional[int] = None,
               group_size: Optional[int] = None, trained: Collection[str] = ()):
  """An `EnvBatch` of the task's `split` ("train" or "test"; for problem files, the disjoint
  parts of `envs.splits.task_problems`, each problem once per epoch in a seeded order), with
  one grading worker or sandbox shared by its environments; `owned`: the environments this
  process builds and steps (default all); `num_envs`, `group_size`: instead of the config's
  rollout section (an evaluation plays one episode per task); `trained`: fingerprints of
  problems a checkpoint trained on, left out of the "test" split (a problem file's:
  `trained_problems.heldout_problems`; generated arithmetic: `trained_problems.Unseen`; a
  factory's: `tasks.unplayed`). The task's entry builds them (`tasks.lookup`)."""
  built = tasks.lookup(config.task.name).build(config.task, team, split, seed, trained)
  return envs_lib.EnvBatch(built.make, num_envs or config.rollout.num_envs, seed=seed,
                           group_size=group_size or config.rollout.group_size, owned=owned,
                           num_tasks=built.num_tasks, closing=built.shared)


def rollout_settings(config: TrainConfig) -> RolloutConfig:
  """How the trainer's and the evaluation's episodes are played."""
  return RolloutConfig(context_mode=config.rollout.context_mode, horizon=config.task.horizon,
                       max_context=config.rollout.max_context or None,
                       transition=config.team.transition or RolloutConfig.transition)


def load(config: TrainConfig, backbone: Optional[str] = None) -> Model:
  """The base model of `backbone` (default: the roles' first, `used_backbones`; the main
  one: model.source, param_dtype)."""
  declared = config.model.backbone(backbone or config.used_backbones[0])
  params, model_config, tokenizer = loading.load_model(
      declared.source, param_dtype=declared.param_dtype, compute_dtype=declared.param_dtype)
  return Model(params, model_config, tokenizer)


def rollout_model(model: Model, config: TrainConfig, backbone: Optional[str] = None):
  """(params, model config) in `backbone`'s rollout_layout (default: the roles' first
  backbone's; model.rollout_layout for the main one): what the sampler runs (a copy of the
  weights in the decoding layout on CPU; made once per run), with model.lora_update_f32."""
  choice = config.model.backbone(backbone or config.used_backbones[0]).rollout_layout
  layout = {"auto": layout_lib.decoding(), "decoding": layout_lib.DECODING,
            "training": layout_lib.TRAINING}[choice]
  fast = model.config.replace(layout=layout, lora_update_f32=config.model.lora_update_f32)
  return layout_lib.convert_params(model.params, model.config.layout, layout), fast


def critic_config(config: TrainConfig) -> Optional[critic_lib.CriticConfig]:
  """The critic the config asks for (None: the algorithm has none)."""
  return config.critic.critic_config() if config.uses_critic else None


def init_state(config: TrainConfig, model: Model, num_agents: int, policy_optimizer,
               critic_optimizer) -> TrainState:
  key = jax.random.key(config.seed)
  policy = lora_lib.init_adapters(config.lora, model.config, jax.random.fold_in(key, 1),
                                  config.num_adapters)
  if config.init_from_folders:  # as many as adapters (`algorithms.resolve` checks)
    check_init_from(config)
    loaded = lora_lib.load_peft_adapters(config.init_from_folders, model.config)
    # The scale as the config computes it (the check allows JSON's rounding of alpha), so a
    # checkpoint restored into `config.lora`'s adapters is these, bit for bit.
    policy = loaded.replace(scale=policy.scale, dropout_rate=policy.dropout_rate)
  critic = None
  critic_settings = critic_config(config)
  if critic_settings is not None:
    critic = critic_lib.init_critic(critic_settings, model.config, num_agents,
                                    jax.random.fold_in(key, 2))
  return TrainState(policy=policy, critic=critic, policy_opt=policy_optimizer.init(policy),
                    critic_opt=None if critic is None else critic_optimizer.init(critic),
                    step=jnp.zeros((), jnp.int32))


def num_agents(team, structure) -> int:
  """The agents that act in `build_team`'s team, as the rollout numbers them
  (`envs.acting_profiles`): its roles, and the orchestrator when the graph has one (it routes
  with an adapter and a value of its own). A DAG adds no agent."""
  return len(envs_lib.acting_profiles(team, structure))


def new_state(config: TrainConfig, model: Model) -> TrainState:
  """The state a run of `config` starts from (or a checkpoint of it restores into): the
  adapters (`init_from`'s, if given), the critic for the team `build_team` makes, and the
  optimizers' states."""
  return init_state(config, model, num_agents(*build_team(config)), *optimizers(config))


@dataclasses.dataclass(frozen=True)
class Learner:
  """One base's learner: its base (training layout), update and critic functions."""

  name: str  # its backbone
  model: Model
  update: Any  # `update.make_update`'s
  critic_hidden: Any  # `critic.value_fns`' hidden, or None
  old_values: Any  # `critic.batch_values_fn`, or None
  num_rows: int  # its batch's rows, rounded up so every minibatch splits over the shards
  pad_id: int


def make_learner(config: TrainConfig, name: str, model: Model, num_adapters: int, rows: int,
                 mesh, policy_optimizer, critic_optimizer, state_shardings,
                 with_critic: bool = True) -> Learner:
  """The `Learner` of `model` (backbone `name`) training `num_adapters` adapters over
  batches of `rows` rows (padding rows added, all masked, so every minibatch splits evenly
  over the batch shards); its update keeps `state_shardings` (`lora.follow_adapters`).
  `with_critic` False: its update trains the policy alone (a split team's shared critic
  trains on its own, `shared_critic`)."""
  values, hidden = critic_lib.value_fns(critic_config(config) if with_critic else None,
                                        model.config)
  minibatches = config.optimizer.minibatches
  one_device, num_rows = update_rows(rows, minibatches, mesh)
  update = make_update(model.config, config.loss, policy_optimizer, critic_optimizer, values,
                       num_adapters, config.optimizer.epochs, minibatches,
                       out_shardings=(state_shardings, sharding.replicated(mesh)),
                       logical_rows=one_device)
  return Learner(
      name=name, model=model, update=update, critic_hidden=hidden,
      old_values=None if values is None else critic_lib.batch_values_fn(
          values, minibatches),
      num_rows=num_rows, pad_id=pad_id(model.tokenizer))


def update_rows(rows: int, minibatches: int, mesh) -> tuple[int, int]:
  """(the update's rows on one device: `rows` rounded up to the minibatches; its rows on
  `mesh`: rounded up so that every minibatch splits over the batch shards). The extra rows
  are padding that only fills the minibatches (`update.minibatch_slots`)."""
  multiple = minibatches * sharding.batch_shards(mesh)
  return -(-rows // minibatches) * minibatches, -(-rows // multiple) * multiple


def pad_id(tokenizer) -> int:
  """The token id a batch pads with: the tokenizer's pad token, else its end of sequence."""
  pad = tokenizer.pad_token_id
  return tokenizer.eos_token_id if pad is None else pad


def optimizers(config: TrainConfig):
  """(the policy's optimizer, the critic's), with the learning-rate schedule of `config`."""
  o = config.optimizer
  steps_per_iteration = o.epochs * o.minibatches
  schedule = optim.learning_rate(o.lr, o.warmup_iterations * steps_per_iteration,
                                 config.iterations * steps_per_iteration, o.decay)
  policy = optax.adamw(schedule, eps=1e-5, weight_decay=o.weight_decay)
  critic = optax.adam(config.critic.lr, eps=1e-5)
  return policy, critic


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

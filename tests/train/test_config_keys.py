"""Every key of `TrainConfig` is honoured or refused, under every algorithm (issue 39).

The keys are generated from the config itself (`_leaves`: every dataclass field, recursively,
including `team.roles.<name>.*` of a team that declares its roles), so a key added later is
covered without editing this file. For each key, each changed valid value (`_changes`: a bool
flipped, an int + 1, a float scaled by 0.01, every other allowed value of a choice, None <->
a value, a tuple grown, a mapping given one more entry, a free string back to its default or
to "x") and each algorithm, one of:

  * refused before the model is used: a ValueError naming the key, from building the config
    (what `--config.<key>=` does), `algorithms.resolve` or `loop.train`'s checks;
  * a one-iteration tiny run that differs from the algorithm's baseline run: its rollout, its
    advantages, its updated state (adapters, critic, optimizer moments) or its metrics;
  * the key stands in `NO_EFFECT`: by design it changes nothing in one iteration, and the test
    named beside it shows what it does.

A value the algorithm resolves to what its baseline already was (`critic.mode='shared'` for
"auto"; `algorithm='marft_a'` for single-agent PPO's team of one) is no change. Anything else
fails, naming the key, the value and the algorithm.

Cost: the refusals are checked for every key, value and algorithm (no model). The runs share
one tiny model and their compiles; each stops at the first stage that differs (a rollout
that differs costs no update). Keys are run under every algorithm that accepts them, except
that each (key, value) runs under one algorithm of each kind (`_KINDS`: action level with a
critic, token level with a critic, GRPO), chosen in turn, so every key meets every kind and
the algorithms share the runs (a pairwise cover of key x algorithm kind).
"""

import copy
import dataclasses
import fnmatch
import functools
import os
import re
import tempfile
import typing

import jax
import numpy as np
import pytest

from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.train import algorithms, loop, teams
from marft_jax.train import config as config_lib
from marft_jax.lora.config import LoraConfig
from marft_jax.train import run as run_lib
from tests.train import echo_config

ALGORITHMS = tuple(algorithms.ALGORITHMS)


@functools.lru_cache(maxsize=None)
def baseline(algorithm: str) -> config_lib.TrainConfig:
  """The unresolved config each changed run is compared with: arithmetic (whose episodes go
  on for `horizon` tries while the answer is wrong: the tiny model's always is), two tries,
  the echo team's short roles (one under single-agent PPO), `varied_reward`, tiny shapes.
  Only keys the algorithm reads are set."""
  a = algorithms.get(algorithm)
  base = config_lib.TrainConfig(algorithm=algorithm)
  roles = a.num_roles or 2
  team = dataclasses.replace(base.team, **teams.shipped("echo", roles), last_max_new_tokens=3,
                             temperature=0.7, **({"max_new_tokens": 3} if roles > 1 else {}))
  sections = dict(
      task=config_lib.TaskSection(name="arithmetic", level=1, horizon=2), team=team,
      rollout=dataclasses.replace(base.rollout, num_envs=4),
      lora=LoraConfig(rank=4, alpha=8.0, targets="q_proj|v_proj"),  # a smaller update to compile
      optimizer=config_lib.OptimizerSection(lr=5e-2, epochs=2, minibatches=2),
      reward=config_lib.RewardSection(fn=f"{echo_config.__name__}:varied_reward"),
      iterations=1, checkpoint_every=1000)
  if a.critic:
    sections["critic"] = dataclasses.replace(base.critic, hidden=(16,), lr=3e-3)
  return dataclasses.replace(base, **sections)


# --- the keys and their changed values --------------------------------------------------------


def _leaves(section, prefix=""):
  """[(dotted key, type hint, value)] of every field of `section`, recursively; a named
  section tuple (`team.roles`) by name, as `--config.team.roles.<name>.<key>` reaches it."""
  out = []
  hints = typing.get_type_hints(type(section))
  for field in dataclasses.fields(section):
    value, key = getattr(section, field.name), prefix + field.name
    if dataclasses.is_dataclass(value):
      out += _leaves(value, key + ".")
    elif (isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0])):
      for item in value:
        out += [leaf for leaf in _leaves(item, f"{key}.{item.name}.")
                if leaf[0] != f"{key}.{item.name}.name"]
    else:
      out.append((key, hints[field.name], value))
  return out


def _allowed(config, key):
  """The allowed values of a choice key, as its own refusal lists them ("use one of (...)",
  "use 'a' or 'b'"), or None for a free string."""
  try:
    _build(config, key, "\x00?")
  except ValueError as e:
    tail = str(e).split("\x00?", 1)[-1]
    if "use" in tail:
      allowed = re.findall(r"'([^'\x00]*)'", tail.split("use", 1)[1])
      return allowed if len(allowed) > 1 else None  # one: a format ('package.module:fn')
  return None


def _changes(config, key, hint, value):
  """Changed valid values of `key` (see the module docstring)."""
  args = typing.get_args(hint)
  if value is None:  # a value: the first of these the key's own checks accept
    if bool in args:
      return [True, False]
    return [next((v for v in (0.01, 1.01) if _valid(config, key, v)), 0.01)]
  if isinstance(value, bool):
    return [not value]
  if isinstance(value, int):
    return [value + 1]
  if isinstance(value, float):
    return [0.01 if value <= 0 else value * 0.01]
  if isinstance(value, tuple):
    return [value + value[-1:] if value else (8,)]
  if isinstance(value, dict):  # a free-form mapping (task.options): one entry more
    return [{**value, "x": 1}]
  if isinstance(value, str):
    allowed = _allowed(config, key)
    if allowed is not None:
      return [v for v in allowed if v != value]
    default = _get(config_lib.TrainConfig(), key) if not key.startswith("team.roles.") else ""
    return [default if value != default else "x"]
  raise AssertionError(f"{key}: no changed value for {value!r} ({hint})")


def _valid(config, key, value):
  try:
    _build(config, key, value)
  except ValueError:
    return False
  return True


def _get(config, key):
  node = config
  for part in key.split("."):
    node = getattr(node, part, None)
  return node


def _build(config, key, value):
  """`config` with `key` set to `value`, built as the command line does: the config dict,
  then the typed config (its checks)."""
  tree = copy.deepcopy(_tree(config))
  *path, last = key.split(".")
  node = tree
  for part in path:
    node = node[part]
  node[last] = value
  return from_config_dict(config_lib.TrainConfig, tree)


_TREES = {}


def _tree(config):
  """`config` as the command line's plain dict (kept: building one costs milliseconds)."""
  if id(config) not in _TREES:
    _TREES[id(config)] = (config, to_config_dict(config).to_dict())
  return _TREES[id(config)][1]


def _names(message, key):
  """Whether a refusal names `key`: dotted ("critic.lr=") or as a field of its section
  ("config.critic: lr=", "config.team: roles: ... roles.<name>.graded")."""
  *path, field = key.split(".")
  return key in message or bool(re.search(rf"\b{re.escape(field)}\b", message)) and (
      not path or f"config.{path[0]}" in message)


# --- one tiny iteration, compared stage by stage ----------------------------------------------

_TIMING = re.compile(r"^time/|_s$|tok_s$|compile")


class _Differs(Exception):
  pass


class _Done(Exception):
  pass


class _Probe:
  """Records a run's stages (the baseline) or compares them with a recorded run's, raising
  `_Differs` at the first that differs (the rest of the run is not needed)."""

  def __init__(self, reference=None):
    self.reference, self.seen = reference, {}

  def stage(self, name, values):
    arrays = [np.asarray(v) for v in values]
    if self.reference is None:
      self.seen[name] = arrays
      return
    expected = self.reference[name]
    if len(arrays) != len(expected) or any(
        a.shape != b.shape or a.dtype != b.dtype or
        not np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        for a, b in zip(arrays, expected)):
      raise _Differs(name)

  def end(self, iteration, metrics):
    self.stage("metrics", _numbers(metrics))
    raise _Done()


def _numbers(metrics):
  kept = sorted((k, v) for k, v in metrics.items()
                if isinstance(v, (int, float)) and not _TIMING.search(k))
  return [np.asarray([k for k, _ in kept]), np.asarray([float(v) for _, v in kept])]


def _episode_arrays(episodes):
  out = []
  for e in episodes:
    out += [np.asarray(e.rewards, np.float64).ravel(), np.asarray(e.dones), str(e.dropped)]
    for s in e.sequences:
      out += [s.tokens, s.behaviour_logprobs, s.adapter_ids]
  return out


_PROBE = [None]


@pytest.fixture(scope="module")
def probed():
  """loop.train's stages reported to the current `_Probe`."""
  real_rollout, real_advantages, real_learn = run_lib.rollout, run_lib.compute_advantages, run_lib._learn_one

  def rollout(*args, **kwargs):
    result = real_rollout(*args, **kwargs)
    _PROBE[0].stage("rollout", _episode_arrays(result.episodes) + _numbers(result.metrics))
    return result

  def compute_advantages(batch, episodes, *args, **kwargs):
    out = real_advantages(batch, episodes, *args, **kwargs)
    _PROBE[0].stage("advantages", jax.tree.leaves(out) + _episode_arrays(episodes))
    return out

  def learn(*args, **kwargs):
    state, metrics = real_learn(*args, **kwargs)
    _PROBE[0].stage("update", jax.tree.leaves(state) + _numbers(metrics))
    return state, metrics

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(run_lib, "rollout", rollout)
    patch.setattr(run_lib, "compute_advantages", compute_advantages)
    patch.setattr(run_lib, "_learn_one", learn)
    yield


@pytest.fixture(scope="module")
def model():
  # One layer: the sampler's layers are unrolled, so its compiles take half as long.
  return echo_config.tiny_trainer_model(num_layers=1)


def _run(config, model, reference=None):
  """("differs", stage) or ("same", the stages seen) of one iteration of `config`, or
  ("refused", message) for a ValueError raised before the run's model is used."""
  _PROBE[0] = probe = _Probe(reference)
  started = []
  real_train = loop._train

  def train(*args, **kwargs):
    started.append(True)
    return real_train(*args, **kwargs)

  with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as workdir:
    patch.setattr(loop, "_train", train)
    try:
      loop.train(config, workdir, model=model, progress=False, on_iteration=probe.end)
    except _Differs as e:
      return "differs", str(e)
    except _Done:
      return "same", probe.seen
    except (ValueError, OSError) as e:  # OSError: a file the config names, checked first
      if started:
        raise AssertionError(f"refused after the model was in use: {e}") from e
      return "refused", str(e)
  raise AssertionError("the run ended before its first iteration's metrics")


# --- the property -----------------------------------------------------------------------------

# Keys that by design change nothing in one iteration of the tiny run, each with the test that
# shows what it does. Their changes are not run.
_TRAINER = "tests/train/test_trainer.py::"
_EVALUATE = "tests/train/test_evaluate.py::"
_LAYOUTS = "tests/models/test_layouts.py::"
_HELDOUT = _TRAINER + "test_heldout_evaluation_during_training_is_evaluate_of_that_steps_policy"
NO_EFFECT = {
    # How many iterations run, and when the run checkpoints: later iterations.
    "iterations": _TRAINER + "test_resume_is_exact",
    "checkpoint_every": _TRAINER + "test_resume_is_exact",
    "max_to_keep": "tests/train/test_checkpoint.py::test_retention_intervals_and_no_overwrite",
    # Held-out evaluation: during training (scores, not the update) and by launch/eval.py.
    "eval_every": _HELDOUT,
    "eval_episodes": _HELDOUT,
    "task.eval_problems": _EVALUATE + "test_launch_eval_scores_the_checkpoint_and_writes_eval_json",
    # What launch.train loads; train(model=...) is handed the loaded model.
    "model.source":
        "tests/test_launch.py::test_a_model_file_that_does_not_load_is_one_line_naming_it",
    # How the numbers are computed, not which: layouts, recomputed activations, CPU's exact
    # f32 matmuls, the mesh (at most a rounding apart).
    "model.rollout_layout": _LAYOUTS + "test_layouts_compute_the_same_model",
    "model.remat": _LAYOUTS + "test_remat_gives_the_same_gradient_in_less_memory",
    "model.matmul_precision":
        "tests/test_precision.py::test_the_scope_sets_the_precision_of_every_traced_matmul",
    # bf16 only (the tiny run is f32); how the routed LoRA update is rounded.
    "model.lora_update_f32":
        "tests/train/test_trainer.py::test_model_lora_update_f32_reaches_the_sampler_and_the_"
        "learner",
    "mesh.data": "tests/train/test_mesh_minibatches.py::"
                 "test_a_run_on_six_batch_shards_trains_as_on_one_device",
    "mesh.fsdp": "tests/train/test_mesh_minibatches.py::"
                 "test_a_padded_batch_trains_the_same_rows_together_as_one_device",
    "mesh.tensor": "tests/test_sharding.py::test_sharded_forward_equals_single_device",
    # The whitening jitted or op by op (about 1e-7 apart): old checkpoints' bits.
    "advantage.jit_whitening": "tests/train/test_old_checkpoints.py::"
                               "test_an_old_checkpoint_resumes_as_its_own_code_trained_or_is_"
                               "refused_by_key",
    # The orchestrator's menu shows it (a chain never does).
    "team.roles.*.description":
        "tests/train/test_teams.py::test_the_orchestrator_calls_only_its_menu",
    # Which replies the environment scores: the tiny model's arithmetic is never right, so
    # every graded reply scores 0 either way.
    "team.roles.*.graded": "tests/envs/test_math_env.py::"
                           "test_score_is_the_mean_over_graded_roles_and_judge_can_be_silent",
}


def _listed(key):
  return any(fnmatch.fnmatchcase(key, pattern) for pattern in NO_EFFECT)


def _cases():
  """[(key, changed value, the algorithms whose baseline has the key)], in leaf order."""
  cases = {}
  for algorithm in ALGORITHMS:
    config = baseline(algorithm)
    for key, hint, value in _leaves(config):
      for changed in _changes(config, key, hint, value):
        cases.setdefault((key, repr(changed)), (key, changed, []))[2].append(algorithm)
  return list(cases.values())


_RESOLVED = {}


def _changed_config(algorithm, key, value):
  """("refused", message), ("no change", None), or ("run", the changed config)."""
  if algorithm not in _RESOLVED:
    _RESOLVED[algorithm] = algorithms.resolve(baseline(algorithm))
  try:
    config = _build(baseline(algorithm), key, value)
    resolved = algorithms.resolve(config)
  except ValueError as e:
    return "refused", str(e)
  # The resolved config spells out all an algorithm decides: two that resolve alike run alike
  # (MARFT-A on a team of one is single-agent PPO).
  unchanged = dataclasses.replace(resolved, algorithm=algorithm) == _RESOLVED[algorithm]
  return ("no change", None) if unchanged else ("run", config)


def test_a_refused_change_names_its_key():
  """Every key, value and algorithm (no model): a refusal from the config or `resolve`
  names the key it refuses."""
  unnamed = []
  for key, value, owners in _cases():
    for algorithm in owners:
      outcome, message = _changed_config(algorithm, key, value)
      if outcome == "refused" and not _names(message, key):
        unnamed.append(f"{algorithm}: {key}={value!r}: {message}")
  assert not unnamed, "\n".join(unnamed)


def test_every_key_changes_a_tiny_run_or_is_refused(model, probed):
  """The property (module docstring). Each (key, value) runs under the first algorithm, in
  turn from a rotating start, that neither refuses it nor resolves it to its baseline;
  MARFT_ALL_KEYS=1 runs it under every algorithm (the full product, minutes);
  MARFT_KEYS=<pattern> runs the matching keys only (fnmatch, e.g. "loss.*")."""
  every = os.environ.get("MARFT_ALL_KEYS") == "1"
  only = os.environ.get("MARFT_KEYS", "*")
  verbose = every or only != "*"
  references = {}  # each algorithm's baseline run, made when first needed
  failures = []
  for i, (key, value, owners) in enumerate(_cases()):
    if _listed(key) or not fnmatch.fnmatchcase(key, only):
      continue
    start = i % len(owners)
    for algorithm in owners[start:] + owners[:start]:
      outcome, config = _changed_config(algorithm, key, value)
      if outcome != "run":
        continue
      if algorithm not in references:
        references[algorithm] = _run(baseline(algorithm), model)[1]
      outcome, detail = _run(config, model, references[algorithm])
      if verbose:
        print(algorithm, key, repr(value), outcome, "" if outcome == "same" else detail)
      if outcome == "same":
        failures.append(f"{algorithm}: {key}={value!r} is accepted and changes nothing")
      elif outcome == "refused" and not _names(detail, key):
        failures.append(f"{algorithm}: {key}={value!r} refused without naming it: {detail}")
      if not every:
        break
  assert not failures, "\n".join(failures)


def test_the_no_effect_list_names_keys_and_the_tests_that_show_them():
  keys = {key for a in ALGORITHMS for key, _, _ in _leaves(baseline(a))}
  root = os.path.join(os.path.dirname(__file__), "..", "..")
  for pattern, test in NO_EFFECT.items():
    assert any(fnmatch.fnmatchcase(k, pattern) for k in keys), f"{pattern}: not a key"
    path, name = test.split("::")
    with open(os.path.join(root, path)) as f:
      assert f"def {name}(" in f.read(), test


# --- the defects the property found, one by one (each accepted and ignored before) ------------


@pytest.mark.parametrize("algorithm,key,value", [
    ("grpo", "advantage.lambda_", 0.9),  # GRPO ran λ = 1 and recorded the user's
    ("grpo", "advantage.lambda_agent", 0.5),
    *(("grpo", key, value) for key, value in (  # a critic's keys without a critic
        ("critic.lr", 1e-3), ("critic.hidden", (8,)), ("loss.value_coef", 0.5),
        ("loss.value_clip", 0.1), ("loss.huber_delta", 1.0),
        ("loss.critic_max_grad_norm", 0.5))),
    ("marft_t", "loss.action_logprob", "mean"),  # a token-level loss has no per-turn ratio
    ("shared_stream_ppo", "loss.action_logprob", "mean"),
    ("grpo", "loss.action_logprob", "mean"),
    ("marft_a", "advantage.gamma_token", 0.9),  # no hops between tokens at the action level
    ("grpo", "advantage.lambda_token", 0.9),
    ("ppo", "advantage.credit", "per_step"),  # one role: one turn per env step
    ("ppo", "advantage.gamma_agent", 0.9),
    ("marft_a", "advantage.credit_discount", 0.5),  # credit 'equal'
    ("marft_a", "advantage.kl_reward_estimator", "k1"),  # kl_reward_coef 0
    ("marft_a", "loss.kl_estimator", "k1"),  # kl_coef 0
    ("marft_a", "loss.kl_guard", "stop"),  # no kl_limit
    ("marft_a", "team.transition", "Next: {role}."),  # per-agent view: no hand-overs
    ("ppo", "optimizer.agent_iteration_interval", 1),  # one adapter
    ("ppo", "team.shared_adapter", True),
    ("ppo", "critic.mode", "per_agent_head"),  # one agent: one head either way
    ("ppo", "team.max_new_tokens", 8),  # one role: the last, team.last_max_new_tokens
    ("marft_a", "reward.judge_weight", 0.5),  # no judge
    ("marft_a", "reward.judge_max_new_tokens", 8),
    ("marft_a", "reward.judge_prompt", "Grade it."),
    ("marft_a", "team.orchestrator_max_calls", 2),  # a chain
    ("marft_a", "team.orchestrator_max_new_tokens", 8),
    ("marft_a", "task.echo_high", 3),  # arithmetic
    ("marft_a", "team.roles.repeater.adapter", "shared"),  # shared with no one: its own
])
def test_a_key_the_run_would_not_read_is_refused_naming_it(algorithm, key, value):
  with pytest.raises(ValueError) as info:
    algorithms.resolve(_build(baseline(algorithm), key, value))
  assert _names(str(info.value), key), str(info.value)


def test_echo_and_code_refuse_a_horizon_their_episodes_never_reach():
  for name in ("echo", "code"):
    with pytest.raises(ValueError, match=rf"task\.horizon=2 .* not task\.name='{name}'"):
      config_lib.TrainConfig(task=config_lib.TaskSection(name=name, horizon=2))


def test_grpo_records_the_lambda_it_runs():
  resolved = algorithms.resolve(baseline("grpo"))
  assert (resolved.advantage.lambda_, resolved.advantage.lambda_agent) == (1.0, None)
  assert algorithms.resolve(resolved) == resolved


def test_train_reads_reward_fn_from_the_config(model, tmp_path):
  """`loop.train(config)` imports `config.reward.fn` (only the launch script did): a name
  that does not import is refused before the model is used."""
  config = dataclasses.replace(baseline("marft_a"), reward=config_lib.RewardSection(
      fn=f"{__name__}:no_such_function"))
  with pytest.raises(ValueError, match=r"reward\.fn='.*:no_such_function': AttributeError"):
    loop.train(config, str(tmp_path), model=model, progress=False)

"""`--config.algorithm=X` on every shipped config file gives exactly X, or is refused naming
both keys (train/config/algorithms.py)."""

import dataclasses
import glob
import os
import re

import pytest

from launch.cli import _load_config_file
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.train import algorithms, teams
from marft_jax.train.build import model as model_lib
from marft_jax.train.build import preflight
from marft_jax.train import run as run_lib
from marft_jax.train.config import saved as saved_config
from marft_jax.train.config import (CriticSection, ModelSection, RoleSection, RolloutSection,
                                     TeamSection, TrainConfig)
from marft_jax.train.update import LossConfig
from marft_jax.train.advantages import AdvantageConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "launch", "configs")
TRAIN_FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIG_DIR, "*.py"))
                     if not p.endswith(("__init__.py", "generate.py")))
# What each algorithm must come out as: (advantage.level, loss.policy_level, critic on,
# advantage.normalize, context mode or None for any, team size or None for any, min group).
EXPECTED = {
    "marft_a": ("action", "action", True, True, None, None, 1),
    "marft_t": ("token", "token", True, True, None, None, 1),
    "ppo": ("action", "action", True, True, None, 1, 1),
    "grpo": ("grpo", "token", False, False, None, None, 2),
    "shared_stream_ppo": ("token", "token", True, True, "shared_stream", None, 1),
}


def test_the_registry_is_what_this_test_expects():
  assert set(algorithms.ALGORITHMS) == set(EXPECTED)


def _file_config(name, algorithm):
  config = _load_config_file(os.path.join(CONFIG_DIR, name))
  config.algorithm = algorithm  # as --config.algorithm=... does
  return from_config_dict(TrainConfig, config)


@pytest.mark.parametrize("algorithm", sorted(EXPECTED))
@pytest.mark.parametrize("name", TRAIN_FILES)
def test_every_algorithm_on_every_config_file(name, algorithm):
  typed = _file_config(name, algorithm)
  level, policy, critic, normalize, context, roles, group = EXPECTED[algorithm]
  try:
    resolved = algorithms.resolve(typed)
  except ValueError as e:
    # Refused only for a key the file set against the algorithm, named with it.
    message = str(e)
    assert f"algorithm={algorithm!r}" in message
    key = message.split("=")[0]
    section, field = key.split(".")
    file_value = getattr(getattr(typed, section), field)
    default_value = getattr(getattr(TrainConfig(), section), field)
    assert file_value != default_value, (key, "refused although the file left it unset")
    return
  assert resolved.algorithm == algorithm
  assert resolved.advantage.level == level
  assert resolved.loss.policy_level == policy
  assert resolved.uses_critic == critic
  assert (resolved.critic.mode != "none") == critic
  assert resolved.advantage.normalize == normalize
  assert resolved.rollout.context_mode == (context or "per_agent")
  if roles is not None:
    assert resolved.team.num_roles == roles
  assert resolved.rollout.group_size >= group
  # Resolving is idempotent: train() resolves the launch's resolved config again.
  assert algorithms.resolve(resolved) == resolved


def test_the_default_file_trains_what_the_algorithm_flag_says():
  """The issue's case: --config.algorithm=marft_t on the default file was MARFT-A."""
  resolved = algorithms.resolve(_file_config("train.py", "marft_t"))
  assert (resolved.advantage.level, resolved.loss.policy_level) == ("token", "token")
  resolved = algorithms.resolve(_file_config("train.py", "grpo"))
  assert resolved.advantage.level == "grpo" and resolved.critic.mode == "none"
  assert resolved.rollout.group_size == 4 and resolved.advantage.normalize is False


@pytest.mark.parametrize("algorithm,changes,keys", [
    ("marft_a", dict(loss=LossConfig(policy_level="token")), ("loss.policy_level",)),
    ("marft_a", dict(advantage=AdvantageConfig(level="token")), ("advantage.level",)),
    ("marft_t", dict(advantage=AdvantageConfig(level="action")), ("advantage.level",)),
    ("grpo", dict(critic=CriticSection(mode="shared")), ("critic.mode",)),
    ("grpo", dict(critic=CriticSection(lora_rank=4)), ("critic.lora_rank",)),
    ("grpo", dict(rollout=RolloutSection(group_size=1)), ("rollout.group_size",)),
    ("grpo", dict(advantage=AdvantageConfig(normalize=True)), ("advantage.normalize",)),
    ("marft_a", dict(critic=CriticSection(mode="none")), ("critic.mode",)),
    ("ppo", dict(team=TeamSection(num_roles=2)), ("team.num_roles",)),
    ("shared_stream_ppo", dict(rollout=RolloutSection(context_mode="per_agent")),
     ("rollout.context_mode",)),
    ("grpo", dict(rollout=RolloutSection(num_envs=6)), ("rollout.num_envs", "group_size")),
])
def test_a_contradiction_is_refused_naming_both_keys(algorithm, changes, keys):
  with pytest.raises(ValueError) as info:
    algorithms.resolve(TrainConfig(algorithm=algorithm, **changes))
  for key in keys:
    assert key in str(info.value)
  if "rollout.num_envs" not in keys:
    assert f"algorithm={algorithm!r}" in str(info.value)


def test_explicit_agreeing_values_and_free_choices_are_kept():
  config = TrainConfig(algorithm="marft_t", loss=LossConfig(policy_level="token"),
                       critic=CriticSection(mode="per_agent_head"),
                       rollout=RolloutSection(context_mode="shared_stream", group_size=2))
  resolved = algorithms.resolve(config)
  assert resolved.critic.mode == "per_agent_head"
  assert resolved.rollout.context_mode == "shared_stream"
  assert resolved.rollout.group_size == 2


def test_the_launch_refuses_a_contradiction_before_loading_a_model(tmp_path):
  """One line naming both keys and exit status 2, from the CLI (no model is loaded)."""
  import subprocess
  import sys
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}",
       "--config.algorithm=grpo", "--config.critic.mode=shared"],
      capture_output=True, text=True, cwd=os.path.join(os.path.dirname(__file__), "..", ".."),
      timeout=120)
  assert out.returncode == 2, out.stderr
  assert "config.critic.mode='shared' contradicts algorithm='grpo'" in out.stderr
  assert not os.listdir(tmp_path)


def test_the_checkpointed_config_is_the_resolved_one():
  """What a run records (checkpoint meta, config.json: `saved_config.as_recorded`) names every
  decided key, and the task's shipped team written out."""
  resolved = to_config_dict(saved_config.as_recorded(TrainConfig(algorithm="marft_t"))).to_dict()
  assert resolved["advantage"]["level"] == "token"
  assert resolved["loss"]["policy_level"] == "token"
  assert resolved["critic"]["mode"] == "shared"
  assert "auto" not in str(resolved["rollout"]) and resolved["rollout"]["group_size"] == 1
  assert resolved["team"]["order"] == "reasoner,actor"
  assert resolved["team"]["roles"]["actor"]["graded"] and \
      resolved["team"]["roles"]["reasoner"]["system_prompt"].startswith("You are the Reasoner")
  # A config that spells the same team out records the same config.
  spelled = TrainConfig(algorithm="marft_t", team=TeamSection(**teams.shipped("arithmetic", 2)))
  assert to_config_dict(saved_config.as_recorded(spelled)).to_dict() == resolved


@pytest.mark.parametrize("overrides,key", [
    # The learner scores the full softmax: top-p would make the trained policy another.
    ({"team": TeamSection(top_p=0.9)}, "team.top_p=0.9"),
    ({"team": TeamSection(roles=(RoleSection("a", graded=True, top_p=0.5),), order="a")},
     "team.roles.a.top_p=0.5"),
    # Greedy replies have no distribution for the learner to score (it divides by τ).
    ({"team": TeamSection(temperature=0.0)}, "team.temperature=0"),
    ({"team": TeamSection(roles=(RoleSection("a", graded=True, temperature=0.0),), order="a")},
     "team.roles.a.temperature=0"),
])
def test_sampling_the_learner_cannot_score_is_refused_for_training(overrides, key):
  with pytest.raises(ValueError, match=re.escape(key)):
    algorithms.resolve(TrainConfig(**overrides))


def test_behaviour_correction_follows_the_model_dtype():
  f32 = algorithms.resolve(TrainConfig())
  bf16 = algorithms.resolve(TrainConfig(model=ModelSection(param_dtype="bfloat16")))
  assert (f32.loss.behaviour_correction, bf16.loss.behaviour_correction) == ("off", "on")
  forced = TrainConfig(loss=LossConfig(behaviour_correction="on"))
  assert algorithms.resolve(forced).loss.behaviour_correction == "on"


def test_a_negative_seed_is_refused_with_the_config():
  """Before: accepted, and the run failed at its first episode with NumPy's "expected
  non-negative integer", after the model had loaded."""
  with pytest.raises(ValueError, match=re.escape("seed=-1: must be >= 0")):
    TrainConfig(seed=-1)


def test_init_from_needs_one_folder_per_adapter():
  """Refused with the config, before any model or adapter loads (2 roles: 2 adapters; a shared
  adapter: 1)."""
  with pytest.raises(ValueError, match=r"init_from='a': 1 adapter folder\(s\) for the team's 2"):
    algorithms.resolve(TrainConfig(init_from="a"))
  assert algorithms.resolve(TrainConfig(init_from=" a, b ,")).init_from_folders == ["a", "b"]
  shared = TrainConfig(init_from="a", team=TeamSection(shared_adapter=True))
  assert algorithms.resolve(shared).num_adapters == 1
  with pytest.raises(ValueError, match=r"2 adapter folder\(s\) for the team's 1"):
    algorithms.resolve(dataclasses.replace(shared, init_from="a,b"))


def _peft_folders(root, lora_config, names=("planner", "solver"), dropout=0.0):
  """One PEFT folder per name holding a random adapter of `lora_config`, as an export is."""
  import jax
  from marft_jax import lora
  from marft_jax.models.config import tiny_config
  adapters = lora.init_adapters(dataclasses.replace(lora_config, dropout_rate=dropout),
                                tiny_config(), jax.random.key(0), len(names))
  adapters = adapters.replace(layers=jax.tree.map(lambda x: x + 0.01, adapters.layers))
  return ",".join(lora.save_peft_adapters(root, adapters, list(names)))


@pytest.mark.parametrize("folder_lora, message, fixes", [
    (dict(rank=4, alpha=8.0), r"rank 4 \(config.lora: 8\)", "lora.rank=4 lora.alpha=8"),
    (dict(rank=8, alpha=4.0), r"scale 0.5 \(config.lora: 2\)", "lora.alpha=4"),
    (dict(rank=8, alpha=16.0, targets=("q_proj", "v_proj")),
     r"targets q_proj, v_proj \(config.lora: q_proj, k_proj, v_proj, o_proj, gate_proj, "
     r"up_proj, down_proj\)", "lora.targets='q_proj|v_proj'")])
def test_init_from_adapters_must_be_the_ones_config_lora_describes(tmp_path, folder_lora,
                                                                    message, fixes):
  """A run records, checkpoints and evaluates its adapters as `config.lora` says: a folder of
  another rank, scale or targets is refused before the model loads (it would train under its
  own scale and be scored under the config's), and the message's fix is accepted."""
  from marft_jax.lora.config import LoraConfig
  config = algorithms.resolve(TrainConfig(init_from=_peft_folders(tmp_path, LoraConfig(
      **folder_lora))))
  assert (config.lora.rank, config.lora.alpha) == (8, 16.0)
  with pytest.raises(ValueError, match=r"init_from='.*planner': its adapter is not the one "
                     rf"config.lora describes: {message}\. Set {re.escape(fixes)} to train"):
    preflight.check_training_files(config)
  fixed = {key.split(".")[1]: value for key, value in
           (fix.split("=") for fix in fixes.split(" "))}
  fixed = {k: (int(v) if k == "rank" else float(v) if k == "alpha" else v.strip("'"))
           for k, v in fixed.items()}
  preflight.check_training_files(dataclasses.replace(
      config, lora=dataclasses.replace(config.lora, **fixed)))


def test_init_from_adapters_of_some_layers_only_are_refused(tmp_path):
  """PEFT's layers_to_transform: the layers it leaves out would load with both factors zero,
  which no gradient moves, while config.lora trains every layer."""
  import json
  from marft_jax.lora.config import LoraConfig
  config = algorithms.resolve(TrainConfig(init_from=_peft_folders(tmp_path, LoraConfig())))
  preflight.check_training_files(config)
  settings = tmp_path / "solver" / "adapter_config.json"
  settings.write_text(json.dumps(dict(json.loads(settings.read_text()), layers_to_transform=[0])))
  with pytest.raises(ValueError, match=r"init_from='.*solver': its adapter covers only layers "
                     r"\[0\] \(layers_to_transform\)"):
    preflight.check_training_files(config)


def test_init_from_adapters_train_under_the_configs_scale_and_dropout(tmp_path):
  """What the check compares is the scale, not alpha: an rsLoRA config takes the folders it
  exports (PEFT's plain alpha = scale · r). The loaded adapters carry the config's scale and
  its dropout (a training setting), so a checkpoint restores into `config.lora`'s adapters."""
  from marft_jax.lora.config import LoraConfig
  from marft_jax.models import tiny
  rslora = LoraConfig(rank=8, alpha=16.0, use_rslora=True)
  config = algorithms.resolve(TrainConfig(lora=rslora, init_from=_peft_folders(
      tmp_path, rslora, dropout=0.25)))
  preflight.check_training_files(config)
  params, model_config, tokenizer = tiny.tiny_model()
  state = run_lib.new_state(config, model_lib.Model(params, model_config, tokenizer))
  assert state.policy.scale == rslora.scale == 16.0 / 8 ** 0.5
  assert state.policy.dropout_rate == 0.0  # the config's, not the folders' 0.25

"""Every shipped launch config loads and converts to its typed dataclass."""

import dataclasses
import glob
import importlib.util
import os

import jax
import pytest

from marft_jax import lora
from marft_jax.configs import from_config_dict, to_config_dict
from marft_jax.models.config import tiny_config

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "launch", "configs")
# config file name -> (module defining its top-level config dataclass, the dataclass)
TYPED = {"generate.py": ("launch.configs.generate", "GenerateConfig")}
TYPED.update({name: ("marft_jax.train.config", "TrainConfig") for name in (
    "train.py", "marft_t.py", "grpo.py", "ppo.py", "math_2agents.py", "math_3agents.py",
    "math_4agents.py", "code_2agents.py", "dag_3agents.py", "hetero_2agents.py",
    "split_facts.py", "verify_correct.py", "grid_path.py",
    # the team sweep's single-agent arms (bench/learning.py)
    "split_facts_single.py", "split_facts_twice.py", "verify_correct_single.py",
    "verify_correct_twice.py", "grid_path_single.py", "grid_path_twice.py")})


def _load(path):
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py")) if not p.endswith("__init__.py")))
def test_shipped_config_converts(path):
  name = os.path.basename(path)
  assert name in TYPED, f"{name}: add it to TYPED so that its conversion is tested"
  module_name, cls_name = TYPED[name]
  cls = getattr(importlib.import_module(module_name), cls_name)
  loaded = _load(path)
  typed = from_config_dict(cls, loaded)  # validates: the dataclasses check every field
  assert isinstance(typed, cls)
  assert to_config_dict(typed).to_dict() == loaded.to_dict()  # round trip: nothing lost


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py")) if not p.endswith("__init__.py")))
def test_shipped_config_refuses_a_misspelt_key_naming_it(path):
  """What the launch flag does with `lock_config=True`: no new keys, at any depth."""
  config = _load(path)
  config.lock()
  with pytest.raises(AttributeError, match="seeed"):
    config.seeed = 1
  section = next(k for k, v in config.items() if hasattr(v, "lock"))  # e.g. rollout, sampling
  first = next(iter(getattr(config, section).keys()))
  with pytest.raises(AttributeError, match=first + "x"):
    setattr(getattr(config, section), first + "x", 1)


def test_generate_config_rejects_bad_values():
  from launch.configs.generate import GenerateConfig
  config = _load(os.path.join(CONFIG_DIR, "generate.py"))
  config.sampling.top_p = 1.5
  with pytest.raises(ValueError, match=r"config\.sampling: top_p=1\.5: must be in"):
    from_config_dict(GenerateConfig, config)


def test_generate_config_file_holds_the_dataclass_defaults():
  """One source of defaults: the file is `GenerateConfig()` as a ConfigDict."""
  from launch.configs.generate import GenerateConfig
  typed = from_config_dict(GenerateConfig, _load(os.path.join(CONFIG_DIR, "generate.py")))
  assert typed == GenerateConfig()
  assert typed.sampling.top_p == 0.95


def test_train_config_file_is_the_embedded_default():
  from marft_jax.train.config import TrainConfig
  from marft_jax.train import algorithms, teams
  typed = from_config_dict(TrainConfig, _load(os.path.join(CONFIG_DIR, "train.py")))
  shipped = dataclasses.replace(TrainConfig().team, **teams.shipped("arithmetic", 2))
  assert typed == dataclasses.replace(TrainConfig(), team=shipped, eval_every=8,
                                      eval_episodes=64)
  # The file spells out the team the library's defaults would build.
  library = algorithms.resolve(TrainConfig())
  assert teams.build_team(algorithms.resolve(typed).team, "arithmetic") == \
      teams.build_team(library.team, "arithmetic")


@pytest.mark.parametrize("name,algorithm,roles,task", [
    ("marft_t.py", "marft_t", 2, "arithmetic"), ("grpo.py", "grpo", 2, "arithmetic"),
    ("ppo.py", "ppo", 1, "arithmetic"), ("math_2agents.py", "marft_a", 2, "math_jsonl"),
    ("math_3agents.py", "marft_a", 3, "math_jsonl"),
    ("math_4agents.py", "marft_a", 4, "math_jsonl"), ("code_2agents.py", "marft_a", 2, "code")])
def test_train_configs_say_what_their_names_say(name, algorithm, roles, task):
  from marft_jax.train.algorithms import resolve
  from marft_jax.train.config import TrainConfig
  typed = resolve(from_config_dict(TrainConfig, _load(os.path.join(CONFIG_DIR, name))))
  assert (typed.algorithm, typed.team.num_roles, typed.task.name) == (algorithm, roles, task)


def _launch(script: str, *args: str):
  """`python -m launch.<script> args` from the repository root, as a user runs it."""
  import subprocess
  import sys
  return subprocess.run([sys.executable, "-m", f"launch.{script}", *args], capture_output=True,
                        text=True, cwd=os.path.join(CONFIG_DIR, "..", ".."), timeout=120)


def test_a_misspelt_train_key_fails_naming_it():
  """`lock_config`: the launch flag refuses an unknown key before anything loads."""
  out = _launch("train", "--config.rollout.num_env=4")
  assert out.returncode == 2 and "num_env" in out.stderr and "num_envs" in out.stderr, out
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("script, problem_file", [("train", "malformed"), ("eval", "missing")])
def test_a_bad_problem_file_is_one_line_naming_it(tmp_path, script, problem_file):
  """The launch scripts read the task's files before the model loads: one line, exit 2."""
  path = tmp_path / "problems.jsonl"
  if problem_file == "malformed":
    path.write_text('{"question": "What is 2 + 2?", "answer": "#### 4"}\n{"question": 4\n')
  out = _launch(script, f"--workdir={tmp_path / 'run'}", "--config=launch/configs/math_2agents.py",
                f"--config.task.path={path}", *(["--untuned"] if script == "eval" else []))
  expected = (f"error: {path}:2: not valid JSON" if problem_file == "malformed"
              else f"error: task.path='{path}': no such file")
  assert out.returncode == 2 and out.stderr.startswith(expected), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("script, flag, message", [
    ("eval", "--problems=0", "0 is not a positive integer"),
    ("train", "--cpu_devices=-1", "-1 is not a non-negative integer")])
def test_an_out_of_range_flag_is_one_line_naming_it(tmp_path, script, flag, message):
  out = _launch(script, f"--workdir={tmp_path}",
                "--untuned" if script == "eval" else "--config.iterations=1", flag)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip() == f"error: flag {flag}: {message}", out.stderr


def test_a_workdir_that_cannot_be_made_is_one_line_before_the_model_loads(tmp_path):
  (tmp_path / "a_file").write_text("")
  out = _launch("train", f"--workdir={tmp_path / 'a_file'}",
                "--config.model.source=/nonexistent/model")
  # The model source is bad too: the workdir is checked first, before any loading.
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip() == f"error: --workdir={tmp_path / 'a_file'}: a file, not a folder"


def test_a_model_folder_that_does_not_load_is_one_line_naming_it(tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": "llama",')
  out = _launch("train", f"--workdir={tmp_path / 'run'}", f"--config.model.source={tmp_path}")
  assert out.returncode == 2, out.stderr
  assert out.stderr.startswith(f"error: {tmp_path / 'config.json'}: invalid JSON at line 1")
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("key", ["init_from", "reward.judge_adapter", "reward.judge_model"])
def test_every_file_a_training_run_reads_is_checked_naming_its_key(tmp_path, key):
  """`preflight.check_training_files`, which `loop.train` and `launch.train` run before the
  model loads: a missing adapter folder or judge model is named with its key."""
  from marft_jax.train.build import preflight
  from marft_jax.train.config import RewardSection, TrainConfig
  missing = str(tmp_path / "missing")
  reward = RewardSection(judge=True, **{key.split(".")[1]: missing}) if "." in key else None
  config = (TrainConfig(reward=reward) if reward else
            TrainConfig(init_from=",".join([str(tmp_path / "fine"), missing])))
  if key == "init_from":  # the first folder is fine (config.lora's adapter): the second is named
    lora.save_peft_adapter(tmp_path / "fine", lora.init_adapters(
        config.lora, tiny_config(), jax.random.key(0), 1))
  expected = {"init_from": f"{missing}/adapter_config.json: not found",
              "reward.judge_adapter": f"{missing}/adapter_config.json: not found",
              "reward.judge_model": f"model '{missing}': not 'smollm2'"}[key]
  with pytest.raises(FileNotFoundError) as raised:
    preflight.check_training_files(config)
  assert str(raised.value).startswith(f"{key}='{missing}': {expected}"), raised.value


def test_a_missing_init_from_folder_is_one_line_before_the_model_loads(tmp_path):
  folders = f"{tmp_path / 'planner'},{tmp_path / 'solver'}"  # one per agent of the default team
  out = _launch("train", f"--workdir={tmp_path / 'run'}", f"--config.init_from={folders}",
                "--config.model.source=/nonexistent/model")  # checked after the folders
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip() == (f"error: init_from='{tmp_path / 'planner'}': "
                                f"{tmp_path / 'planner' / 'adapter_config.json'}: not found "
                                "(expected a PEFT adapter folder)"), out.stderr


def test_rollout_max_context_is_the_models_positions_or_at_least_16():
  from marft_jax.train import config as train_config
  assert train_config.RolloutSection().max_context == 0  # 0: the model's own positions
  assert train_config.RolloutSection(max_context=16).max_context == 16
  with pytest.raises(ValueError, match="max_context=5: use 0"):
    train_config.RolloutSection(max_context=5)


def _leaves(node, prefix=""):
  """{dotted key: value} of every leaf of a ConfigDict, as `--config.<key>=` reaches it (an
  empty section, e.g. no `model.backbones` declared, is one)."""
  out = {}
  for key, value in node.items():
    if hasattr(value, "items") and len(value):
      out.update(_leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = {} if hasattr(value, "items") else value
  return out


@pytest.mark.parametrize("path", sorted(
    p for p in glob.glob(os.path.join(CONFIG_DIR, "*.py")) if not p.endswith("__init__.py")))
def test_help_lists_exactly_the_keys_an_override_reaches(path):
  """`--help` prints one `key = value` line per leaf of the config file, each role's fields
  under `team.roles.<name>.` (not the roles' mapping as one blob), and nothing else."""
  from launch import reference  # noqa: PLC0415
  module_name, cls_name = TYPED[os.path.basename(path)]
  cls = getattr(importlib.import_module(module_name), cls_name)
  config = _load(path)
  entries = reference.entries(cls, config)
  assert {e.key: e.value for e in entries} == _leaves(config)
  assert len(entries) == len(_leaves(config))
  lines = reference.help_lines(cls, config)
  assert [line[2:].split(" = ", 1)[0] for line in lines if not line.startswith("    ")] == [
      e.key for e in entries]  # one key a line, its help's further lines indented


def test_help_documents_the_role_fields_and_the_fields_commented_above():
  from launch import reference  # noqa: PLC0415
  from marft_jax.train.config import TrainConfig
  entries = reference.entries(TrainConfig, _load(os.path.join(CONFIG_DIR, "train.py")))
  docs = {e.key: e.help for e in entries}
  # A role's fields, with the comments of RoleSection (its sentinels say what they defer to).
  assert docs["team.roles.actor.temperature"] == ("its sampling temperature, > 0; < 0: "
                                                  "team.temperature")
  assert docs["team.roles.reasoner.adapter"].startswith('Its policy: "own" (an adapter of its')
  assert not any(key.startswith("team.roles.") and key.endswith(".name")
                 for key in docs)  # the role's key, not a field to set
  # A field documented by the comment block above it: the whole block, one paragraph.
  assert docs["iterations"].startswith("Rounds of a rollout (rollout.num_envs episodes) and "
                                       "an update, >= 1. The defaults are the first half")
  assert docs["team.order"].startswith("The roles' order, comma-separated")
  # A trailing comment.
  assert docs["team.max_new_tokens"] == "tokens per turn of every role but the last, >= 1"


def test_the_heterogeneous_example_trains_resumes_and_evaluates_on_tiny_models(tmp_path):
  """launch/configs/hetero_2agents.py as a user launches it, one iteration: the planner on the
  "tiny" backbone, the solver's main backbone a tiny Qwen2 folder; the same command extended
  to 2 iterations resumes it (bit for bit: test_backbones); then launch.eval scores the
  checkpoint. Each role's PEFT export names its own base."""
  import json
  from marft_jax.models import tiny
  solver = tiny.save_tiny_model(tmp_path / "solver", "qwen2", seed=1)
  workdir = tmp_path / "run"
  flags = ["--config=launch/configs/hetero_2agents.py", f"--config.model.source={solver}",
           "--config.rollout.num_envs=2", "--config.team.max_new_tokens=4",
           "--config.team.last_max_new_tokens=4", "--config.optimizer.minibatches=1",
           f"--workdir={workdir}"]
  out = _launch("train", *flags, "--config.iterations=1")
  assert out.returncode == 0, out.stderr[-3000:]
  bases = {role: json.loads((workdir / "exports" / "step_1" / role / "adapter_config.json")
                            .read_text())["base_model_name_or_path"]
           for role in ("planner", "solver")}
  assert bases == {"planner": "tiny", "solver": solver}
  out = _launch("train", *flags, "--config.iterations=2")  # the same command, extended
  assert out.returncode == 0, out.stderr[-3000:]
  assert "from its checkpoint after iteration 1 of 2" in out.stderr, out.stderr[-3000:]
  assert (workdir / "exports" / "step_2" / "solver" / "adapter_config.json").exists()
  out = _launch("eval", *flags, "--problems=2")
  assert out.returncode == 0, out.stderr[-3000:]
  assert json.loads((workdir / "eval.json").read_text())["checkpoint_step"] == 2


def test_config_takes_a_shipped_configs_name_from_any_folder(tmp_path, monkeypatch, capsys):
  """`--config=code_2agents` (also `launch.configs.code_2agents`, and the repository's path
  from a folder that has no such file) is the shipped file; a file at the path given wins;
  an unknown name is one line listing the shipped ones (exit 2)."""
  from launch import cli  # noqa: PLC0415 (defines absl flags)
  assert cli.shipped_configs() == sorted(name[:-3] for name in TYPED)
  shipped = os.path.join(cli.CONFIG_DIR, "code_2agents.py")
  monkeypatch.chdir(tmp_path)
  for value in ("code_2agents", "launch.configs.code_2agents", "launch/configs/code_2agents.py",
                "./launch/configs/code_2agents.py"):
    assert cli.config_file(value) == shipped, value
  own = tmp_path / "launch" / "configs" / "code_2agents.py"
  own.parent.mkdir(parents=True)
  own.write_text("")
  assert cli.config_file("launch/configs/code_2agents.py") == "launch/configs/code_2agents.py"
  assert cli.config_file(str(own)) == str(own)
  with pytest.raises(SystemExit) as exited:
    cli.config_file("code_2agent")
  assert exited.value.code == 2
  assert capsys.readouterr().err == (
      "error: --config=code_2agent: no such config file, nor a shipped config's name (one of "
      f"{', '.join(cli.shipped_configs())})\n")


def test_a_config_named_is_what_the_flag_reads_and_help_shows():
  """The name reaches ml_collections as the shipped file: its field is parsed (here refused,
  before anything loads), and --help names the config and lists the shipped ones."""
  out = _launch("train", "--config=grpo", "--config.seed=abc")
  assert out.returncode == 2
  assert out.stderr.startswith("error: flag --config.seed=abc: invalid literal"), out.stderr
  out = _launch("train", "--config=grpo", "--help")
  assert out.returncode == 0, out.stderr
  assert "Config fields (grpo, launch/configs/grpo.py; override as" in out.stdout, out.stdout
  assert "algorithm = 'grpo'" in out.stdout
  from launch import cli  # noqa: PLC0415
  assert "a shipped config: " + ", ".join(cli.shipped_configs()) in " ".join(out.stdout.split())

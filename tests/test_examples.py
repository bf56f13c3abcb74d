"""The shipped examples of tasks of your own (examples/): parity trained end to end through
`launch.train` (the tiny model, one iteration), resumed, and scored by `launch.eval` with the
problems it trained on left out; guess_number's episodes take several env steps, each after
the feedback on the guesses before."""

import json
import os
import subprocess
import sys

import jax
import pytest

from marft_jax import envs
from marft_jax.configs import from_config_dict
from marft_jax.models import tiny
from marft_jax.rollout import RolloutConfig, rollout
from marft_jax.train import algorithms
from marft_jax.train.build import envs as envs_build
from marft_jax.train.build import preflight
from marft_jax.train.build import team as team_lib
from marft_jax.train.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--config.team.max_new_tokens=4", "--config.team.last_max_new_tokens=4",
         "--config.rollout.max_context=256"]


def _launch(script, *flags):
  out = subprocess.run([sys.executable, "-m", script, *flags, *SHORT], capture_output=True,
                       text=True, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
  return str(tiny.save_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_parity_trains_resumes_and_evaluates_through_the_launch_scripts(tiny_model, tmp_path):
  workdir = str(tmp_path / "parity")
  flags = ["--config=examples/parity_config.py", f"--workdir={workdir}",
           f"--config.model.source={tiny_model}"]
  first = _launch("launch.train", *flags, "--config.iterations=1")
  assert "iterations=1 " in first and os.path.isdir(os.path.join(workdir, "checkpoints", "1"))
  resumed = _launch("launch.train", *flags, "--config.iterations=2")
  assert "iterations=2 " in resumed
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f if '"reward"' in line]
  assert steps == [0, 1], steps  # each iteration once: the second after the resume
  printed = _launch("launch.eval", *flags, "--problems=4")
  with open(os.path.join(workdir, "eval.json")) as f:
    results = json.load(f)
  assert results["checkpoint_step"] == 2 and "accuracy" in results
  assert f"training_problems_dropped={results['training_problems_dropped']}" in printed
  assert results["training_problems_dropped"] >= 0


def test_guess_number_plays_several_env_steps_with_feedback():
  from examples import guess_number_config
  config = algorithms.resolve(from_config_dict(TrainConfig, guess_number_config.get_config()))
  preflight.read_task_data(config)
  team, _ = team_lib.build_team(config)
  team = envs.with_sampling(team, max_new_tokens=4)
  params, model_config, tokenizer = tiny.tiny_model(max_position_embeddings=1024)
  batch = envs_build.build_envs(config, team, seed=0)
  settings = RolloutConfig(horizon=config.task.horizon)
  result = rollout(batch, team, None, params, model_config, tokenizer, jax.random.key(0),
                   config=settings)
  steps = [max(t.env_step for t in e.turns) + 1 for e in result.episodes if e.dropped is None]
  assert steps and max(steps) == 3  # the tiny model's guesses are wrong: every step is played
  late = [t for e in result.episodes for t in e.turns if t.env_step == 2]
  assert any("too" in t.prompt or "No number" in t.prompt for t in late)


def test_parity_trains_resumes_and_evaluates_from_python(tmp_path):
  """The same task from Python: `train(config, workdir, task=factory)` names the factory in
  the run's config, a second call resumes it, and `marft_jax.restore` evaluates it on
  problems of the test split."""
  import dataclasses

  import marft_jax
  from examples import parity, parity_config
  from marft_jax.train import loop
  from tests.train.echo_config import tiny_trainer_model
  declared = from_config_dict(TrainConfig, parity_config.get_config())
  config = dataclasses.replace(
      declared, task=dataclasses.replace(TrainConfig().task, eval_problems=8),  # no task named
      team=dataclasses.replace(declared.team, max_new_tokens=4, last_max_new_tokens=4),
      rollout=dataclasses.replace(declared.rollout, max_context=256), iterations=1)
  workdir, model = str(tmp_path / "run"), tiny_trainer_model()
  loop.train(config, workdir, model=model, progress=False, task=parity.make_env)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "1"))
  loop.train(dataclasses.replace(config, iterations=2), workdir, model=model, progress=False,
             task=parity.make_env)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f if '"reward"' in line]
  assert steps == [0, 1], steps  # each iteration once: the second after the resume
  run = marft_jax.restore(workdir, model=model)
  assert run.step == 2 and run.config.task.name == "examples.parity:make_env"
  assert dict(run.config.task.options) == {}  # the factory's own defaults
  assert 0.0 <= run.evaluate(num_problems=4)["accuracy"] <= 1.0

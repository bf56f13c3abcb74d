"""Held-out evaluation against counts made by hand from the episodes' own transcripts."""

import dataclasses
import re

import jax
import pytest

from marft_jax.models import tiny
from marft_jax.rollout import rollout, RolloutConfig
from marft_jax.train import config as config_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train import loop


@pytest.fixture(scope="module")
def model():
  return loop.Model(*tiny.tiny_model(max_position_embeddings=1024))


def _config(**changes):
  base = config_lib.preset("marft_a")
  return dataclasses.replace(
      base, task=config_lib.TaskSection(name="echo", echo_high=3, eval_problems=10),
      team=config_lib.TeamSection(max_new_tokens=4, last_max_new_tokens=4),
      rollout=dataclasses.replace(base.rollout, max_context=256), **changes)


def test_summary_matches_a_hand_count_of_the_replies(model):
  config = _config()
  team, structure = evaluate_lib.greedy_team(config)
  envs = loop.build_envs(dataclasses.replace(config, rollout=dataclasses.replace(
      config.rollout, num_envs=6)), team, seed=3)
  params, model_config = loop._rollout_model(model, config)
  episodes = rollout(envs, team, structure, params, model_config, model.tokenizer,
                     jax.random.key(0), config=RolloutConfig(max_context=256)).episodes
  # Rig the grade by hand: the env's number is in its task text; the repeater's first number
  # must equal it.
  right = []
  for e in episodes:
    shown = int(e.task.split(":")[-1])
    reply = [t.reply for t in e.turns if t.role == "repeater"][0]
    found = re.search(r"-?\d+", reply)
    right.append(found is not None and int(found.group()) == shown)
  summary = evaluate_lib.summarize(episodes, team)
  assert summary["episodes"] == 6 and summary["dropped"] == 0
  assert summary["accuracy"] == pytest.approx(sum(right) / 6)
  assert summary["accuracy/repeater"] == pytest.approx(sum(right) / 6)
  lengths = [t.num_tokens for e in episodes for t in e.turns if t.role == "helper0"]
  assert summary["reply_tokens/helper0"] == pytest.approx(sum(lengths) / len(lengths))


def test_evaluation_is_greedy_and_deterministic(model):
  config = _config()
  team, _ = evaluate_lib.greedy_team(config)
  assert all(p.sampling.temperature == 0.0 for p in team)
  first = evaluate_lib.evaluate(config, model, num_problems=7, batch_size=4)
  again = evaluate_lib.evaluate(config, model, num_problems=7, batch_size=4)
  assert first == again and first["episodes"] == 7


def test_launch_eval_restores_the_trained_adapters(model, tmp_path):
  """launch.eval's restore gives the run's adapters after its update (not the initial ones),
  evaluates with them, and refuses a checkpoint of a differently configured run by key."""
  import numpy as np
  from launch import eval as eval_launch
  config = _config(iterations=1, checkpoint_every=1,
                   optimizer=config_lib.OptimizerSection(lr=5e-2))
  loop.train(config, str(tmp_path), model=model, progress=False)
  policy, step = eval_launch.restore_policy(config, model, str(tmp_path))
  assert step == 1
  team, _ = loop.build_team(config)
  start = loop.init_state(config, model, len(team), *loop._optimizers(config)).policy
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(policy), jax.tree.leaves(start)))
  tuned = evaluate_lib.evaluate(config, model, policy, num_problems=8, batch_size=8)
  assert tuned["episodes"] == 8 and 0.0 <= tuned["accuracy"] <= 1.0
  with pytest.raises(Exception, match="seed"):
    eval_launch.restore_policy(dataclasses.replace(config, seed=5), model, str(tmp_path))


def test_launch_eval_help_lists_its_flags():
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-m", "launch.eval", "--help"], capture_output=True,
                       text=True, cwd=root, timeout=120)
  assert out.returncode == 0 and "--untuned" in out.stdout and "eval_problems" in out.stdout

"""Rewards beyond exact answers (rollout/rewards.py): the LLM judge on the tiny model with a
stand-in verdict, the user's reward function (per-role rewards reaching per_step credit), and
both through the trainer and the launch script."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from marft_jax import envs, rollout as rollout_lib
from marft_jax.models import layout, tiny
from marft_jax.models.sampling import SamplingConfig
from marft_jax.rollout import read_transcripts, rewards
from marft_jax.train.build import model as model_lib
from marft_jax.train import loop
from marft_jax.train.advantages import AdvantageConfig, compute_advantages
from marft_jax.train.batching import make_batch
from marft_jax.train import config as config_lib
from marft_jax.train.config import RewardSection
from tests.train.echo_config import echo_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("text,score", [
    ("Score: 7/10", 0.7), ("score=3/4 because", 0.75), ("12/10", 1.0), ("Score: 0.8", 0.8),
    ("Score: 9", 0.9), ("Yes, it is right.", 1.0), ("No.", 0.0), ("That is wrong", 0.0),
    ("I cannot tell", None), ("", None)])
def test_parse_verdict(text, score):
  got = rewards.parse_verdict(text)
  assert got == score if score is None else got == pytest.approx(score)


@pytest.fixture(scope="module")
def model():
  params, config, tokenizer = tiny.tiny_model(max_position_embeddings=1024)
  fast = config.replace(layout=layout.DECODING)
  return params, config, tokenizer, layout.convert_params(params, config.layout, fast.layout), fast


def _team():
  sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
  return (envs.AgentProfile("helper", "Say the number.", "Says it.", sampling),
          envs.AgentProfile("repeater", "Repeat the number.", "Repeats it.", sampling,
                            graded=True))


def _play(model, n=4):
  _, _, tokenizer, fast_params, fast = model
  batch = envs.EnvBatch(lambda i: envs.EchoEnv(graded=["repeater"]), n, seed=0)
  return rollout_lib.rollout(batch, _team(), None, fast_params, fast, tokenizer,
                             jax.random.key(1)).episodes


def _stand_in(text):
  """A verdict the tiny model cannot write: a score from the text's length, None for some."""
  return None if len(text) % 3 == 0 else (len(text) % 3) / 2


def test_judge_blends_its_score_into_the_last_step(model):
  _, _, tokenizer, fast_params, fast = model
  episodes = _play(model)
  env_rewards = [list(e.rewards[-1]) for e in episodes]
  judge = rewards.Judge(fast_params, fast, tokenizer, prompt="Grade it.", max_new_tokens=8,
                        weight=0.25, parse=_stand_in)
  metrics = rewards.apply_judge(episodes, _team(), judge, jax.random.key(0))
  scores = []
  for e, before in zip(episodes, env_rewards):
    text = e.infos[-1]["judge"]
    score = _stand_in(text)
    scores.append(0.0 if score is None else score)
    np.testing.assert_allclose(e.rewards[-1], 0.75 * np.asarray(before) + 0.25 * scores[-1])
    assert e.infos[-1]["judge_score"] == scores[-1]
  assert metrics["judge/score"] == pytest.approx(np.mean(scores))
  assert metrics["judge/unparseable"] == pytest.approx(
      np.mean([_stand_in(e.infos[-1]["judge"]) is None for e in episodes]))
  assert metrics["judge/tokens"] > 0 and metrics["judge/seconds"] > 0
  # Greedy: judging the same answers again writes the same verdicts.
  again = _play(model)
  rewards.apply_judge(again, _team(), judge, jax.random.key(9))
  assert [e.infos[-1]["judge"] for e in again] == [e.infos[-1]["judge"] for e in episodes]


def test_judge_prompt_holds_the_task_and_the_graded_final_answers(model):
  _, _, tokenizer, _, _ = model
  episodes = _play(model, n=1)
  answers = rewards.final_answers(episodes[0], _team())
  assert [role for role, _ in answers] == ["repeater"]
  assert answers[0][1] == episodes[0].turns[-1].reply
  text = tokenizer.decode(rewards.judge_prompt(tokenizer, "Grade it.", episodes[0].task, answers))
  assert "Grade it." in text and episodes[0].task.strip() in text and "repeater's answer" in text


def test_user_reward_function_per_role_and_team():
  team = _team()
  episode = rollout_lib.Episode(env_index=0, seed=0, task="t", policy_version=0,
                                rewards=[[0.0, 0.0]], dones=[True])
  rewards.apply_reward_fn([episode], team, lambda e, t: [[0.25, 1.0]])
  assert episode.rewards == [[0.25, 1.0]]
  rewards.apply_reward_fn([episode], team, lambda e, t: [0.5])
  assert episode.rewards == [[0.5, 0.5]]
  rewards.apply_reward_fn([episode], team, lambda e, t: None)
  assert episode.rewards == [[0.5, 0.5]]
  with pytest.raises(ValueError, match="3 rewards for a team of 2 roles"):
    rewards.apply_reward_fn([episode], team, lambda e, t: [[1, 2, 3]])
  with pytest.raises(ValueError, match="2 env steps of rewards for an episode of 1"):
    rewards.apply_reward_fn([episode], team, lambda e, t: [1, 2])
  # One bare float (a one-step task's natural mistake): was "object of type 'float' has no
  # len()", after a whole rollout.
  with pytest.raises(ValueError, match=r"returned 1\.0 for env 0: return one entry per env "
                                       r"step \(1 here\)"):
    rewards.apply_reward_fn([episode], team, lambda e, t: 1.0)


def _three_arguments(a, b, c):
  return None


@pytest.mark.parametrize("fn, message", [
    (os.getcwd, r"getcwd\(\): it is called as fn\(episode, team\) \(too many positional"),
    (_three_arguments, r"_three_arguments\(a, b, c\): it is called as fn\(episode, team\) "
                       r"\(missing a required argument: 'c'\)"),
    ("not a function", "not callable")])
def test_a_reward_fn_that_cannot_take_episode_and_team_is_refused(fn, message):
  with pytest.raises(ValueError, match=message):
    rewards.check_reward_fn(fn)
  for fine in (lambda e, t: None, lambda *args: None, lambda e, t, extra=0: None):
    rewards.check_reward_fn(fine)


def test_train_refuses_such_a_reward_fn_before_the_model_loads(tmp_path):
  """The model source does not exist: an error about it would mean it was read first."""
  config = echo_config(model=config_lib.ModelSection(source=str(tmp_path / "missing")))
  with pytest.raises(ValueError, match="it is called as fn"):
    loop.train(config, str(tmp_path / "run"), reward_fn=os.getcwd)


def test_per_role_rewards_reach_per_step_credit(model):
  """helper's reward lands on the helper's turn, repeater's on the repeater's."""
  episodes = _play(model, n=2)
  rewards.apply_reward_fn(episodes, _team(), lambda e, t: [[0.3, 1.0]])
  batch = make_batch(episodes, pad_id=0)
  config = AdvantageConfig(level="action", gamma=1.0, lambda_=1.0, credit="per_step",
                           normalize=False)
  out = compute_advantages(batch, episodes, config, 2)
  # Zero values, γ = λ = 1: a turn's return is its own reward plus the later turns'.
  np.testing.assert_allclose(out.turn_return[:4, 0], [1.3, 1.0, 1.3, 1.0], atol=1e-6)


def constant_reward(episode, team):
  """A user's reward for the launch test: 1 for every role, every step."""
  return [1.0] * len(episode.rewards)


def test_judge_and_reward_fn_through_the_trainer(tmp_path, monkeypatch):
  """One iteration with the judge on (the tiny base judging, a stand-in verdict of 1) and a
  user function that sees the judged episodes."""
  model = model_lib.Model(*tiny.tiny_model(max_position_embeddings=1024))
  config = echo_config("marft_a", num_envs=4, iterations=1,
                       reward=RewardSection(judge=True, judge_max_new_tokens=4,
                                            judge_weight=0.5))
  monkeypatch.setattr(rewards, "parse_verdict", lambda text: 1.0)
  seen = []
  metrics = loop.train(config, str(tmp_path), model=model, progress=False,
                       reward_fn=lambda e, t: seen.append(e.infos[-1]["judge_score"]))
  assert len(seen) == 4 and all(s == 1.0 for s in seen)
  assert metrics["judge/score"] == 1.0 and metrics["judge/tokens"] > 0
  assert metrics["reward_trained"] == pytest.approx(0.5 * metrics["reward"] + 0.5)
  first = read_transcripts(str(tmp_path / "transcripts"), 0)[0]
  assert first["infos"][-1]["judge_score"] == 1.0


def test_launch_refuses_a_reward_fn_it_cannot_import(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}",
       "--config.reward.fn=tests.rollout.test_rewards:no_such_function"],
      capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 2
  assert "config.reward.fn='tests.rollout.test_rewards:no_such_function'" in out.stderr
  out = subprocess.run(
      [sys.executable, "-m", "launch.train", f"--workdir={tmp_path}",
       "--config.reward.fn=tests.rollout.test_rewards:_three_arguments",
       f"--config.model.source={tmp_path / 'missing'}"],  # read after the reward fn's check
      capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 2
  assert out.stderr.strip() == (
      "error: config.reward.fn='tests.rollout.test_rewards:_three_arguments': reward function "
      "_three_arguments(a, b, c): it is called as fn(episode, team) (missing a required "
      "argument: 'c')"), out.stderr


def test_the_judge_can_be_a_second_model_with_its_own_adapter(tmp_path):
  """reward.judge_model (another model folder) and reward.judge_adapter (a PEFT folder) are
  what `build_judge` loads: that model's weights, tokenizer and the adapter."""
  from marft_jax import lora as lora_lib
  from marft_jax.train import algorithms
  from marft_jax.train.config import TrainConfig
  folder = tiny.save_tiny_model(tmp_path / "judge")
  policy_model = model_lib.Model(*tiny.tiny_model(max_position_embeddings=1024))
  _, judge_config, _ = tiny.tiny_model(max_position_embeddings=1024)
  adapter = lora_lib.init_adapters(lora_lib.LoraConfig(rank=2, alpha=4.0), judge_config,
                                   jax.random.key(3), 1)
  lora_lib.save_peft_adapter(tmp_path / "adapter", adapter)
  config = algorithms.resolve(TrainConfig(reward=RewardSection(
      judge=True, judge_model=str(folder), judge_adapter=str(tmp_path / "adapter"),
      judge_weight=0.3)))
  weights = model_lib.rollout_model(policy_model, config)
  judge = model_lib.build_judge(config, policy_model, weights)
  assert judge.params is not weights[0] and judge.weight == 0.3
  assert judge.adapter is not None and judge.adapter.num_adapters == 1
  assert judge.tokenizer is not policy_model.tokenizer

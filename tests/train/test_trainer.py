"""The trainer end to end on the tiny model: it learns, resumes exactly, isolates agents.

References: a toy task whose best answer is known (repeat the number shown: chance is the
untrained model's rate), an uninterrupted run (for resume), the sampler's own log-probs under
the updated adapters (for learner/sampler agreement), and the adapters before the update
(for isolation).
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marft_jax.models import tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.train import config as config_lib
from marft_jax.train.loop import Model, train


@pytest.fixture(scope="module")
def model():
  tokenizer = tiny.tiny_tokenizer()
  config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
  return Model(transformer.init_params(config, jax.random.key(0), std=0.1), config, tokenizer)


def _echo_config(algorithm, **changes):
  base = config_lib.preset(algorithm)
  sections = dict(
      task=config_lib.TaskSection(name="echo"),
      team=dataclasses.replace(base.team, max_new_tokens=3, last_max_new_tokens=3),
      rollout=dataclasses.replace(base.rollout, num_envs=32, max_context=256),
      lora=config_lib.LoraSection(rank=8, alpha=16.0),
      critic=dataclasses.replace(base.critic, hidden=(64,), lr=3e-3),
      optimizer=config_lib.OptimizerSection(lr=5e-3, epochs=2, minibatches=2),
      checkpoint_every=1000, iterations=40)
  sections.update(changes)
  return dataclasses.replace(base, **sections)


def _rewards(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["reward"] for line in f]


@pytest.mark.parametrize("algorithm", ["marft_a", "marft_t", "grpo"])
def test_reward_rises_from_chance_on_the_echo_task(model, tmp_path, algorithm):
  config = _echo_config(algorithm)
  train(config, str(tmp_path), model=model, progress=False)
  rewards = _rewards(tmp_path)
  assert np.mean(rewards[:3]) < 0.4, rewards
  assert max(np.mean(rewards[i:i + 3]) for i in range(len(rewards) - 2)) >= 0.8, rewards

"""No compiles in steady state: after a run's first iteration (and first evaluation), nothing
of rollout, evaluation or update compiles again, while the replies' lengths vary.

The tiny model at temperature 1 with its EOS embedding boosted stops at a random length, so
the second agent's prompt (which holds the first agent's reply), the rows the update trains
on and their trained positions all change from iteration to iteration. The reference is
JAX's own count of XLA compilations (`compile_stats`), which the trainer reports per
iteration as time/compiles and time/compile_s.
"""

import dataclasses

import jax
import numpy as np
import pytest

from marft_jax import compile_stats
from marft_jax.models import tiny, transformer
from marft_jax.models.config import tiny_config
from marft_jax.train.build import model as model_lib
from marft_jax.train import loop
from tests.train.echo_config import echo_config

ITERATIONS = 7
EVAL_EVERY = 3  # evaluations before iterations 0, 3 and 6


@pytest.fixture(scope="module")
def model():
  tokenizer = tiny.tiny_tokenizer()
  config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=1024)
  params = transformer.init_params(config, jax.random.key(0), std=0.1)
  # Tied embeddings: a larger EOS row along the mean embedding makes replies stop early often.
  embed = np.array(params["embed"])
  mean = embed.mean(axis=0)
  embed[tokenizer.eos_token_id] = 6.0 * mean / np.linalg.norm(mean)
  params = dict(params, embed=jax.numpy.asarray(embed))
  return model_lib.Model(params, config, tokenizer)


def test_iterations_after_the_first_compile_nothing(model, tmp_path):
  config = echo_config("marft_a", num_envs=8, iterations=ITERATIONS, eval_every=EVAL_EVERY,
                       eval_episodes=4)
  config = dataclasses.replace(  # a tiny learning rate: the replies keep varying in length
      config, optimizer=dataclasses.replace(config.optimizer, lr=1e-6),
      team=dataclasses.replace(config.team, max_new_tokens=12, last_max_new_tokens=12,
                               temperature=1.0))
  seen, names = [], []
  counter = compile_stats.CompileCounter()  # for the names of what compiled, if anything

  precisions = set()

  def record(iteration, metrics):
    seen.append(metrics)
    names.append(sorted(set(counter.delta().names)))
    precisions.add(jax.config.jax_default_matmul_precision)  # the run's (model.matmul_precision)

  loop.train(config, str(tmp_path), model=model, progress=False, on_iteration=record)
  lengths = [m["generated_tokens"] for m in seen]
  assert len(set(lengths)) > 2, lengths  # the replies' lengths did vary
  counts = [(m["time/compiles"], round(m["time/compile_s"], 2)) for m in seen]
  assert counts[0][0] > 0 and counts[0][1] > 0, counts
  assert all(count == 0 and seconds == 0 for count, seconds in counts[2:]), (counts, names)
  assert precisions == {"highest"}  # "auto" on a float32 model: exact f32 on every platform
  assert jax.config.jax_default_matmul_precision is None  # and only inside the run


def test_compile_counter_counts_a_new_shape_once():
  f = jax.jit(lambda x: x * 2 + 1)
  counter = compile_stats.CompileCounter()
  f(np.ones((3, 5), np.float32)).block_until_ready()
  first = counter.delta()
  f(np.zeros((3, 5), np.float32)).block_until_ready()
  again = counter.delta()
  f(np.ones((4, 5), np.float32)).block_until_ready()
  assert first.count >= 1 and first.seconds > 0 and any("lambda" in n for n in first.names)
  assert again.count == 0 and again.seconds == 0
  assert counter.delta().count >= 1
  assert again.metrics() == {"time/compiles": 0, "time/compile_s": 0.0}

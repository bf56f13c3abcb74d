"""Sampled evaluation's cost: seconds per problem at n = 1 (greedy) and n = 10 (T = 0.8).

  python -m bench.passk            # SmolLM2-135M f32, untuned, the code_2agents team
  python -m bench.passk --problems=4 --tiny   # the smoke run (figures mean nothing)

`evaluate.play` on HumanEval's first --problems problems (the code_2agents team: planner up
to 128 new tokens, coder up to 256, max_context 2048), as launch.eval plays them: greedy with
one episode per problem, then --samples_per_problem=10 at T = 0.8, each problem's 10 samples
one group of the batch, decoded in the same sampler calls. Each setting runs once to compile
(same seed: the timed run's shapes), then once timed. Prints name=value lines:

  passk_problems               problems timed
  passk_n1_s_per_problem       wall seconds per problem, greedy (the sandbox's grading included)
  passk_n10_s_per_problem      wall seconds per problem, 10 samples at T = 0.8
  passk_n10_s_per_sample       the same per sample
  passk_n10_over_n1            how much 10 samples cost against 1 (10 if batching bought nothing)
  passk_n1_tokens_per_problem, passk_n10_tokens_per_problem   tokens the agents generated
  passk_n1_pass1, passk_n10_pass1   pass@1 of the coder on these problems (small samples!)
  machine_load_avg_1m_start    others' work on a shared host
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from bench.common import emit
from launch.configs import code_2agents
from marft_jax.configs import from_config_dict
from marft_jax.models import tiny
from marft_jax.train import algorithms, assembly
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train.config import TaskSection, TrainConfig

_TINY = flags.DEFINE_bool("tiny", False, "smoke run on the tiny test model (figures mean nothing)")
_PROBLEMS = flags.DEFINE_integer("problems", 4, "HumanEval problems timed", lower_bound=1)


def make_config(tiny_run: bool) -> TrainConfig:
  config = from_config_dict(TrainConfig, code_2agents.get_config())
  config = algorithms.resolve(dataclasses.replace(config, task=TaskSection(name="humaneval")))
  if tiny_run:
    config = dataclasses.replace(config, team=dataclasses.replace(
        config.team, max_new_tokens=8, last_max_new_tokens=8))
  return config


def timed_play(config, model, weights, problems, samples, temperature):
  """(seconds, episodes) of the second of two identical plays (the first compiles)."""
  run = lambda: evaluate_lib.play(config, model, None, num_problems=problems,
                                  rollout_weights=weights, samples=samples,
                                  temperature=temperature)
  run()
  start = time.perf_counter()
  episodes = run()
  return time.perf_counter() - start, episodes


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = make_config(_TINY.value)
  if _TINY.value:
    model = assembly.Model(*tiny.tiny_model(max_position_embeddings=4096))
  else:
    model = assembly.load(config)
  weights = assembly.rollout_model(model, config)
  team = evaluate_lib.greedy_team(config)[0]
  problems = _PROBLEMS.value
  emit("machine_load_avg_1m_start", os.getloadavg()[0])
  emit("passk_problems", problems)
  seconds = {}
  for n, temperature in ((1, 0.0), (10, 0.8)):
    elapsed, episodes = timed_play(config, model, weights, problems, n, temperature)
    summary = evaluate_lib.summarize_samples(episodes, team, n, temperature)
    seconds[n] = elapsed / problems
    emit(f"passk_n{n}_s_per_problem", seconds[n])
    emit(f"passk_n{n}_tokens_per_problem",
         sum(t.num_tokens for e in episodes for t in e.turns) / problems)
    emit(f"passk_n{n}_pass1", summary["pass@1/coder"])
  emit("passk_n10_s_per_sample", seconds[10] / 10)
  emit("passk_n10_over_n1", seconds[10] / seconds[1])


if __name__ == "__main__":
  app.run(main)

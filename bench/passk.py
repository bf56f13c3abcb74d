"""Sampled evaluation's cost, and what batching several problems into one sampler call buys.

  python -m bench.passk            # SmolLM2-135M f32, untuned, the code_2agents team
  python -m bench.passk --problems=2 --eval_batch=20 --tiny   # the smoke run (figures mean nothing)

`evaluate.play` on HumanEval's first --problems problems (the code_2agents team: planner up
to 128 new tokens, coder up to 256, max_context 2048), as launch.eval plays them, in four arms:
greedy (one episode a problem) and --samples_per_problem=n at T = 0.8, each once with one
problem per sampler call (a batch of n rows: what launch.eval did for every n > 16 before
--eval_batch) and once with --eval_batch episodes per call (as many problems as fit, each one
group of n rows). Each arm first plays one call's worth of problems to compile (same seed and
shapes), then all --problems timed. Prints name=value lines:

  passk_problems, passk_samples, passk_eval_batch   the settings
  passk_n1_s_per_problem       wall seconds per problem, greedy, --eval_batch a call (the
                               sandbox's grading included)
  passk_n<n>_s_per_problem     the same for n samples at T = 0.8; passk_n<n>_s_per_sample
  passk_n1_one_problem_per_call_s_per_problem, passk_n<n>_one_problem_per_call_s_per_problem
                               the same, one problem per sampler call
  passk_n1_batching_speedup, passk_n<n>_batching_speedup   one-per-call time over batched time
  passk_n<n>_over_n1           what n samples cost against 1, both batched
  passk_n1_same_replies        the share of greedy episodes whose replies are the same text in
                               both arms (batching changes float rounding, not the algorithm)
  passk_n1_tokens_per_problem, passk_n<n>_tokens_per_problem   tokens the agents generated
  passk_n1_pass1, passk_n<n>_pass1   pass@1 of the coder on these problems (small samples!)
  machine_load_avg_1m_start, machine_load_avg_1m_end   others' work on a shared host
  peak_rss_gb                  this process's peak resident memory
"""

from __future__ import annotations

import dataclasses
import os
import resource
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
_SAMPLES = flags.DEFINE_integer("samples_per_problem", 10, "n of the sampled arms",
                                lower_bound=2)
_EVAL_BATCH = flags.DEFINE_integer("eval_batch", 40, "episodes per sampler call in the "
                                   "batched arms (launch.eval's --eval_batch)", lower_bound=1)


def make_config(tiny_run: bool) -> TrainConfig:
  config = from_config_dict(TrainConfig, code_2agents.get_config())
  config = algorithms.resolve(dataclasses.replace(config, task=TaskSection(name="humaneval")))
  if tiny_run:
    config = dataclasses.replace(config, team=dataclasses.replace(
        config.team, max_new_tokens=8, last_max_new_tokens=8))
  return config


def timed_play(config, model, weights, problems, samples, temperature, batch):
  """(seconds, episodes) of `problems` problems at `batch` episodes a call, after one call's
  worth of them has compiled the shapes."""
  run = lambda count: evaluate_lib.play(config, model, None, num_problems=count,
                                        rollout_weights=weights, samples=samples,
                                        temperature=temperature, batch_size=batch)
  run(min(problems, max(1, batch // samples)))
  start = time.perf_counter()
  episodes = run(problems)
  return time.perf_counter() - start, episodes


def _replies(episode) -> tuple:
  return tuple(t.reply for t in episode.turns)


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
  problems, n, batch = _PROBLEMS.value, _SAMPLES.value, _EVAL_BATCH.value
  emit("machine_load_avg_1m_start", os.getloadavg()[0])
  emit("passk_problems", problems)
  emit("passk_samples", n)
  emit("passk_eval_batch", batch)
  seconds, greedy = {}, {}
  for samples, temperature in ((1, 0.0), (n, 0.8)):
    for name, per_call in (("_one_problem_per_call", samples), ("", batch)):
      elapsed, episodes = timed_play(config, model, weights, problems, samples, temperature,
                                     per_call)
      seconds[samples, name] = elapsed / problems
      emit(f"passk_n{samples}{name}_s_per_problem", seconds[samples, name])
      if samples == 1:
        greedy[name] = [_replies(e) for e in episodes]
    summary = evaluate_lib.summarize_samples(episodes, team, samples, temperature)
    emit(f"passk_n{samples}_tokens_per_problem",
         sum(t.num_tokens for e in episodes for t in e.turns) / problems)
    emit(f"passk_n{samples}_pass1", summary["pass@1/coder"])
    emit(f"passk_n{samples}_batching_speedup",
         seconds[samples, "_one_problem_per_call"] / seconds[samples, ""])
  emit("passk_n1_same_replies", sum(a == b for a, b in zip(*greedy.values())) / problems)
  emit(f"passk_n{n}_s_per_sample", seconds[n, ""] / n)
  emit(f"passk_n{n}_over_n1", seconds[n, ""] / seconds[1, ""])
  emit("machine_load_avg_1m_end", os.getloadavg()[0])
  emit("peak_rss_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


if __name__ == "__main__":
  app.run(main)

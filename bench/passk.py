"""Sampled evaluation's cost, and what batching several problems into one sampler call buys.

  python -m bench.passk            # SmolLM2-135M f32, untuned, the code_2agents team
  python -m bench.passk --problems=2 --eval_batch=20 --tiny   # the smoke run (figures mean nothing)
  python -m bench.passk --nocompare --samples_per_problem=20 --throughput=40,80,160
                                   # where sampled evaluation's time goes, per sampler call
  python -m bench.passk --nocompare --split=40,80,160   # the sampler's prefill and decode step

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

--throughput=B1,B2,... (n samples at T = 0.8, --problems problems, --eval_batch B each, after
one compiling call's worth; --nocompare skips the four arms above) times every sampler call
(`sampler.generate`, its outputs read back) and prints for each B:

  passk_b<B>_s_per_sample      wall seconds per sample (grading included)
  passk_b<B>_sampler_share     the sampler calls' share of that wall time
  passk_b<B>_tok_s             generated tokens per second of sampler call
  passk_b<B>_calls             sampler calls (one per agent turn of each batch)
  passk_b<B>_steps_share       decode steps run over the steps the budgets allow: each call
                               runs until its longest row stops, so 1 means every call ran
                               to its max_new_tokens
  passk_b<B>_rows_at_budget    share of rows that used their whole max_new_tokens (no EOS)
  passk_b<B>_prompt_tokens     mean real prompt tokens of a row (its prefill)

--split=B1,B2,... times `sampler.generate` alone on B random prompts of --split_prompt tokens at
T = 0.8 with no stop token (every row runs to its budget), the median of --split_repeats calls
with 1 and with --split_new new tokens, and prints for each B:

  passk_split_b<B>_prefill_s   a call with 1 new token (the prompt's encoding)
  passk_split_b<B>_step_s      each further decode step: (long call - prefill) / (split_new - 1)
  passk_split_b<B>_tok_s       new tokens per second of the long call (B * split_new / its s)
  peak_rss_gb                  this process's peak resident memory
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time

import jax
import numpy as np
from absl import app, flags, logging

from bench.common import emit
from launch.configs import code_2agents
from marft_jax.configs import from_config_dict
from marft_jax.models import sampler, sampler_plan, tiny
from marft_jax.train.config import resolve as resolve_lib
from marft_jax.train.build import model as model_lib
from marft_jax.train import evaluate as evaluate_lib
from marft_jax.train.config import TaskSection, TrainConfig

_TINY = flags.DEFINE_bool("tiny", False, "smoke run on the tiny test model (figures mean nothing)")
_PROBLEMS = flags.DEFINE_integer("problems", 4, "HumanEval problems timed", lower_bound=1)
_SAMPLES = flags.DEFINE_integer("samples_per_problem", 10, "n of the sampled arms",
                                lower_bound=2)
_EVAL_BATCH = flags.DEFINE_integer("eval_batch", 40, "episodes per sampler call in the "
                                   "batched arms (launch.eval's --eval_batch)", lower_bound=1)
_COMPARE = flags.DEFINE_bool("compare", True, "time the four arms (greedy and n samples, one "
                             "problem a call and --eval_batch a call)")
_THROUGHPUT = flags.DEFINE_list("throughput", [], "eval batches whose sampler calls are timed "
                                "one by one (n samples at T = 0.8)")
_SPLIT = flags.DEFINE_list("split", [], "rows of the prefill / decode timing of sampler.generate")
_SPLIT_PROMPT = flags.DEFINE_integer("split_prompt", 176, "--split's prompt tokens", lower_bound=1)
_SPLIT_NEW = flags.DEFINE_integer("split_new", 129, "--split's long call's new tokens",
                                  lower_bound=2)
_SPLIT_REPEATS = flags.DEFINE_integer("split_repeats", 2, "--split's timed calls of each kind",
                                      lower_bound=1)
_CALLS_OUT = flags.DEFINE_string("calls_out", None, "a JSON Lines file for --throughput's "
                                 "per-call records (batch, rows, prompt tokens, steps, seconds)")


def make_config(tiny_run: bool) -> TrainConfig:
  config = from_config_dict(TrainConfig, code_2agents.get_config())
  config = resolve_lib.resolve(dataclasses.replace(config, task=TaskSection(name="humaneval")))
  if tiny_run:
    config = dataclasses.replace(config, team=dataclasses.replace(
        config.team, max_new_tokens=8, last_max_new_tokens=8))
  return config


def timed_play(config, model, weights, problems, samples, temperature, batch,
               after_compile=lambda: None):
  """(seconds, episodes) of `problems` problems at `batch` episodes a call, after one call's
  worth of them has compiled the shapes (then `after_compile()` runs)."""
  run = lambda count: evaluate_lib.play(config, model, None, num_problems=count,
                                        rollout_weights=weights, samples=samples,
                                        temperature=temperature, batch_size=batch)
  run(min(problems, max(1, batch // samples)))
  after_compile()
  start = time.perf_counter()
  episodes = run(problems)
  return time.perf_counter() - start, episodes


class CallRecorder:
  """Stands in for `sampler.generate` (the rollout calls it through the module): times each
  call with its outputs read back, and records its rows, prompt and decode steps."""

  def __init__(self, generate):
    self.generate, self.calls = generate, []

  def __call__(self, params, tokens, config, *, max_new_tokens, prompt_lens, **kwargs):
    start = time.perf_counter()
    out = self.generate(params, tokens, config, max_new_tokens=max_new_tokens,
                        prompt_lens=prompt_lens, **kwargs)
    lengths = np.asarray(out.lengths)  # [B] valid new tokens; waits for the call
    budget = np.asarray(max_new_tokens)
    busy = budget > 0
    self.calls.append(dict(
        seconds=time.perf_counter() - start, rows=int(busy.sum()), batch=len(budget),
        prompt_tokens=[int(n) for n in np.asarray(prompt_lens)[busy]],
        steps=int(lengths.max()), budget=int(budget.max()),
        at_budget=int((lengths[busy] >= budget[busy]).sum()),
        new_tokens=int(lengths.sum())))
    return out


def throughput(config, model, weights, problems, samples, batch):
  """(figures, per-call records) of `problems` problems, `samples` each at T = 0.8, `batch`
  episodes a call, after one compiling call's worth (see the module docstring)."""
  recorder = CallRecorder(sampler.generate)
  sampler.generate = recorder
  try:
    elapsed, episodes = timed_play(config, model, weights, problems, samples, 0.8, batch,
                                   after_compile=recorder.calls.clear)
  finally:
    sampler.generate = recorder.generate
  timed = recorder.calls
  seconds = sum(c["seconds"] for c in timed)
  prompts = [n for c in timed for n in c["prompt_tokens"]]
  figures = {
      "s_per_sample": elapsed / len(episodes),
      "sampler_share": seconds / elapsed,
      "tok_s": sum(c["new_tokens"] for c in timed) / seconds,
      "calls": len(timed),
      "steps_share": sum(c["steps"] for c in timed) / sum(c["budget"] for c in timed),
      "rows_at_budget": sum(c["at_budget"] for c in timed) / sum(c["rows"] for c in timed),
      "prompt_tokens": float(np.mean(prompts)),
  }
  return figures, timed


def prefill_and_decode(weights, rows, prompt, new, repeats):
  """(prefill s, s a decode step, new tokens/s) of `sampler.generate` on `rows` random prompts
  of `prompt` tokens: the median of `repeats` calls with 1 and with `new` new tokens each, after
  one of each has compiled."""
  params, model_config = weights
  tokens = np.random.default_rng(0).integers(100, model_config.vocab_size, (rows, prompt))

  def call(count):
    start = time.perf_counter()
    out = sampler.generate(params, tokens.astype(np.int32), model_config, rng=jax.random.key(0),
                           max_new_tokens=count, temperature=0.8, share_prefix=False,
                           max_new_tokens_bucket=sampler_plan.bucket(new, 16))
    np.asarray(out.lengths)  # waits for the call
    return time.perf_counter() - start

  call(1), call(new)
  short = float(np.median([call(1) for _ in range(repeats)]))
  long = float(np.median([call(new) for _ in range(repeats)]))
  return short, (long - short) / (new - 1), rows * new / long


def _replies(episode) -> tuple:
  return tuple(t.reply for t in episode.turns)


def compare(config, model, weights, team, problems, n, batch):
  """The four arms of the module docstring: greedy and n samples, one problem a call and
  `batch` episodes a call."""
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


def _ints(flag) -> list:
  try:
    return [int(b) for b in flag.value]
  except ValueError:
    raise app.UsageError(f"--{flag.name}={','.join(flag.value)}: a list of ints") from None


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  batches, split = (_ints(flag) for flag in (_THROUGHPUT, _SPLIT))
  config = make_config(_TINY.value)
  if _TINY.value:
    model = model_lib.Model(*tiny.tiny_model(max_position_embeddings=4096))
  else:
    model = model_lib.load(config)
  weights = model_lib.rollout_model(model, config)
  team = evaluate_lib.greedy_team(config)[0]
  problems, n, batch = _PROBLEMS.value, _SAMPLES.value, _EVAL_BATCH.value
  emit("machine_load_avg_1m_start", os.getloadavg()[0])
  emit("passk_problems", problems)
  emit("passk_samples", n)
  emit("passk_eval_batch", batch)
  if _COMPARE.value:
    compare(config, model, weights, team, problems, n, batch)
  for b in batches:
    figures, calls = throughput(config, model, weights, problems, n, b)
    for name, value in figures.items():
      emit(f"passk_b{b}_{name}", value)
    if _CALLS_OUT.value:
      with open(_CALLS_OUT.value, "a") as f:
        f.writelines(json.dumps(dict(call, eval_batch=b)) + "\n" for call in calls)
  for b in split:
    figures = prefill_and_decode(weights, b, _SPLIT_PROMPT.value, _SPLIT_NEW.value,
                                 _SPLIT_REPEATS.value)
    for name, value in zip(("prefill_s", "step_s", "tok_s"), figures):
      emit(f"passk_split_b{b}_{name}", value)
  emit("machine_load_avg_1m_end", os.getloadavg()[0])
  emit("peak_rss_gb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


if __name__ == "__main__":
  app.run(main)

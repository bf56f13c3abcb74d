"""Rollout throughput: the whole multi-agent loop against the sampler alone and against torch.

One run, SmolLM2-135M f32 in the decoding layout, 16 math episodes (generated arithmetic word
problems), 2 agents (reasoner up to 96 new tokens, actor up to 24), 2 LoRA adapters:

  rollout_tok_s               generated tokens / wall time of `rollout.rollout` (prompt
                              building, tokenising, the environment and the records included)
  rollout_fraction_of_sampler ÷ the sampler alone replaying the same calls (the recorded
                              prompts, each row generating exactly its recorded number of
                              tokens, same batch): what the host side costs (target ≥ 0.8)
  rollout_ratio_vs_torch      ÷ the original MARFT's way: transformers `generate` with each
                              agent's PEFT adapter, agent after agent, every prompt encoded
                              afresh, on the same prompts and token counts (target ≥ 2)

The same three figures with the `shared_stream_` prefix for the shared stream, where agent 2
continues agent 1's KV cache (its torch reference re-encodes the whole stream, as a
`generate` over the growing text must). Each configuration runs once to compile, then once
timed. `--tiny`: the tiny test model and 4 episodes (a smoke run; the figures mean nothing).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import app, flags, logging

from bench.common import emit, torch_model

from marft_jax import envs, lora as lora_lib
from marft_jax.envs import arithmetic
from marft_jax.envs.math_env import MathEnv
from marft_jax.envs.problems import ProblemSet
from marft_jax.models import layout, sampler, tiny
from marft_jax.models.sampling import SamplingConfig
from marft_jax.rollout import RolloutConfig, rollout

_TINY = flags.DEFINE_bool("tiny", False, "smoke run on the tiny test model")
_TORCH = flags.DEFINE_bool("torch", True, "also time the torch + PEFT reference")
_EPISODES = flags.DEFINE_integer("episodes", 16, "math episodes (the batch)")


def load(tiny_run: bool):
  if tiny_run:
    return tiny.tiny_model(max_position_embeddings=1024)
  from marft_jax.models.smollm2 import load_smollm2
  return load_smollm2()


def make_team(reasoner_tokens, actor_tokens):
  reasoner, actor = envs.math_team(2)
  limit = lambda p, n: dataclasses.replace(p, sampling=SamplingConfig(max_new_tokens=n,
                                                                      temperature=1.0))
  return limit(reasoner, reasoner_tokens), limit(actor, actor_tokens)


def replay_sampler(result, params, config, adapters, mode, num_new):
  """The sampler alone on the rollout's own calls: same prompts, same per-row token counts."""
  turns = len(result.episodes[0].turns)
  start, cache = time.perf_counter(), None
  for turn in range(turns):
    prompts, counts = [], []
    for episode in result.episodes:
      sequence = episode.sequences[turn if mode == "per_agent" else 0]
      span = sequence.spans[0 if mode == "per_agent" else turn]
      begin = 0 if mode == "per_agent" or turn == 0 else sequence.spans[turn - 1].end
      prompts.append(sequence.tokens[begin:span.start])
      counts.append(span.end - span.start)
    width = max(map(len, prompts))
    padded = np.array([p + [0] * (width - len(p)) for p in prompts], np.int32)
    out = sampler.generate(
        params, padded, config, rng=jax.random.key(turn), max_new_tokens=np.maximum(counts, 1),
        prompt_lens=[len(p) for p in prompts], lora=adapters, adapter_ids=[turn % 2] * len(prompts),
        temperature=1.0, cache=cache, max_new_tokens_bucket=num_new,
        # As the rollout sizes them: a per-agent turn's cache fits its own prompt and reply
        # (the sampler's default); a shared stream's holds the whole stream.
        cache_size=2 * 1024 if mode == "shared_stream" and cache is None else None)
    jax.block_until_ready(out.tokens)
    cache = out.cache if mode == "shared_stream" else None
  return time.perf_counter() - start


def torch_reference(params, config, tokenizer, result, mode, team):
  """Agent after agent with transformers + PEFT, each prompt encoded afresh (left-padded)."""
  import torch
  from peft import LoraConfig as PeftLoraConfig, get_peft_model
  peft_config = PeftLoraConfig(r=16, lora_alpha=16, target_modules="all-linear")
  model = get_peft_model(torch_model(params, config), peft_config, adapter_name=team[0].role)
  model.add_adapter(team[1].role, peft_config)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  total, start = 0, time.perf_counter()
  for turn in range(len(result.episodes[0].turns)):
    model.set_adapter(team[turn % 2].role)
    rows, counts = [], []
    for episode in result.episodes:
      sequence = episode.sequences[turn if mode == "per_agent" else 0]
      span = sequence.spans[0 if mode == "per_agent" else turn]
      rows.append(sequence.tokens[:span.start])  # the whole prompt, re-encoded
      counts.append(span.end - span.start)
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                           top_k=0, top_p=1.0, max_new_tokens=max(counts),
                           pad_token_id=pad, eos_token_id=None)
    total += int(sum(counts))  # the tokens the rollout produced (torch ran to the longest)
    del out
  return total / (time.perf_counter() - start)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  tiny_run = _TINY.value
  params, base, tokenizer = load(tiny_run)
  fast = base.replace(layout=layout.decoding())
  fast_params = layout.convert_params(params, base.layout, fast.layout)
  episodes = 4 if tiny_run else _EPISODES.value
  team = make_team(*((12, 6) if tiny_run else (96, 24)))
  adapters = lora_lib.init_adapters(lora_lib.LoraConfig(rank=16, alpha=16), base,
                                    jax.random.key(1), num_adapters=2)
  problems = ProblemSet(arithmetic.generate_problems(256, level=2, seed=0))
  for mode in ("per_agent", "shared_stream"):
    prefix = "" if mode == "per_agent" else "shared_stream_"
    batch = lambda seed: envs.EnvBatch(lambda i: MathEnv(problems, graded_roles=["actor"]),
                                       episodes, seed=seed)
    config = RolloutConfig(context_mode=mode, max_context=1024)
    play = lambda seed: rollout(batch(seed), team, None, fast_params, fast, tokenizer,
                                jax.random.key(seed), lora=adapters, config=config)
    play(100)  # compile
    result = play(0)
    rate = result.metrics["generated_tokens"] / result.metrics["rollout_s"]
    emit(f"{prefix}rollout_generated_tokens", result.metrics["generated_tokens"])
    emit(f"{prefix}rollout_tok_s", rate)
    num_new = sampler.bucket(max(p.sampling.max_new_tokens for p in team), 16)
    replay_sampler(result, fast_params, fast, adapters, mode, num_new)  # compile
    alone = replay_sampler(result, fast_params, fast, adapters, mode, num_new)
    emit(f"{prefix}sampler_alone_tok_s", result.metrics["generated_tokens"] / alone)
    emit(f"{prefix}rollout_fraction_of_sampler", alone / result.metrics["rollout_s"])
    if _TORCH.value:
      torch_rate = torch_reference(params, base, tokenizer, result, mode, team)
      emit(f"{prefix}torch_rollout_tok_s", torch_rate)
      emit(f"{prefix}rollout_ratio_vs_torch", rate / torch_rate)


if __name__ == "__main__":
  app.run(main)

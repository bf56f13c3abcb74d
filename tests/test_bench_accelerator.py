"""`python -m bench.accelerator --tiny` runs on CPU and prints every figure the device run
reports (the Qwen2 shape's: both update sizes, the torch side's ratios), so the script cannot
rot between the sessions that have a GPU to run it on.

It runs without the packages that the GPU host once measured lacked (`_ABSENT`, made
unimportable in the subprocess), as the benchmark must run there from the checkout with
`PYTHONPATH=.`: the model, sampler, LoRA and update import none of them."""

import math
import os
import re
import subprocess
import sys

import pytest

from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = "qwen2_1p5b"
EXPECTED = ["machine_read_gb_s", "machine_bf16_matmul_tflop_s", "total_s",
            f"{MODEL}_weight_bytes", f"{MODEL}_matmul_params"] + [
    f"{MODEL}_decode_b{b}_{name}" for b in (1, 16) for name in (
        "tok_s", "bound_tok_s", "fraction_of_bound", "compile_s", "ratio_vs_torch")] + [
    f"{MODEL}_torch_decode_b{b}_tok_s" for b in (1, 16)] + [
    f"{MODEL}_update_{shape}_{name}" for shape in ("8x256", "16x1024") for name in (
        "s", "fraction_of_matmul_peak", "compile_s", "remat", "torch_s", "ratio_vs_torch")]


# What the H200 host lacked (../shared/design.md 1b): loaders, configs, metrics, the maths grader.
_ABSENT = ("gguf", "ml_collections", "tensorboardX", "math_verify", "latex2sympy2_extended",
           "antlr4")
# A None entry in sys.modules makes `import x` raise ImportError and find_spec("x") say None,
# as on a host where x is not installed.
_RUN_WITHOUT = ("import runpy, sys; sys.modules.update(dict.fromkeys({absent})); "
                "runpy.run_module('bench.accelerator', run_name='__main__', alter_sys=True)")


def test_accelerator_benchmark_smoke_run_prints_its_figures():
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)
  command = [sys.executable, "-c", _RUN_WITHOUT.format(absent=_ABSENT), "--tiny",
             f"--models={MODEL}"]
  out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  figures = dict(re.findall(r"^(\w+)=(\S+)$", out.stdout, re.M))
  for name in EXPECTED:
    assert name in figures, f"bench.accelerator did not print {name}=:\n{out.stdout}"
    value = float(figures[name])
    assert math.isfinite(value) and value >= 0, (name, figures[name])
  assert figures[f"{MODEL}_update_8x256_remat"] == "0"
  # On CPU: the hand-written attention and the CPU decoding layout.
  assert figures[f"{MODEL}_attention_kernel"] == "reference"
  assert "scan_layers=False, feature_major=True" in out.stdout


def test_a_failed_measurement_is_named_and_the_others_still_run(monkeypatch, capsys):
  """A device session is short: one of our measurements that raises (a kernel the card
  refuses, say) is logged, the rest are still measured and printed, and the run exits
  non-zero naming it. The timings are stubbed: this checks the bookkeeping only."""
  from absl.testing import flagsaver  # noqa: PLC0415
  from bench import accelerator  # noqa: PLC0415 (defines absl flags)

  def time_marft(dparams, config, prompts, new_tokens, repeats):
    if len(prompts) == 1:
      raise RuntimeError("no kernel for this shape")
    return 0.5, 2.0, 0.1

  # main() quiets absl's logger for the whole process: leave this worker's as it is.
  monkeypatch.setattr(accelerator.logging, "set_verbosity", lambda level: None)
  monkeypatch.setattr(accelerator, "time_marft", time_marft)
  monkeypatch.setattr(accelerator, "our_update", lambda *args: (1.0, 0.25, False))
  with flagsaver.as_parsed(tiny="true", torch="false", models=MODEL):
    with pytest.raises(SystemExit) as exited:
      accelerator.main([])
  assert str(exited.value.code).endswith(f"failed (tracebacks above): {MODEL}_decode_b1")
  figures = dict(re.findall(r"^(\w+)=(\S+)$", capsys.readouterr().out, re.M))
  assert f"{MODEL}_decode_b1_tok_s" not in figures
  new_tokens = accelerator.TINY_NEW_TOKENS
  assert float(figures[f"{MODEL}_decode_b16_tok_s"]) == pytest.approx(16 * new_tokens / 2.0)
  for shape in ("8x256", "16x1024"):
    assert float(figures[f"{MODEL}_update_{shape}_s"]) == 0.25
  assert "total_s" in figures

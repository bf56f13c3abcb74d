"""Every benchmark runs (on the tiny model, `--tiny`) and prints the `name=value` lines its
issue names, so the scripts cannot rot between the sessions that run them for real."""

import os
import re
import subprocess
import sys

import pytest

from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXPECTED = {
    "bench.decode": ["decode_b1_tok_s", "decode_b1_fraction_of_bound", "decode_b1_ratio_vs_torch",
                     "max_abs_logit_diff_vs_torch", "machine_memory_read_gb_s",
                     "machine_matmul_2048_gflop_s", "compile_s"],
    "bench.lora": ["multi_adapter_cost_ratio_2_agents", "multi_adapter_cost_ratio_4_agents",
                   "ratio_routed4_vs_single_median"],
    "bench.rollout": [f"{prefix}{name}" for prefix in ("", "shared_stream_") for name in (
        "rollout_tok_s", "rollout_fraction_of_sampler", "rollout_ratio_vs_torch")],
    "bench.update": ["update_fraction_of_matmul_peak", "update_ratio_vs_torch",
                     "machine_matmul_2048_gflop_s"],
}


# bench.rollout's re-encoding arm is `rollout(reencode=True)` (test_rollout checks it equals
# the cache continuation) timed like the others; its compiles were a third of the smoke run.
FLAGS = {"bench.rollout": ["--noreencode"]}


@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_benchmark_smoke_run_prints_its_figures(module):
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)
  out = subprocess.run([sys.executable, "-m", module, "--tiny", *FLAGS.get(module, [])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  figures = dict(re.findall(r"^(\w+)=(\S+)$", out.stdout, re.M))
  for name in EXPECTED[module]:
    assert name in figures, f"{module} did not print {name}=:\n{out.stdout}"
    assert float(figures[name]) >= 0, (name, figures[name])

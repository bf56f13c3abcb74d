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
    "bench.iteration": ["iteration_s", "share_rollout", "share_prepare", "share_advantages",
                        "share_update", "share_other", "share_checkpoint",
                        "update_useful_fraction",
                        "machine_matmul_2048_gflop_s",
                        # --ceiling: the dense passes' rates at the run's minibatch shape
                        "dense_fwd_bwd_fraction", "dense_fwd_fraction",
                        "update_useful_ceiling", "update_useful_ceiling_padded"],
    "bench.humaneval": ["humaneval_problems", "humaneval_canonical_passed",
                        "humaneval_none_passed", "humaneval_s_per_job",
                        "grading_s_per_episode_parallel_2", "grading_s_per_episode_parallel_4",
                        "grading_speedup"],
    "bench.lora": ["multi_adapter_cost_ratio_2_agents", "multi_adapter_cost_ratio_4_agents",
                   "ratio_routed4_vs_single_median"],
    "bench.passk": ["passk_problems", "passk_samples", "passk_eval_batch",
                    *(f"passk_{arm}_{name}" for arm in ("n1", "n2") for name in (
                        "s_per_problem", "one_problem_per_call_s_per_problem",
                        "batching_speedup", "tokens_per_problem", "pass1")),
                    "passk_n1_same_replies", "passk_n2_s_per_sample", "passk_n2_over_n1",
                    *(f"passk_b4_{name}" for name in (
                        "s_per_sample", "sampler_share", "tok_s", "calls", "steps_share",
                        "rows_at_budget", "prompt_tokens")),
                    *(f"passk_split_b4_{name}" for name in ("prefill_s", "step_s", "tok_s")),
                    "machine_load_avg_1m_start", "machine_load_avg_1m_end", "peak_rss_gb"],
    "bench.rollout": [f"{prefix}{name}" for prefix in ("", "shared_stream_") for name in (
        "rollout_tok_s", "rollout_fraction_of_sampler", "rollout_ratio_vs_torch")],
    "bench.update": ["update_fraction_of_matmul_peak", "update_ratio_vs_torch",
                     "machine_matmul_2048_gflop_s"],
}


# bench.rollout's re-encoding arm is `rollout(reencode=True)` (test_rollout checks it equals
# the cache continuation) timed like the others; its compiles were a third of the smoke run.
# bench.iteration: one iteration, its compiles included (two took 38 s on a loaded host), and
# --ceiling's dense passes at that run's shapes.
# bench.passk: 2 HumanEval problems, n = 2, 4 episodes a call; every arm and one throughput
# batch (its smallest run prints every figure it has).
FLAGS = {"bench.rollout": ["--noreencode"],
         "bench.iteration": ["--iterations=1", "--warmup=0", "--ceiling"],
         "bench.passk": ["--problems=2", "--samples_per_problem=2", "--eval_batch=4",
                         "--throughput=4", "--split=4", "--split_new=65", "--split_repeats=1"]}
# The benches whose smoke run prints exactly the figures listed, no other.
EXACT = {"bench.passk"}
# Differences of two timings: on the tiny model both are mostly dispatch, the sign is noise.
SIGNED = {"passk_split_b4_step_s"}


@pytest.mark.parametrize("module", sorted(EXPECTED))
def test_benchmark_smoke_run_prints_its_figures(module):
  env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)
  out = subprocess.run([sys.executable, "-m", module, "--tiny", *FLAGS.get(module, [])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  figures = dict(re.findall(r"^(\w+)=(\S+)$", out.stdout, re.M))
  for name in EXPECTED[module]:
    assert name in figures, f"{module} did not print {name}=:\n{out.stdout}"
    assert name in SIGNED or float(figures[name]) >= 0, (name, figures[name])
  if module in EXACT:
    assert sorted(figures) == sorted(EXPECTED[module]), out.stdout


def test_iteration_counts_the_useful_flops_of_the_formula():
  """bench.iteration's FLOP count against the model's shapes, written out by hand."""
  import dataclasses
  import jax
  import numpy as np
  from bench import flops
  from bench.common import SMOLLM2_SHAPE
  from marft_jax.models import transformer
  from marft_jax.models.config import tiny_config
  from marft_jax.train.config import preset
  config = tiny_config()  # D 64, 4 heads and 2 kv heads of 16, MLP 128, 2 layers, V 256
  attention = 64 * 64 + 2 * (64 * 32) + 64 * 64  # q, k, v, o
  n_layers = 2 * (attention + 3 * 64 * 128)  # + gate, up, down
  params = transformer.init_params(config, jax.random.key(0))
  assert flops.matmul_params(params, config) == (n_layers, 256 * 64)
  # SmolLM2-135M: 134.5 M matmul parameters, the tied embedding counted once.
  smollm2 = jax.eval_shape(lambda: transformer.init_params(SMOLLM2_SHAPE, jax.random.key(0)))
  assert sum(flops.matmul_params(smollm2, SMOLLM2_SHAPE)) == 134_479_872
  train = preset("marft_a")  # 1 epoch, the frozen-base critic, no KL term
  policy = 4 * 1000 * 300 + 4 * 100 * 30
  assert flops.useful_flops(train, 1000, 100, 300, 30) == policy + 2 * 1000 * 300
  two_epochs_kl = dataclasses.replace(
      train, optimizer=dataclasses.replace(train.optimizer, epochs=2),
      loss=dataclasses.replace(train.loss, kl_coef=0.1))
  assert flops.useful_flops(two_epochs_kl, 1000, 100, 300, 30) == (
      2 * policy + 2 * 1000 * 300 + 2 * (1000 * 300 + 100 * 30))
  # Rows 0 and 1 (one episode) share their first 2 tokens; row 2 (another episode) all 3.
  batch = type("Batch", (), dict(
      tokens=np.array([[5, 6, 7, 0], [5, 6, 8, 9], [5, 6, 7, 0]]),
      mask=np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]], bool),
      row_episode=np.array([0, 0, 1])))
  assert flops.shared_prefix_tokens(batch) == (2, 10)


def test_iteration_num_layers_cuts_the_base_it_loads():
  """bench.iteration --num_layers=n (`common.load_base`): model.source's first n layers, the
  rest of the model (width, vocabulary, tokenizer) as `launch.train` loads it; 0: every
  layer. (bench.iteration itself is not imported here: its flags would clash with the other
  benchmarks'.)"""
  import dataclasses
  import jax
  import numpy as np
  from bench.common import load_base
  from marft_jax.train.config import TrainConfig
  from tests.fixtures.old_checkpoints import make  # a tiny model folder, tokenizer included
  config = TrainConfig()
  config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 source=make.MODEL))
  full, cut = load_base(config), load_base(config, 1)
  assert full.config.num_layers > 1 and cut.config == full.config.replace(num_layers=1)
  for whole, first in zip(jax.tree.leaves(full.params["layers"]),
                          jax.tree.leaves(cut.params["layers"])):
    np.testing.assert_array_equal(np.asarray(whole)[:1], np.asarray(first))
  np.testing.assert_array_equal(np.asarray(full.params["embed"]), np.asarray(cut.params["embed"]))

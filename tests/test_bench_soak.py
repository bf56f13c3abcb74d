"""bench/soak.py: a few iterations of `launch.train` print the soak's figures (the real soak
runs thousands, see its docstring); its helpers on hand-made files."""

import os
import re
import subprocess
import sys

import pytest

from bench import soak
from tests.compile_flags import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = ["rss_slope_kb_per_1000_iters", "rss_anon_slope_kb_per_1000_iters",
           "rss_file_slope_kb_per_1000_iters", "rss_mb_at_warmup", "rss_mb_end", "s_per_iter",
           "workdir_bytes_per_iter", *(f"workdir_bytes_per_iter_{part}" for part in (
               "transcripts", "tensorboard", "metrics_jsonl", "texts_jsonl", "checkpoints",
               "exports", "other")), "workdir_mb_end", "workdir_files_end", "iterations_run"]


def test_a_short_soak_prints_its_figures(tmp_path):
  workdir = tmp_path / "run"
  out = subprocess.run(
      [sys.executable, "-m", "bench.soak", "--iterations=4", "--warmup=1", "--size_every=1",
       "--eval_every=2", "--checkpoint_every=2", f"--workdir={workdir}"],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS=FAST_COMPILE), capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  figures = dict(re.findall(r"^(\w+)=(\S+)$", out.stdout, re.M))
  assert sorted(figures) == sorted(FIGURES), out.stdout
  assert float(figures["rss_mb_end"]) > 0 and int(figures["iterations_run"]) >= 4
  assert float(figures["workdir_bytes_per_iter_transcripts"]) > 0
  assert os.listdir(workdir / "transcripts") == ["transcripts.jsonl"]


def test_fit_slope_is_the_least_squares_line():
  assert soak.fit_slope([0, 1, 2, 3], [1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
  assert soak.fit_slope([0, 1, 2], [0.0, 2.0, 1.0]) == pytest.approx(0.5)
  assert soak.fit_slope([5, 5], [1.0, 2.0]) == 0.0  # one step: no slope


def test_memory_kb_reads_the_whole_and_its_parts():
  rss, anon, file = soak.memory_kb(os.getpid())
  assert rss > 0 and anon > 0 and file > 0
  assert anon + file <= rss + 1024  # RssShmem is the rest; the three are read at one moment
  assert soak.memory_kb(2**22 + 12345) == (0, 0, 0)  # no such process


def test_last_step_skips_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  assert soak.last_step(str(path)) == -1  # not written yet
  path.write_text('{"step": 0, "reward": 1}\n{"step": 1, "reward": 1}\n{"step": 2, "rew')
  assert soak.last_step(str(path)) == 1


def test_part_sizes_splits_the_workdir(tmp_path):
  (tmp_path / "transcripts").mkdir()
  (tmp_path / "transcripts" / "transcripts.jsonl").write_bytes(b"x" * 10)
  (tmp_path / "checkpoints" / "50").mkdir(parents=True)
  (tmp_path / "checkpoints" / "50" / "state").write_bytes(b"x" * 7)
  (tmp_path / "metrics.jsonl").write_bytes(b"x" * 3)
  (tmp_path / "config.json").write_bytes(b"x" * 2)
  sizes = soak.part_sizes(str(tmp_path))
  assert (sizes["transcripts"], sizes["checkpoints"], sizes["metrics.jsonl"], sizes["other"],
          sizes["files"]) == (10, 7, 3, 2, 4)

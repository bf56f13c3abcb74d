r"""A long run stays bounded: the trainer's resident memory and its workdir, per iteration.

  python -m bench.soak                        # 3,000 iterations of the tiny model, ~15 min
  python -m bench.soak --iterations=20000 --workdir=/tmp/soak   # the issue's hour-long soak

Runs `python -m launch.train` as a user would, on the tiny test model and the echo task
(tests/train/echo_config.py's run: 8 environments, 2 agents, 3 new tokens), with the soak's
`--config.iterations=100000 --config.eval_every=100 --config.checkpoint_every=50`, samples
the process's resident memory (VmRSS) and the workdir's bytes by part as iterations pass
(read off metrics.jsonl), and stops it with SIGTERM (it checkpoints and exits) after
`--iterations`. Prints, fitted by least squares over the iterations after `--warmup` (the
compiles, the first held-out evaluation and the first checkpoints come before):

  rss_slope_kb_per_1000_iters        resident memory's growth; flat is 0 give or take the
                                     allocator's noise (a few MB over a soak)
  rss_mb_at_warmup, rss_mb_end       the samples at either end
  workdir_bytes_per_iter             the whole workdir's growth per iteration
  workdir_bytes_per_iter_<part>      transcripts, tensorboard, metrics_jsonl, texts_jsonl,
                                     checkpoints, exports, other (config.json, the plot)
  workdir_mb_end, workdir_files_end  the workdir when the run stopped
  s_per_iter                         wall time per iteration after the warm-up

Measured (2 shared CPU cores, 15,000 iterations, warm-up 1,000): resident memory levels
off. Its slope was 3.3 MB per 1,000 iterations over iterations 1,000-5,000, 0.7 over
5,000-10,000 and 0.1 over 10,000-15,000 (medians of 1,000 iterations: 769 MB at 1,000, 783
at 5,000, 786 at 10,000, 787 at 14,000); the fit over all of it is 1.25 MB per 1,000. All of
it is anonymous memory (RssFile flat). The workdir ends at 116 MB in 67 files: its lasting
growth is the metric record itself, tensorboard 2,689 and metrics.jsonl 1,596 bytes an
iteration, one line and one event per metric per iteration (transcripts stop growing once
their rolling pair is full). What removed the growth: malloc's free pages returned at each
checkpoint (`metrics.return_freed_memory`); Orbax's TensorStore byte counts skipped
(`checkpoint.skip_orbax_byte_counts`: each save leaked ~24 Python objects). The plot's
cap of 2,000 drawn points a series (`metrics.drawn_points`) came after this soak and is not
in its figures. Over 3,000 iterations, the parts one at a time (RssAnon
medians, iterations 250 to 3,000): no held-out evaluation and no checkpoint +1.9 MB;
evaluations only +5.5 MB, one step near iteration 1,000 and flat after; checkpoints only
+10.7 MB before the Orbax fix, +9.4 MB after, flattening.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from bench.common import emit

_ITERATIONS = flags.DEFINE_integer("iterations", 3000, "iterations to watch (then SIGTERM)")
_WARMUP = flags.DEFINE_integer("warmup", 500, "iterations left out of the slopes")
_SIZE_EVERY = flags.DEFINE_integer("size_every", 100, "iterations between workdir measurements")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 100, "config.eval_every")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 50, "config.checkpoint_every")
_WORKDIR = flags.DEFINE_string("workdir", "", "the run's workdir, kept (default: a temporary "
                               "one, removed); must not hold a run")
_POLL_S = flags.DEFINE_float("poll_s", 0.25, "seconds between memory samples")
_SAMPLES = flags.DEFINE_string("samples", "", "a CSV file for the memory samples (step, RSS "
                               "KB, its anonymous and file-backed parts, seconds), to plot the curve behind the slope")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("transcripts", "tensorboard", "metrics.jsonl", "texts.jsonl", "checkpoints", "exports")

# tests/train/echo_config.py's `echo_flags("marft_a")`, spelled out: a benchmark does not import
# the tests.
ECHO = {"algorithm": "marft_a", "task.name": "echo", "task.echo_high": 1,
        "team.max_new_tokens": 3, "team.last_max_new_tokens": 3, "team.temperature": 0.7,
        "rollout.num_envs": 8, "rollout.max_context": 256, "lora.rank": 8, "lora.alpha": 16.0,
        "critic.hidden": 64, "critic.lr": 3e-3, "optimizer.lr": 5e-3, "optimizer.epochs": 2,
        "optimizer.minibatches": 2}


def command(workdir: str, model: str, eval_every: int, checkpoint_every: int) -> list[str]:
  """The soak's `launch.train` command line."""
  keys = {**ECHO, "model.source": model, "iterations": 100000, "eval_every": eval_every,
          "checkpoint_every": checkpoint_every}
  return [sys.executable, "-m", "launch.train", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in keys.items())]


def fit_slope(xs, ys) -> float:
  """The least-squares slope of ys against xs (0 with fewer than two distinct xs)."""
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  if len(np.unique(xs)) < 2:
    return 0.0
  return float(np.polyfit(xs, ys, 1)[0])


MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def memory_kb(pid: int) -> tuple[int, ...]:
  """A process's resident memory in KB, by `MEMORY_FIELDS` (Linux's /proc/<pid>/status): the
  whole, the anonymous part (heaps, arenas, mmapped buffers) and the file-backed part (shared
  libraries, mapped files). Zeros once it is gone."""
  found = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        name, _, value = line.partition(":")
        if name in MEMORY_FIELDS:
          found[name] = int(value.split()[0])
  except OSError:
    pass
  return tuple(found.get(name, 0) for name in MEMORY_FIELDS)


def last_step(metrics_path: str) -> int:
  """The step of the last whole line of metrics.jsonl (-1 before the first)."""
  try:
    with open(metrics_path, "rb") as f:
      f.seek(max(0, os.path.getsize(metrics_path) - 8192))
      lines = f.read().split(b"\n")
  except OSError:
    return -1
  for line in reversed(lines[:-1]):  # the part after the last newline may be torn
    if line.startswith(b'{"step": '):
      return int(line[9:line.index(b",")])
  return -1


def part_sizes(workdir: str) -> dict[str, int]:
  """Bytes under `workdir` by part (`PARTS`, the rest as "other"), and "files": the count."""
  sizes = dict.fromkeys((*PARTS, "other", "files"), 0)
  for folder, _, names in os.walk(workdir):
    top = os.path.relpath(folder, workdir).split(os.sep)[0]
    for name in names:
      part = top if top in PARTS else name if folder == workdir and name in PARTS else "other"
      try:
        sizes[part] += os.path.getsize(os.path.join(folder, name))
        sizes["files"] += 1
      except OSError:  # a temporary file renamed away meanwhile
        pass
  return sizes


def watch(process, workdir: str, iterations: int, size_every: int, poll_s: float):
  """Samples until the run's last step reaches `iterations` - 1: ([(step, rss KB, anon KB,
  file KB, time)], [(step, part sizes)])."""
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  memory, sizes, next_size = [], [], 0
  while process.poll() is None:
    step = last_step(metrics_path)
    if step >= 0:
      memory.append((step, *memory_kb(process.pid), time.perf_counter()))
    if step >= next_size:
      sizes.append((step, part_sizes(workdir)))
      next_size = step + size_every
    if step >= iterations - 1:
      break
    time.sleep(poll_s)
  return memory, sizes


def stop(process, timeout_s: float = 300) -> None:
  """SIGTERM (the run checkpoints and exits), then SIGKILL if it does not."""
  if process.poll() is None:
    process.send_signal(signal.SIGTERM)
  try:
    process.wait(timeout_s)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()


def report(memory, sizes, warmup: int) -> None:
  """The figures of the module docstring."""
  after = [m for m in memory if m[0] >= warmup] or memory
  steps, rss, anon, file, times = zip(*after)
  emit("rss_slope_kb_per_1000_iters", 1000 * fit_slope(steps, rss))
  emit("rss_anon_slope_kb_per_1000_iters", 1000 * fit_slope(steps, anon))
  emit("rss_file_slope_kb_per_1000_iters", 1000 * fit_slope(steps, file))
  emit("rss_mb_at_warmup", rss[0] / 1024)
  emit("rss_mb_end", rss[-1] / 1024)
  emit("s_per_iter", (times[-1] - times[0]) / max(steps[-1] - steps[0], 1))
  measured = [s for s in sizes if s[0] >= warmup] or sizes
  size_steps = [step for step, _ in measured]
  total = [sum(v for k, v in s.items() if k != "files") for _, s in measured]
  emit("workdir_bytes_per_iter", fit_slope(size_steps, total))
  for part in (*PARTS, "other"):
    emit(f"workdir_bytes_per_iter_{part.replace('.', '_')}",
         fit_slope(size_steps, [s[part] for _, s in measured]))


def main(argv):
  del argv
  with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
    from marft_jax.models import tiny  # here: jax loads only once the flags are read
    model = tiny.save_tiny_model(os.path.join(scratch, "model"))
    workdir = _WORKDIR.value or os.path.join(scratch, "run")
    log_path = os.path.join(scratch, "train.log")
    with open(log_path, "w") as log:
      process = subprocess.Popen(
          command(workdir, model, _EVAL_EVERY.value, _CHECKPOINT_EVERY.value), cwd=ROOT,
          stdout=log, stderr=subprocess.STDOUT)
      try:
        memory, sizes = watch(process, workdir, _ITERATIONS.value, _SIZE_EVERY.value,
                              _POLL_S.value)
      finally:
        stop(process)
    if not memory or process.returncode not in (0, -signal.SIGTERM):
      with open(log_path) as f:
        sys.exit(f"launch.train stopped (exit status {process.returncode}):\n"
                 + f.read()[-3000:])
    sizes.append((last_step(os.path.join(workdir, "metrics.jsonl")), part_sizes(workdir)))
    report(memory, sizes, _WARMUP.value)
    if _SAMPLES.value:
      np.savetxt(_SAMPLES.value, np.asarray(memory), fmt="%.6g", delimiter=",",
                 header="step,rss_kb,rss_anon_kb,rss_file_kb,seconds")
    end = sizes[-1][1]
    emit("workdir_mb_end", sum(v for k, v in end.items() if k != "files") / 2**20)
    emit("workdir_files_end", end["files"])
    emit("iterations_run", memory[-1][0] + 1)


if __name__ == "__main__":
  app.run(main)

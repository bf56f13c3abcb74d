"""MetricWriter (TensorBoard + JSONL, resume without duplicates) and the learning-curve plots."""

import json
import math
import os
import platform
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboardX.proto import event_pb2

from marft_jax.train import metrics
from marft_jax.train.metrics import MetricWriter, plot_learning_curves, plot_runs, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_events(folder):
  """Every event in a TensorBoard folder (TFRecord: u64 length, u32 crc, data, u32 crc)."""
  events = []
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + length]))
      pos += 12 + length + 4
  return events


def scalars(folder):
  return [(e.step, v.tag, v.simple_value) for e in read_events(folder) for v in e.summary.value]


def test_write_goes_to_jsonl_and_tensorboard(tmp_path):
  with MetricWriter(tmp_path) as writer:
    writer.write(0, {"reward": 0.25, "loss": np.float32(1.5), "kl": jnp.asarray(0.125)})
    writer.write(1, {"reward": float("nan"), "loss": math.inf, "kl": 0.0})
    writer.write_text(1, "samples/agent_0", "2 + 2 = 4")
    # Flushed on every write: a reader sees the lines before close.
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"step": 0, "reward": 0.25, "loss": 1.5, "kl": 0.125},
      {"step": 1, "reward": None, "loss": None, "kl": 0.0}]
  assert "NaN" not in lines[1]  # strict JSON
  assert (0, "reward", 0.25) in scalars(tmp_path / "tensorboard")
  nan_reward = [v for s, tag, v in scalars(tmp_path / "tensorboard") if (s, tag) == (1, "reward")]
  assert len(nan_reward) == 1 and math.isnan(nan_reward[0])
  texts = read_metrics(tmp_path / "texts.jsonl")
  assert texts == [{"step": 1, "tag": "samples/agent_0", "text": "2 + 2 = 4"}]


def test_non_number_names_the_key(tmp_path):
  with MetricWriter(tmp_path) as writer:
    with pytest.raises(TypeError, match="metric 'name' at step 3 is not a number"):
      writer.write(3, {"reward": 1.0, "name": "abc"})
    with pytest.raises(ValueError, match="'step' at step 3 is reserved"):
      writer.write(3, {"step": 1.0})


def test_resume_drops_lines_at_and_after_the_resumed_step(tmp_path):
  with MetricWriter(tmp_path) as writer:
    for step in range(6):
      writer.write(step, {"reward": step / 10})
      writer.write_text(step, "t", f"text {step}")
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "rew')  # torn line of a killed run
  with MetricWriter(tmp_path, resume_step=3) as writer:
    assert [r["step"] for r in read_metrics(writer.metrics_path)] == [0, 1, 2]
    writer.write(3, {"reward": 0.9})
    writer.write(4, {"reward": 1.0})
  records = read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
  assert records[3]["reward"] == 0.9
  assert [r["step"] for r in read_metrics(tmp_path / "texts.jsonl")] == [0, 1, 2]
  events = read_events(tmp_path / "tensorboard")
  assert any(e.step == 3 and e.session_log.status == event_pb2.SessionLog.START for e in events)
  assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_truncate_after_on_an_open_writer_keeps_writing_to_the_file(tmp_path):
  with MetricWriter(tmp_path) as writer:
    for step in range(4):
      writer.write(step, {"reward": 1.0})
    writer.truncate_after(2)
    writer.write(2, {"reward": 2.0})
  assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
      (0, 1.0), (1, 1.0), (2, 2.0)]


def test_disabled_writer_writes_nothing(tmp_path):
  with MetricWriter(tmp_path / "w", enabled=False) as writer:
    writer.write(0, {"reward": 1.0})
    writer.write_text(0, "t", "x")
    writer.truncate_after(0)
  assert not (tmp_path / "w").exists()


def test_smooth_is_tensorboards_debiased_ema():
  np.testing.assert_allclose(metrics.smooth([1.0, 3.0], 0.5), [1.0, (0.25 + 1.5) / 0.75])
  np.testing.assert_allclose(metrics.smooth([1.0, 3.0, 2.0], 0.0), [1.0, 3.0, 2.0])


def test_learning_curves_png(tmp_path):
  with MetricWriter(tmp_path) as writer:
    for step in range(20):
      writer.write(step, {"reward": step / 20 + 0.1 * np.sin(step), "loss": 1.0 / (step + 1)})
  png = tmp_path / "plots" / "curves.png"
  plot_learning_curves(tmp_path / "metrics.jsonl", png, keys=("reward", "loss", "absent"),
                       title="toy run")
  assert png.read_bytes().startswith(PNG_MAGIC)
  first = png.stat().st_size
  plot_learning_curves(tmp_path / "metrics.jsonl", png)  # refreshed in place
  assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size != first
  assert os.listdir(png.parent) == ["curves.png"]


def test_unsmoothed_keys_draw_their_raw_values(tmp_path, monkeypatch):
  """A sparse series (three held-out evaluations) is drawn through its points: smoothed, the
  line would end at 0.25 instead of its last value 0.3."""
  from marft_jax.train import metrics as metrics_lib
  with MetricWriter(tmp_path) as writer:
    for step in range(17):
      writer.write(step, {"reward": 0.1, **({"heldout": 0.1 + step / 80} if step % 8 == 0
                                             else {})})
  lines = []
  plot = metrics_lib._plot_series
  def record(ax, steps, values, smoothing, label):
    lines.append(metrics.smooth(values, smoothing))
    plot(ax, steps, values, smoothing, label)
  monkeypatch.setattr(metrics_lib, "_plot_series", record)
  plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "c.png",
                       keys=("reward", "heldout"), unsmoothed=("heldout",))
  np.testing.assert_allclose(lines[1], [0.1, 0.2, 0.3])
  assert metrics.smooth([0.1, 0.2, 0.3], 0.6)[-1] < 0.26  # what the smoothed line would have shown


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 20000), most=st.integers(2, 3000))
def test_a_plot_draws_at_most_its_points_and_both_ends(n, most):
  shown = metrics.drawn_points(n, most)
  assert len(shown) == min(n, most) or (n > most and most - 1 <= len(shown) <= most)
  assert list(shown) == sorted(set(shown.tolist())) and all(0 <= i < n for i in shown)
  if n:
    assert shown[0] == 0 and shown[-1] == n - 1
  if n > most:  # evenly spread: no gap wider than two strides
    assert np.diff(shown).max() <= 2 * (n - 1) / (most - 1) + 1


def test_a_long_run_is_plotted_thinned_with_its_smoothed_end(tmp_path, monkeypatch):
  """5,000 iterations draw 2,000 points, the last iteration's among them, and the line's end
  is the smoothing over all 5,000 (not over the drawn ones)."""
  from matplotlib.axes import Axes
  drawn = []
  real = Axes.plot
  def plot(ax, x, y, *args, **kwargs):
    drawn.append((np.asarray(x), np.asarray(y)))
    return real(ax, x, y, *args, **kwargs)
  monkeypatch.setattr(Axes, "plot", plot)
  rng = np.random.default_rng(0)
  rewards = rng.random(5000)
  with MetricWriter(tmp_path) as writer:
    for step, r in enumerate(rewards):
      writer.write(step, {"reward": float(r)})
  plot_learning_curves(tmp_path / "metrics.jsonl", tmp_path / "c.png")
  (x, y), = drawn
  assert len(x) == metrics.MAX_DRAWN_POINTS and x[0] == 0 and x[-1] == 4999
  np.testing.assert_allclose(y[-1], metrics.smooth(rewards, 0.6)[-1], rtol=1e-12)
  np.testing.assert_allclose(y, metrics.smooth(rewards, 0.6)[x.astype(int)], rtol=1e-12)


def test_plot_runs_compares_several_files(tmp_path):
  runs = {}
  for label, slope in (("marft-a", 0.05), ("grpo", 0.03)):
    with MetricWriter(tmp_path / label) as writer:
      for step in range(10):
        writer.write(step, {"reward": slope * step})
    runs[label] = tmp_path / label / "metrics.jsonl"
  plot_runs(runs, tmp_path / "compare.png", key="reward")
  assert (tmp_path / "compare.png").read_bytes().startswith(PNG_MAGIC)


def test_a_plot_holds_its_series_not_every_record(tmp_path):
  """The trainer plots at every checkpoint: a run 10 times as long costs the plot's peak
  Python memory little more (its points), not every record of the file as a dict (~6 KB an
  iteration of 50 metrics: +20 MB here, which the process kept as resident memory)."""
  import tracemalloc
  record = {f"metric/{i}": 0.5 + i for i in range(50)}
  peaks = []
  for steps in (10, 400, 4000):  # the first warms matplotlib's caches up
    path = tmp_path / f"{steps}.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / steps, **record}) + "\n"
                            for s in range(steps)))
    tracemalloc.start()
    plot_learning_curves(path, tmp_path / "c.png", keys=("reward", "metric/3"))
    peaks.append(tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
  assert peaks[2] - peaks[1] < 2e6, peaks


def test_failed_plot_keeps_the_previous_png(tmp_path, monkeypatch):
  (tmp_path / "m.jsonl").write_text('{"step": 0, "reward": 1.0}\n')
  png = tmp_path / "curves.png"
  plot_learning_curves(tmp_path / "m.jsonl", png)
  before = png.read_bytes()

  def broken_savefig(*args, **kwargs):
    raise RuntimeError("renderer failed")

  monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken_savefig)
  with pytest.raises(RuntimeError, match="renderer failed"):
    plot_learning_curves(tmp_path / "m.jsonl", png)
  assert png.read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ["curves.png", "m.jsonl"]


def test_the_writer_loads_tensorboardx_without_torch_and_leaves_torch_importable(tmp_path):
  """A launch script's start: tensorboardX's writer module imports torch when it can, to
  accept torch tensors this writer never passes (2-3 s)."""
  code = ("import sys\n"
          "from marft_jax.train.metrics import MetricWriter\n"
          f"writer = MetricWriter({str(tmp_path)!r})\n"
          "writer.write(0, {'reward': 0.5})\n"
          "writer.close()\n"
          "print('torch' in sys.modules)\n"
          "import torch\n"
          "print(torch.ones(2).sum().item())\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.split() == ["False", "2.0"]
  assert (0, "reward", 0.5) in scalars(tmp_path / "tensorboard")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_return_freed_memory_lowers_resident_memory_by_the_heaps_free_pages(tmp_path):
  """100 MB freed between live blocks (what a checkpoint, an evaluation or a plot leaves in
  the trainer) stays resident: free() shrinks a heap only at its top. The kernel's VmRSS
  drops by most of it after `return_freed_memory` (in a fresh process: a heap of its own)."""
  code = ("from marft_jax.train import metrics\n"
          "def rss_kb():\n"
          "  with open('/proc/self/status') as f:\n"
          "    return next(int(l.split()[1]) for l in f if l.startswith('VmRSS:'))\n"
          "blocks = [bytearray(4096) for _ in range(25_600)]\n"  # through malloc, not pymalloc
          "kept = blocks[::64]\n"  # a live block after every 63 freed ones
          "del blocks\n"
          "before = rss_kb()\n"
          "metrics.return_freed_memory()\n"
          "print(before, rss_kb())\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
  assert out.returncode == 0, out.stderr
  before, after = map(int, out.stdout.split())
  freed_kb = 25_600 * 63 // 64 * 4
  assert before - after > 0.7 * freed_kb, (before, after)


def test_a_saved_plot_returns_the_freed_memory(tmp_path, monkeypatch):
  """The trainer plots at every checkpoint: each plot trims the heap once, after its figure
  is freed."""
  calls = []
  monkeypatch.setattr(metrics, "return_freed_memory", lambda: calls.append(1))
  (tmp_path / "m.jsonl").write_text('{"step": 0, "reward": 1.0}\n')
  plot_learning_curves(tmp_path / "m.jsonl", tmp_path / "c.png")
  plot_runs({"a": tmp_path / "m.jsonl"}, tmp_path / "r.png")
  assert len(calls) == 2

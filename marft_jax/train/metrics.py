"""Per-iteration metrics: TensorBoard event files, a `metrics.jsonl`, and learning-curve PNGs.

The JSONL file is the record tests and scripts read (one object per iteration, `{"step": N,
...}`); TensorBoard is for looking. Both are written by `MetricWriter`, the shape of clu's
writers (clu's own need TensorFlow). A resumed run first drops what the interrupted run wrote
at or after the resumed step, so each step appears once in the JSONL file and in TensorBoard
(`purge_step`).

Plots use matplotlib's Agg canvas directly (no pyplot: no GUI backend, no global figure state)
and replace the PNG atomically, so a viewer never sees half an image.
"""

from __future__ import annotations

import array
import ctypes
import functools
import json
import math
import os
import sys
import uuid
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from marft_jax.jsonl import iter_records
from marft_jax.train.write_failures import writing

StrPath = Union[str, "os.PathLike[str]"]
METRICS_FILE = "metrics.jsonl"
TEXTS_FILE = "texts.jsonl"


class MetricWriter:
  """Writes scalars to `workdir/tensorboard` and `workdir/metrics.jsonl`, texts to
  TensorBoard and `workdir/texts.jsonl`.

  Args:
    workdir: the run's folder.
    enabled: False makes every method a no-op (processes other than 0 of a multi-host run).
    resume_step: the first step a resumed run will write: lines at or after it are dropped
      from the JSONL files and hidden in TensorBoard, so nothing appears twice.
  """

  def __init__(self, workdir: StrPath, enabled: bool = True, resume_step: Optional[int] = None):
    self.enabled = enabled
    self.workdir = os.fspath(workdir)
    self.metrics_path = os.path.join(self.workdir, METRICS_FILE)
    self.texts_path = os.path.join(self.workdir, TEXTS_FILE)
    self._tb = self._jsonl = self._texts = None
    if not enabled:
      return
    with writing(self.workdir, "its metrics (metrics.jsonl, texts.jsonl, tensorboard/)"):
      os.makedirs(self.workdir, exist_ok=True)
      if resume_step is not None:
        self.truncate_after(resume_step)
      SummaryWriter = _summary_writer_class()  # here: disabled writers never need it
      # Event files are named by the second they open in and opened with "wb": the suffix
      # keeps a writer opened in the same second (a quick restart) from truncating the
      # previous file.
      self._tb = SummaryWriter(os.path.join(self.workdir, "tensorboard"),
                               purge_step=resume_step,
                               filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:6]}")
      self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
      self._texts = open(self.texts_path, "a", encoding="utf-8")

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes `scalars` (numbers: Python, NumPy or 0-d JAX) for `step`, then flushes.

    A NaN or inf goes to TensorBoard as is and to the JSONL file as null (JSON has no NaN).
    Raises TypeError naming the key of a value that is not a number, ValueError for a key
    "step" (the JSONL record's own).
    """
    if not self.enabled:
      return
    if "step" in scalars:
      raise ValueError(f"metric key 'step' at step {step} is reserved for the step number")
    values = {key: _to_float(key, value, step) for key, value in scalars.items()}
    for key, value in values.items():
      self._tb.add_scalar(key, value, global_step=step)
    record = {"step": int(step)}
    record.update({k: v if math.isfinite(v) else None for k, v in values.items()})
    with writing(self.workdir, f"the metrics of step {step} (metrics.jsonl, tensorboard/)"):
      self._jsonl.write(json.dumps(record) + "\n")
      self._jsonl.flush()
      self._tb.flush()

  def write_text(self, step: int, tag: str, text: str) -> None:
    """Writes a text (a transcript, a sample table in Markdown) under `tag` for `step`."""
    if not self.enabled:
      return
    with writing(self.workdir, f"the text {tag!r} of step {step} (texts.jsonl, tensorboard/)"):
      self._tb.add_text(tag, text, global_step=step)
      self._texts.write(json.dumps({"step": int(step), "tag": tag, "text": text}) + "\n")
      self._texts.flush()
      self._tb.flush()

  def truncate_after(self, step: int) -> None:
    """Drops the JSONL lines with a step >= `step` (and a torn last line), atomically."""
    if not self.enabled:
      return
    reopen = self._jsonl is not None  # The rename replaces the file under an open handle.
    if reopen:
      self._jsonl.close()
      self._texts.close()
    for path in (self.metrics_path, self.texts_path):
      if os.path.exists(path):
        kept = (json.dumps(r) + "\n" for r in iter_metrics(path) if r.get("step", -1) < step)
        with writing(self.workdir, f"{os.path.basename(path)}, cut back to the steps before "
                     f"{step}"):
          write_atomically(path, lambda f, kept=kept: f.writelines(kept), mode="w")
    if reopen:
      self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
      self._texts = open(self.texts_path, "a", encoding="utf-8")

  def flush(self) -> None:
    if self.enabled:
      with writing(self.workdir, "its metrics (metrics.jsonl, texts.jsonl, tensorboard/)"):
        self._jsonl.flush()
        self._texts.flush()
        self._tb.flush()

  def close(self) -> None:
    if self.enabled and self._tb is not None:
      tb, self._tb = self._tb, None
      with writing(self.workdir, "its metrics (metrics.jsonl, texts.jsonl, tensorboard/)"):
        self._jsonl.close()
        self._texts.close()
        tb.close()

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def read_metrics(jsonl_path: StrPath) -> list[dict]:
  """The records of a metrics JSONL file, in order; unreadable lines (a torn last line from
  a killed run) are skipped."""
  return list(iter_metrics(jsonl_path))


def iter_metrics(jsonl_path: StrPath):
  """`read_metrics`'s records one at a time: what the trainer reads (a long run's file, held
  whole as dicts, is ~6 KB an iteration, a peak the allocator keeps)."""
  return iter_records(jsonl_path)


def _summary_writer_class():
  """tensorboardX's `SummaryWriter`, imported without torch where torch is not loaded yet.

  tensorboardX's writer module imports torch when it is installed, only to accept torch
  tensors, which this writer never passes (it writes floats): 2-3 s of every launch script's
  start. `sys.modules["torch"] = None` makes that one import fail as if torch were absent
  (tensorboardX's own fallback); the entry is removed afterwards, so torch stays importable.
  """
  if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
    sys.modules["torch"] = None
    try:
      from tensorboardX import SummaryWriter
    finally:
      del sys.modules["torch"]
  from tensorboardX import SummaryWriter
  return SummaryWriter


def plot_learning_curves(jsonl_path: StrPath, png_path: StrPath,
                         keys: Sequence[str] = ("reward",), title: Optional[str] = None,
                         smoothing: float = 0.6, unsmoothed: Sequence[str] = ()) -> None:
  """One panel per key against step: raw points and an exponentially smoothed line.

  A key with no finite value yet gets an empty panel saying so (the trainer refreshes the
  plot from the first checkpoint on). `smoothing` is TensorBoard's: 0 draws the raw values,
  as for the keys in `unsmoothed` (sparse series, e.g. a few held-out evaluations, where an
  average over points far apart would hide the last one).
  """
  series = _read_series(jsonl_path, keys)
  fig, axes = _figure(len(keys), titled=bool(title))
  for ax, key in zip(axes, keys):
    _plot_series(ax, *series[key], 0.0 if key in unsmoothed else smoothing, label=None)
    ax.set_ylabel(key)
  axes[-1].set_xlabel("step")
  if title:
    fig.suptitle(title)
  _save_figure(fig, png_path)


def plot_runs(runs: Mapping[str, StrPath], png_path: StrPath, key: str = "reward",
              title: Optional[str] = None, smoothing: float = 0.6) -> None:
  """Compares runs: `key` against step for each `{label: jsonl_path}`, in one panel."""
  fig, (ax,) = _figure(1, titled=True)
  for label, path in runs.items():
    _plot_series(ax, *_read_series(path, (key,))[key], smoothing, label=label)
  ax.set_xlabel("step")
  ax.set_ylabel(key)
  if runs:
    ax.legend(loc="best")
  ax.set_title(title or key)
  _save_figure(fig, png_path)


def smooth(values: Sequence[float], weight: float) -> np.ndarray:
  """TensorBoard's debiased exponential moving average: s_t = w·s_{t-1} + (1-w)·x_t, divided
  by 1 - w^t so the first points are not pulled towards 0."""
  out, last = np.empty(len(values)), 0.0
  for t, x in enumerate(values):
    last = weight * last + (1.0 - weight) * x
    out[t] = last / (1.0 - weight ** (t + 1)) if weight < 1.0 else x
  return out


def _to_float(key: str, value: Any, step: int) -> float:
  try:
    return float(np.asarray(value).item())
  except (TypeError, ValueError) as e:
    raise TypeError(f"metric {key!r} at step {step} is not a number: {value!r} ({e})") from None


def _plottable(record: Mapping[str, Any], key: str) -> bool:
  value = record.get(key)
  return isinstance(value, (int, float)) and math.isfinite(value) and "step" in record


def _read_series(jsonl_path: StrPath, keys: Sequence[str]) -> dict:
  """{key: (steps, values)} of a metrics JSONL file, read a record at a time. The trainer
  plots at every checkpoint: reading every record of a long run at once (`read_metrics`, ~6
  KB an iteration as dicts) raised its resident memory by ~5 KB an iteration, for good (the
  allocator kept the freed peak; bench/soak.py)."""
  steps = {key: array.array("d") for key in keys}  # 8 bytes a point, not a tuple's ~100
  values = {key: array.array("d") for key in keys}
  for record in iter_metrics(jsonl_path):
    for key in keys:
      if _plottable(record, key):
        steps[key].append(record["step"])
        values[key].append(record[key])
  return {key: (np.asarray(steps[key], float), np.asarray(values[key], float))
          for key in keys}


def _figure(panels: int, titled: bool):
  """A 7-inch-wide figure of `panels` stacked axes sharing x, room for a title if `titled`.

  Margins are fixed in inches: a layout engine ("constrained") measured every tick label
  again to fit them, 0.2-0.3 s of a 0.5-0.7 s plot, and the trainer plots at every
  checkpoint."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  height = 2.6 * panels + 0.6
  fig = Figure(figsize=(7, height))
  FigureCanvasAgg(fig)
  fig.subplots_adjust(left=0.9 / 7, right=1 - 0.15 / 7, bottom=0.5 / height,
                      top=1 - (0.45 if titled else 0.15) / height, hspace=0.1)
  axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
  return fig, list(axes)


MAX_DRAWN_POINTS = 2000


def drawn_points(n: int, most: int = MAX_DRAWN_POINTS) -> np.ndarray:
  """The indices of a series of n points that a plot draws: all of them up to `most`, else
  `most` evenly spaced ones, the first and the last among them. The trainer plots at every
  checkpoint, so a 100,000-iteration run would otherwise draw (and hold, while it draws)
  every iteration's point each time; at 7 inches wide, 2,000 points are denser than the
  pixels. The smoothed line is computed over every point before it is thinned."""
  if n <= most:
    return np.arange(n)
  return np.unique(np.linspace(0, n - 1, most).round().astype(np.int64))


def _plot_series(ax, steps: np.ndarray, values: np.ndarray, smoothing: float,
                 label: Optional[str]) -> None:
  if not len(steps):
    ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
    return
  order = np.argsort(steps, kind="stable")
  steps, values = steps[order], values[order]
  shown = drawn_points(len(steps))
  line, = ax.plot(steps[shown], smooth(values, smoothing)[shown], label=label)
  ax.scatter(steps[shown], values[shown], s=6, alpha=0.35, color=line.get_color())
  ax.grid(alpha=0.3)


def _save_figure(fig, png_path: StrPath) -> None:
  try:
    write_atomically(os.fspath(png_path), lambda f: fig.savefig(f, format="png", dpi=100),
                     mode="wb")
  finally:
    _release(fig)


def _release(fig) -> None:
  """Frees a saved figure's artists and its canvas's pixel buffer now, and returns the freed
  memory to the OS (`return_freed_memory`). A figure and its canvas refer to each other, so
  only a full garbage collection frees them, and in the trainer (JAX holds many long-lived
  objects) those are rare: each checkpoint's plot kept ~8 MB of resident memory until one
  ran (bench/soak.py), ~1 MB once released here."""
  fig.clear()
  fig.canvas.renderer = None
  return_freed_memory()


def return_freed_memory() -> None:
  """Hands the pages that glibc's malloc holds free back to the OS (`malloc_trim(0)`); a
  no-op without glibc.

  malloc returns freed memory to the OS only from the top of a heap, so the holes that a
  checkpoint, an evaluation or a plot leaves between live blocks stay resident. The trainer
  plots at every checkpoint, so this runs there: in bench/soak.py's tiny-model run,
  iterations 300-1,000 in one process, resident memory grew ~14 MB per 1,000 iterations
  without it (malloc's heaps grew ~30 MB, the blocks in use ~315 MB throughout, no
  recompile) and stayed flat with it; the 15,000-iteration soak levels off (see
  bench/soak.py). A trim costs milliseconds (18 ms returning 100 MB).
  """
  trim = _malloc_trim()
  if trim is not None:
    trim(0)


@functools.cache
def _malloc_trim():
  """glibc's `malloc_trim`, or None (another libc, another OS)."""
  try:
    trim = ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):
    return None
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return trim


def write_atomically(path: str, write, mode: str) -> None:
  """Writes through `write(file)` into a sibling temporary file, then renames it over `path`."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  temp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
  try:
    with open(temp, mode) as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)
  except BaseException:
    if os.path.exists(temp):
      os.remove(temp)
    raise

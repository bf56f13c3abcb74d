"""Where bit-for-bit holds, and how close two runs are where it does not.

XLA:CPU compiles for the host it runs on: the instruction set (vector width, FMA), the CPU
model's tuning and the compiler flags decide how f32 sums are split and rounded. The same code
on another CPU gives other f32 roundings, so a digest pinned on one host fails on another
(`XLA_FLAGS=--xla_cpu_max_isa=SSE4_2` shows it on a single machine). Bit-for-bit is therefore a
property of one *codegen*: the same CPU (vendor, family, model), the same effective
instruction set, the same jax/jaxlib, the same XLA flags and device count. `codegen()` records
that; a stored result is compared bit for bit only where it matches (`same_codegen`), and
within a measured tolerance (`assert_states_close`) everywhere else.

The tolerance is measured, not guessed: tests/fixtures/old_checkpoints/spread.py trains the
fixtures' runs and fresh seeds under several instruction sets and prints the largest
differences; the constants below quote what it printed, and test_old_checkpoints checks that
a semantic change (a key flipped, one minibatch's shuffle changed) exceeds them by far.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

import numpy as np

# Every instruction set XLA:CPU's --xla_cpu_max_isa names, narrowest first, with the
# /proc/cpuinfo flag that says a CPU has it.
ISAS = (("SSE4_2", "sse4_2"), ("AVX", "avx"), ("AVX2", "avx2"), ("AVX512", "avx512f"),
        ("AVX512_VNNI", "avx512_vnni"), ("AVX512_BF16", "avx512_bf16"), ("AMX", "amx_tile"),
        ("AMX_FP16", "amx_fp16"))


def _cpuinfo() -> dict:
  """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read().split("\n\n")[0]
  except OSError:
    return {}
  return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in
                                                text.splitlines()) if k.strip()}


def host_isa(xla_flags: str | None = None) -> str:
  """The widest instruction set XLA:CPU compiles for here: the CPU's best, capped by
  `--xla_cpu_max_isa` in `xla_flags` (default: the XLA_FLAGS environment variable)."""
  flags = set(_cpuinfo().get("flags", "").split())
  names = [name for name, flag in ISAS]
  best = max((i for i, (_, flag) in enumerate(ISAS) if flag in flags), default=None)
  if best is None:  # not x86, or no /proc/cpuinfo: the machine's name stands for its ISA
    return os.uname().machine
  cap = re.search(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", "")
                  if xla_flags is None else xla_flags)
  if cap and cap.group(1).upper() in names:
    best = min(best, names.index(cap.group(1).upper()))
  return names[best]


def codegen(device_count: int | None = None) -> dict:
  """What decides XLA:CPU's f32 roundings in this process: two runs whose records are equal
  round alike, bit for bit; elsewhere results agree to f32 rounding only."""
  info = _cpuinfo()
  flags = os.environ.get("XLA_FLAGS", "")
  codegen_flags = sorted(f for f in flags.split()
                         if not f.startswith("--xla_force_host_platform_device_count"))
  if device_count is None:
    import jax  # noqa: PLC0415 (the record is read in processes that set XLA_FLAGS first)
    device_count = jax.device_count()
  return {"cpu": " ".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model")),
          "isa": host_isa(flags), "cores": os.cpu_count(),
          "jaxlib": importlib.metadata.version("jaxlib"), "xla_flags": codegen_flags,
          "devices": device_count}


def same_codegen(recorded: dict | None) -> bool:
  """Whether a result recorded under `recorded` (a `codegen()` record; None: recorded before
  records were kept) is this process's to compare bit for bit."""
  return recorded is not None and recorded == codegen()


# --- tolerances ----------------------------------------------------------------------------

# The trained state (policy, critic, Adam's moments), per leaf as ‖actual − expected‖ /
# ‖expected‖, after one update of the tiny model resumed from an old checkpoint, in f32.
# Measured by spread.py (the 5 f32 fixtures and 4 fresh seeds, each under SSE4_2 and AVX2
# against an Intel Xeon's widest set, AMX): at most 3.8e-5 in the policy, 6.9e-6 in the
# critic, 1.2e-4 in Adam's first moment and 4.3e-5 in its second. The same old code on two
# CPU types (the host that first wrote the fixtures, and that Xeon): 6.3e-5 in the policy.
# A semantic change moves a trained leaf by 0.18 (two rows traded between the first two
# minibatches) to 0.37 (advantage.normalize flipped): test_old_checkpoints asserts at least
# 100 times STATE_RTOL.
STATE_RTOL = 1e-3
# Float metrics: |actual − expected| <= METRIC_RTOL·|expected| + METRIC_ATOL. Measured: the
# policy loss (a sum that cancels) at most 1.2e-4 relative across the two CPUs and 8.6e-5
# across instruction sets, gradient norms 9e-6.
METRIC_RTOL = 1e-3
METRIC_ATOL = 1e-6
# Metrics that measure rounding itself (the sampler's log-probs against the learner's, the
# first PPO ratio's distance from 1): ~5e-6 in f32 on every CPU, so no ratio between two
# hosts means anything; both must stay below ROUNDING_METRIC_MAX.
ROUNDING_METRICS = ("logp/sampler_learner_max_gap", "behaviour/logp_gap_max",
                    "behaviour/logp_gap_mean", "behaviour/first_ratio_max_dev",
                    "first_ratio_max_dev")
ROUNDING_METRIC_MAX = 1e-4


def leaf_errors(actual: dict, expected: dict) -> dict:
  """{leaf: ‖actual − expected‖ / ‖expected‖} over two {path: array} trees with the same
  paths, shapes and dtypes (integer leaves: 0 where equal, inf where not).

  A norm, not the largest element: Adam turns a gradient element that is zero to rounding
  into a step of ±lr whose sign is the rounding's, so single elements of a leaf that took one
  or two steps differ by up to 1e-3 of the leaf's largest value across instruction sets,
  while the leaf as a whole moves by 1e-5 of its norm."""
  assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
  errors = {}
  for key in sorted(expected):
    a, e = np.asarray(actual[key]), np.asarray(expected[key])
    assert (a.shape, a.dtype) == (e.shape, e.dtype), (key, a.shape, a.dtype, e.shape, e.dtype)
    if not np.issubdtype(e.dtype, np.floating):
      errors[key] = 0.0 if np.array_equal(a, e) else np.inf
      continue
    diff = np.linalg.norm((a.astype(np.float64) - e.astype(np.float64)).ravel())
    norm = np.linalg.norm(e.astype(np.float64).ravel())
    errors[key] = 0.0 if diff == 0 else (diff / norm if norm > 0 else np.inf)
  return errors


def assert_states_close(actual: dict, expected: dict, rtol: float = STATE_RTOL) -> None:
  """Every leaf within `rtol` of its largest magnitude; names the worst leaves."""
  errors = leaf_errors(actual, expected)
  bad = {k: v for k, v in errors.items() if not v <= rtol}
  assert not bad, f"{len(bad)} leaves beyond {rtol:g}: " + ", ".join(
      f"{k} {v:.3g}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1])[:8])


def metric_errors(actual: dict, expected: dict) -> dict:
  """{metric: |actual − expected| / (METRIC_RTOL·|expected| + METRIC_ATOL)}, so a value
  above 1 is out of tolerance; a rounding metric is max(actual, expected) /
  ROUNDING_METRIC_MAX; a non-float metric (a count, an accuracy over 4 episodes) is 0 where
  equal, inf where not."""
  errors = {}
  for key in sorted(expected):
    a, e = actual.get(key), expected[key]
    number = isinstance(a, (int, float)) and not isinstance(a, bool)
    if key in ROUNDING_METRICS and number and isinstance(e, (int, float)):
      errors[key] = max(abs(a), abs(e)) / ROUNDING_METRIC_MAX
    elif isinstance(e, float) and number:
      same = e == a or (np.isnan(e) and np.isnan(a))
      errors[key] = 0.0 if same else abs(a - e) / (METRIC_RTOL * abs(e) + METRIC_ATOL)
    else:
      errors[key] = 0.0 if a == e else np.inf
  return errors


def assert_metrics_close(actual: dict, expected: dict) -> None:
  errors = metric_errors(actual, expected)
  bad = {k: (actual.get(k), expected[k]) for k, v in errors.items() if not v <= 1}
  assert not bad, f"metrics out of tolerance (actual, expected): {bad}"

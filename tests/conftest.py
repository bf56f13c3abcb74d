"""Test-wide JAX settings: f32 on CPU, and no silent rank promotion."""

import gc
import os
import shutil
import tempfile

from tests.compile_flags import FAST_COMPILE

# Set before JAX starts (an XLA_FLAGS of your own replaces these):
#  * sharding tests need several devices;
#  * the suite compiles hundreds of programs on tiny shapes and computes little, so compiling
#    is most of its time. Skipping LLVM's optimisation of the generated machine code and using
#    XLA:CPU's older per-fusion emitters makes compiles about 2.7 times as fast (the tiny
#    sampler 4.0 -> 1.5 s) and four test files 2.5 times as fast overall (412 -> 162 s, 2 cores).
#    XLA's HLO passes (fusion, layout, scheduling) still run and fast-math stays off: the
#    results differ from the default compiler's by float rounding (the tiny model's logits
#    and gradients by ~1e-6 of their scale, the same sampled tokens). What users run (the
#    launch scripts, the benchmarks) keeps the default compiler, and CI's first stage runs the
#    README's training job that way.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")

# One persistent compilation cache for the whole session, fresh each run and removed at its end:
# the xdist workers, the per-file cache clearing below and the subprocess tests (launch
# scripts, benchmarks, multihost workers) would otherwise compile the same tiny-model programs
# again and again (five subprocess-heavy files: 363 -> 305 s, measured from a cold cache, as
# CI starts). JAX keys each entry on the program, the compile options and XLA_FLAGS, and a hit
# is still reported as a compilation (`compile_stats`), so what the tests count is unchanged.
# A retraced function hits only because its program is the same on every trace: checkify's
# per-trace check numbers made each trace differ until traced checks became opt-in
# (`validation.traced_checks`).
# The controller process imports this file before it starts the workers, which inherit it.
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _SESSION_CACHE = tempfile.mkdtemp(prefix="marft_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny programs

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# The tests' f32 tolerances assume exact f32 matmuls; JAX's default on an NVIDIA GPU is TF32,
# which put the f32 attention kernels 1.1e-3 from textbook attention on an H200 (the tests ask
# 1e-5; docs/scaling.md, "What was measured on a GPU"). What users run keeps JAX's default.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")


# Memory mappings a worker may hold before the compiled programs are dropped: the most one
# file was seen to add is about 7,500.
_MAPPINGS_BEFORE_CLEARING = 20_000


def _memory_mappings() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: clear after every file
    return _MAPPINGS_BEFORE_CLEARING + 1


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop the compiled programs when a test file ends with many of them held. An xdist worker
  runs half the suite in one process, and every XLA:CPU executable holds its own memory
  mappings: kept, they reached the kernel's limit (vm.max_map_count, 65530) and XLA
  segfaulted in a compile. Kept while there are few, the next files reuse them (the
  sampler's, the models') instead of tracing them again."""
  yield
  if _memory_mappings() < _MAPPINGS_BEFORE_CLEARING:
    return
  from marft_jax.compile_stats import clear_compiled  # noqa: PLC0415 (after the XLA flags)
  clear_compiled()
  gc.collect()


def pytest_unconfigure(config):
  if _SESSION_CACHE is not None and not hasattr(config, "workerinput"):  # the controller's
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "exactness: compares results bit for bit or to a measured rounding spread; "
      "CI runs these a second time under another instruction set (MARFT_TEST_MAX_ISA)")
  config.addinivalue_line(
      "markers", "slow: a reference check on the real SmolLM2-135M model (seconds to load); "
      "few, and still run in CI")
  config.addinivalue_line(
      "markers", "xla_cpu_numbers: asserts numbers recorded, or rounding bounds measured, on "
      "XLA:CPU (digests of trained state, bf16 gaps); skipped on other backends")


# Files that must run in one xdist worker: the code sandbox's tests assert that no sandboxed
# process of theirs is left alive, which they recognise by its command line, so one file's
# live sandboxes must never run beside the other's checks.
_SAME_WORKER = {"tests/envs/test_code_env.py": "tests/envs/test_sandbox.py"}


# The files that take over 25 s of a worker's time (test_trainer alone five minutes), slowest
# first (as measured on a 2-core host), then the others in collection order. xdist's own order
# (most tests first) started big files late, and in collection order tests/train/ came last:
# either way one worker ran a big file alone for minutes while the other had nothing left.
# Slowest first, the run ends with small files that both workers share: both workers stay
# busy to the end (two runs: 832 and 840 s, 908 and 909 s). A renamed file must be renamed
# here too (test_suite_order.py checks that each exists).
_SLOW_FILES_FIRST = (
    "tests/train/test_trainer.py", "tests/train/test_config_keys.py",  # its key cover: 2+ min
    "tests/test_combinations.py", "tests/models/test_layouts.py",
    "tests/train/test_multihost.py", "tests/test_bench.py", "tests/train/test_evaluate.py",
    "tests/train/test_async_rollout.py",  # 44 s alone at load average 2.6, 85 s at 9
    "tests/train/test_graphs_end_to_end.py", "tests/train/test_process_split.py",
    "tests/train/test_backbones.py", "tests/train/test_shared_critic_split.py",
    "tests/train/test_update_behaviour.py", "tests/rollout/test_rollout.py",
    "tests/envs/test_sandbox.py", "tests/models/test_sampler.py",
    "tests/models/test_transformer.py", "tests/test_launch.py", "tests/train/test_teams.py",
    "tests/rollout/test_rewards.py", "tests/train/test_steady_state_compiles.py",
    "tests/test_bench_accelerator.py", "tests/models/test_sampler_fast_paths.py",
    "tests/test_launch_configs.py",
    "tests/test_packaging.py")  # a fresh venv and a wheel: 60-90 s


def _worker_scope(nodeid: str) -> str:
  """The unit `--dist loadfile` hands to one worker: the test's file (`_SAME_WORKER` merged)."""
  path = nodeid.split("::")[0]
  return _SAME_WORKER.get(path, path)


def pytest_collection_modifyitems(config, items):
  # Unconditional: xdist's workers (which collect) run with dist "no"; alone it is harmless.
  rank = {path: i for i, path in enumerate(_SLOW_FILES_FIRST)}
  items.sort(key=lambda item: rank.get(_worker_scope(item.nodeid), len(rank)))  # stable
  if jax.default_backend() != "cpu":
    # Another backend's kernels round differently: on an H200 (28 Nov 2026) the old
    # checkpoints' digests and the bf16 sampler/learner gaps were not CPU's, while the same
    # runs were still bit-for-bit alike with each other there (docs/scaling.md).
    skip = pytest.mark.skip(reason=f"numbers recorded on XLA:CPU, backend is "
                            f"{jax.default_backend()}")
    for item in items:
      if item.get_closest_marker("xla_cpu_numbers"):
        item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile` (the README's test command), with the files of `_SAME_WORKER` as one,
  handed out in the collection's order (`_SLOW_FILES_FIRST`)."""
  if config.getoption("dist") != "loadfile":
    return None
  config.option.loadscopereorder = False
  from xdist.scheduler import LoadFileScheduling

  class Scheduling(LoadFileScheduling):
    def _split_scope(self, nodeid):
      return _worker_scope(nodeid)

  return Scheduling(config, log)

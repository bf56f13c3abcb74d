"""XLA:CPU flags that make the test suite's compiles fast (conftest.py says why and what they
keep). Test processes get them with 8 virtual devices; a test that starts a script as a user
would (one device) passes `FAST_COMPILE` alone.

  * LLVM at -O0 and XLA:CPU's older per-fusion emitters: compiles about 2.7 times as fast.
  * One LLVM module per program instead of up to 32 parts compiled on threads, LLVM's
    expensive passes off, and XLA's plain scheduler instead of the concurrency-optimised one:
    two test workers already keep both cores busy, so threads and schedules only add CPU
    time. On four compile-bound test files (one process): 140-148 -> 126-127 CPU-s. None of
    these three changes what a program computes (fast-math stays off)."""

import importlib.metadata
import os


def _jaxlib_version() -> tuple[int, ...]:
  return tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])


# XLA aborts the process on an XLA_FLAGS flag it does not know, before any output (under
# pytest's capture the suite then dies silently: seen with jaxlib 0.11.2 on an H200, 28 Nov
# 2026), and the XLA of jaxlib 0.11 no longer has the older emitters' switch.
_OLDER_EMITTERS = ("--xla_cpu_use_fusion_emitters=false " if _jaxlib_version() < (0, 11)
                   else "")

FAST_COMPILE = ("--xla_backend_optimization_level=0 " + _OLDER_EMITTERS +
                "--xla_cpu_parallel_codegen_split_count=1 "
                "--xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_enable_concurrency_optimized_scheduler=false")

# Another instruction set for the whole suite and every process it starts: XLA:CPU then
# compiles as it would for a narrower CPU (`MARFT_TEST_MAX_ISA=SSE4_2` or `AVX2`), which
# rounds f32 otherwise. CI runs the exactness-sensitive tests (`-m exactness`) a second time
# so, to show they hold on CPUs other than the one a result was recorded on.
MAX_ISA = os.environ.get("MARFT_TEST_MAX_ISA", "")
if MAX_ISA:
  FAST_COMPILE += f" --xla_cpu_max_isa={MAX_ISA}"

"""Keep freed host memory in the process, so that XLA:CPU's big buffers do not page-fault anew
at every step.

On CPU, XLA allocates each step's activations and gradients with malloc. glibc serves any
allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh mmap
that free unmaps, and returns the top of its heap to the kernel past a trim threshold. Every step then touches GBs of
brand-new pages, which the kernel must fault in and zero: on 2 cores, one SmolLM2 PPO update
(8 x 256 tokens) took 600k page faults and 2 s of system time, about 1.3 s of its 5.5 s wall
time. With one heap that never shrinks, the second and later steps reuse the same pages (no
faults at all) and the update takes 4.1 s.

The price is that the process keeps its peak heap size until it exits, as tcmalloc and
jemalloc do by default; a training or benchmark process reaches that peak at every step
anyway. The launch scripts and benchmarks call `retain_freed_memory()` once at start-up
(`--noretain_host_memory` turns it off); library code never does, since it is a
process-wide choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory() -> bool:
  """Sets glibc's malloc to serve every allocation from one heap that is never trimmed.

  Returns True if the settings took effect, False where the C library is not glibc (macOS,
  musl) and nothing was changed. Call it before the first large computation: memory already
  mapped by then keeps its old behaviour.
  """
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  settings = (
      (_M_ARENA_MAX, 1),  # one arena: threads' own arenas are mmapped heaps, trimmed apart
      (_M_MMAP_MAX, 0),  # no allocation is its own mmap (unmapped again at free)
      # -1 reads as SIZE_MAX (mallopt's value is an int; the threshold a size_t): never trim.
      # A 2 GiB threshold is not enough: an update frees more than that at its end.
      (_M_TRIM_THRESHOLD, -1),
  )
  return all(libc.mallopt(param, value) == 1 for param, value in settings)

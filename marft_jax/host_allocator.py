"""Keep freed host memory in the process, so that XLA:CPU's big buffers do not page-fault anew
at every step.

On CPU, XLA allocates each step's activations and gradients with malloc. By default glibc
gives big allocations their own mmap (unmapped again at free), keeps per-thread arenas whose
heaps it unmaps when they empty, and returns the top of its main heap to the kernel: every
step then touches GBs of brand-new pages, which the kernel faults in and zeroes.
`retain_freed_memory()` makes every allocation come from one heap that never shrinks.

Measured on 2 cores (SmolLM2-135M, `bench.update`'s PPO update of 8 x 256 tokens, one
process per setting): glibc's default took 600k page faults, 2 s of system time and 4.4-5.5 s
per update; retained, no faults after the first update and 4.0-4.2 s. Disabling only the
mmaps and the trimming, without the single arena, left the faults as they were.

The costs, and why it is off by default (`--retain_host_memory` turns it on in the launch
scripts):
  * compiling is slower (6.8 s against 6.1 s for that update): XLA's compiler threads then
    share one malloc arena;
  * the process keeps its peak heap until it exits (as tcmalloc and jemalloc do);
  * on the default config's small batches (buffers under glibc's 32 MiB mmap limit, already
    reused) it gains nothing, so recompiles dominate: 3 iterations of 8 episodes took
    10.6-10.8 s per update against 9.8-10.4 s without it.
Turn it on for long runs with large batches (rows x tokens in the thousands), where the same
shapes repeat. Library code never calls it: it is a process-wide choice, made at the edge.
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

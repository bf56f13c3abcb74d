"""`host_allocator.retain_freed_memory`: a freed big buffer's pages are reused, not faulted in
again. Measured in a fresh interpreter (the settings are process-wide and one-way)."""

import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")

# Allocates, touches and frees a 256 MiB buffer twice, as XLA:CPU does with a step's
# activations, and prints the page faults of the second round against the pages touched.
_PROBE = textwrap.dedent("""
    import ctypes, resource, sys
    from marft_jax import host_allocator
    if sys.argv[1] == "retain":
        assert host_allocator.retain_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size = 256 << 20
    for round in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        buffer = libc.malloc(size)
        ctypes.memset(buffer, 1, size)
        libc.free(buffer)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults, size // 4096)
""")


def _second_round_faults(mode: str) -> tuple[int, int]:
  out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                       check=True).stdout
  faults, pages = map(int, out.split())
  return faults, pages


def test_freed_pages_are_reused_only_when_retained():
  faults, pages = _second_round_faults("default")
  assert faults > pages // 2  # glibc's default: the buffer is a fresh mmap every time
  faults, pages = _second_round_faults("retain")
  assert faults < pages // 100


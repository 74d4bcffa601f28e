"""Keep freed host memory for reuse instead of handing it back to the OS (glibc only).

XLA:CPU allocates every step's temporaries afresh, in blocks far above glibc's mmap threshold. glibc
serves such blocks with mmap (always, from a worker thread's arena) and unmaps them on free, so every step
page-faults the same memory back in, a measurable share of a CPU step. One arena that never maps and trims
only beyond 2 GiB of free heap removes that cost and keeps resident memory flat
(bench/README.md#measurements-behind-design-choices; bench/train_step.py runs every worker, ours and
PyTorch's, this way). It must run before JAX starts its backend: threads that already have an arena keep it.
"""
import ctypes
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
  """One malloc arena, no mmap'd blocks, no trimming. Returns False where the libc has no mallopt."""
  if not sys.platform.startswith("linux"):
    return False
  mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
  if mallopt is None:  # not glibc
    return False
  return all(mallopt(option, value) == 1 for option, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))

"""Keep freed host memory for reuse instead of handing it back to the OS (glibc only).

XLA:CPU allocates every step's temporaries afresh (about 1.3 GB for a BERT-base step at batch 8).
glibc serves blocks that large with mmap (always, from a worker thread's arena) and unmaps them on free,
so every step page-faults the same memory back in: 335k faults and 14% of a BERT-base step's CPU time
on a 2-core machine, gone with one arena that never maps nor trims (bench/train_step.py runs every worker,
ours and PyTorch's, this way). It must run before JAX starts its backend: threads that already have an
arena keep it. The cost is that the process's resident memory stays at its peak.
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

"""lm_jax.malloc: with it, XLA:CPU's per-call buffers stop page-faulting back in on every call."""
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, time
if sys.argv[1] == "keep":
  from lm_jax import malloc
  assert malloc.keep_freed_memory()
import jax, jax.numpy as jnp
f = jax.jit(lambda a: jnp.sin(a) * 2 + 1)   # a fresh 128 MB output per call
x = jnp.ones((8192, 4096))
f(x).block_until_ready()
faults = []
for _ in range(8):   # the heap settles after a few calls (glibc bins); a trainer makes thousands
  time.sleep(0.1)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  f(x).block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def _min_faults(mode):
  out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_stops_per_call_page_faults():
  system = _min_faults("system")   # 128 MB / 4 KiB pages = 32,768 when glibc unmaps on free
  if system < 20_000:
    pytest.skip(f"this machine's malloc/kernel already avoids the faults ({system} per call)")
  assert _min_faults("keep") < 1_000

"""Peak FLOP/s of the devices a run uses: the denominator of MFU.

Accelerators: dense bf16 peak from a table by device kind (vendor data sheets). CPUs have no table entry;
their peak is the measured rate of a large float32 matmul, which bench/train_step.py also uses as its
roofline, so the trainer's MFU and the benchmark's agree.
"""
import functools
import statistics
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak TFLOP/s per device, by substring of jax.Device.device_kind (first match wins).
PEAK_TFLOPS = (("TPU v2", 22.5), ("TPU v3", 61.5), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
               ("TPU v5", 459.0), ("TPU v6", 918.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0),
               ("A100", 312.0), ("A10G", 125.0), ("L4", 121.0), ("V100", 125.0))


def peak_flops(devices, peak_tflops: float = 0.0) -> float:
  """Total peak FLOP/s of `devices`: peak_tflops per device if set, the table, or on CPU a measured matmul."""
  if peak_tflops:
    return peak_tflops * 1e12 * len(devices)
  kind = devices[0].device_kind
  for name, tflops in PEAK_TFLOPS:
    if name in kind:
      return tflops * 1e12 * len(devices)
  return matmul_flops_per_s()  # CPU devices share the host's cores: one measurement is the whole machine


@functools.cache
def matmul_flops_per_s(n: int = 2048, dtype: str = "float32", repeats: int = 10) -> float:
  """Median rate of a jitted n^3 jnp.dot after 3 warm-ups (a median of many large matmuls is steadier than a
  best-of-few small ones)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
  mm = jax.jit(jnp.dot)
  for _ in range(3):
    mm(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    mm(a, a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / statistics.median(times)

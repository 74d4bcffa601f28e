"""Peak FLOP/s of the devices a run uses: the denominator of MFU, and where that number comes from.

Accelerators: dense bf16 peak from a table by device kind (vendor data sheets). CPUs have no table entry;
their peak is the measured rate of a large float32 matmul, which bench/train_step.py also uses as its
roofline, so the trainer's MFU and the benchmark's agree. Other processes on a loaded machine only ever slow a
matmul down, so the best of several timed runs is the measurement (a median under load understates the peak and
overstates MFU). It is taken once per machine and cached in a small JSON file keyed by CPU model, core count and
jax version; LM_JAX_MEASURE_PEAK=1 measures again and replaces the cached value.
"""
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

# Dense bf16 peak TFLOP/s per device, by substring of jax.Device.device_kind (first match wins).
PEAK_TFLOPS = (("TPU v2", 22.5), ("TPU v3", 61.5), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
               ("TPU v5", 459.0), ("TPU v6", 918.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0),
               ("A100", 312.0), ("A10G", 125.0), ("L4", 121.0), ("V100", 125.0))
REMEASURE = "LM_JAX_MEASURE_PEAK"


def peak(devices, peak_tflops: float = 0.0) -> tuple[float, str]:
  """(total peak FLOP/s of `devices`, where it comes from): peak_tflops per device if set, the table, or on CPU the
  host's cached (or now measured) matmul rate times the number of hosts."""
  n = len(devices)
  if peak_tflops:
    return peak_tflops * 1e12 * n, f"config.peak_tflops x {n}"
  kind = devices[0].device_kind
  for name, tflops in PEAK_TFLOPS:
    if name in kind:
      return tflops * 1e12 * n, f"table: {name} x {n}"
  hosts = len({d.process_index for d in devices})   # CPU devices share their host's cores: one rate per host
  flops, source = cpu_peak()
  return flops * hosts, f"{source}{f' x {hosts} hosts' if hosts > 1 else ''}"


def describe(flops: float, source: str) -> str:
  """The run's start-up line, e.g. 'peak 0.29 TFLOP/s (measured float32 matmul, cached in ...)'."""
  return f"peak {flops / 1e12:.3g} TFLOP/s ({source})"


def cache_path() -> str:
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lm_jax", "cpu_peak.json")


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo on Linux), else platform.processor()."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cache_key(dtype: str = "float32") -> str:
  """The machine as the measurement sees it: the cores this process may use (os.sched_getaffinity is Linux-only,
  like /proc/cpuinfo in cpu_model), not every core of the host."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return f"{cpu_model()} | {cores} cores | jax {jax.__version__} | {dtype}"


def cpu_peak(dtype: str = "float32") -> tuple[float, str]:
  """(this host's matmul FLOP/s, its source): the cached measurement for this machine, else a new one, cached. An
  unwritable cache costs only the caching."""
  path, key = cache_path(), cache_key(dtype)
  try:
    with open(path) as f:
      cached = json.load(f)
  except (OSError, ValueError):
    cached = {}
  if key in cached and os.environ.get(REMEASURE) != "1":
    return cached[key], f"measured {dtype} matmul, cached in {path}; {REMEASURE}=1 measures again"
  flops = matmul_flops_per_s(dtype=dtype)
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump({**cached, key: flops}, f, indent=1)
    where = f"now cached in {path}"
  except OSError:
    where = f"not cached: {path} is not writable"
  return flops, f"measured {dtype} matmul, {where}"


@functools.cache
def matmul_flops_per_s(n: int = 2048, dtype: str = "float32", repeats: int = 10) -> float:
  """Best rate of `repeats` jitted n^3 jnp.dot after 3 warm-ups (once per process)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
  mm = jax.jit(jnp.dot)
  for _ in range(3):
    mm(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    mm(a, a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n**3 / min(times)

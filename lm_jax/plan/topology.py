"""Accelerator topologies by name, as devices a CPU host can compile for (lm_jax.plan.aot), and each device's memory.

  TPU  v4-N, v5p-N     N TensorCores = N/2 chips, one megacore device per chip, hosts of 2x2x1 chips
       v5e-N, v6e-N    N chips, one device each, hosts of 2x2 chips (v5e-8 / v6e-8: one host of 2x4)
       KxNAME          K slices of NAME over the data-center network, e.g. 2xv5e-256
  GPU  h100-8, a100-8, h200-8, NxNAME (e.g. 4xh100-8)   N nodes of 8 GPUs; XLA's target description of the GPU
       is data beside this file (lm_jax/plan/gpu_specs/*.txtpb)

TPU slice shapes follow Cloud TPU's documented topologies (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): a 3-D
slice grows 2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4 -> 4x4x4 -> ... doubling its smallest dimension from the last, with
wrap-around links once every dimension is at least 4; a 2-D slice grows 2x2 -> 2x4 -> 4x4 -> 4x8 -> 8x8 -> 8x16 ->
16x16 and wraps a dimension of 16. Compiling needs libtpu (TPU) or the compile-only CUDA plugin (GPU):
requirements-aot.txt.
"""
import dataclasses
import os
import re

import jax
from jax.experimental import topologies

from lm_jax import config_lib

SPECS_DIR = os.path.join(os.path.dirname(__file__), "gpu_specs")
GPUS = {"h100": "h100_sxm.txtpb", "a100": "a100_sxm_80.txtpb", "h200": "h200_sxm.txtpb"}
TPUS = {"v4": ("v4", "megacore", 3), "v5p": ("v5", "megacore", 3), "v5e": ("v5e", "default", 2),
        "v6e": ("v6e", "default", 2)}
# Memory per device in GiB by substring of device_kind (first match wins). TPU: HBM per chip from the Cloud TPU
# system-architecture pages (v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB); GPU: device_memory_size of the
# target description (NVIDIA datasheets: 80 GB, 80 GB, 141 GB).
MEMORY_GIB = (("TPU v4", 32.0), ("TPU v5 lite", 16.0), ("TPU v5", 95.0), ("TPU v6 lite", 32.0),
              ("H100", 84978434048 / 2**30), ("A100", 85100068864 / 2**30), ("H200", 150754820096 / 2**30))
USAGE = ("TPU v4-N / v5e-N / v5p-N / v6e-N (KxNAME for K slices, e.g. 2xv5e-256) or GPU h100-8 / a100-8 / h200-8 "
         "(NxNAME for N nodes)")


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str
  platform: str         # 'tpu' or 'cuda'
  devices: tuple
  slices: int           # TPU slices (data-center network between them); GPU nodes

  @property
  def kind(self) -> str:
    return self.devices[0].device_kind

  @property
  def hosts(self) -> int:
    return len({d.process_index for d in self.devices})


def device_memory(kind: str) -> float:
  """Bytes of memory of one device of `kind` (MEMORY_GIB)."""
  for name, gib in MEMORY_GIB:
    if name in kind:
      return gib * 2**30
  raise ValueError(f"no memory size known for device kind {kind!r}; add it to lm_jax.plan.topology.MEMORY_GIB")


def slice_shape(chips: int, dims: int) -> tuple:
  """Chip grid of a TPU slice of `chips` chips (module docstring); ValueError if no such slice."""
  shape = [2, 2, 1] if dims == 3 else [2, 2]
  if chips < 4 or chips & (chips - 1):
    if dims == 2 and chips == 1:
      return (1, 1)
    raise ValueError(f"{chips} chips is not a slice size: use a power of two >= 4")
  while shape[0] * shape[1] * (shape[2] if dims == 3 else 1) < chips:
    i = min(range(dims), key=lambda k: (shape[k], -k))   # smallest dimension, the last first
    shape[i] *= 2
  return tuple(shape)


def parse(name: str):
  """'2xv5e-256' -> ('v5e', 256, 2); 'h100-8' -> ('h100', 8, 1); one-line ConfigError otherwise (exit 2)."""
  m = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", name.strip().lower())
  if not m or m[2] not in (*TPUS, *GPUS):
    raise config_lib.ConfigError(f"--topology={name!r} unknown: use {USAGE}")
  if m[2] in GPUS and m[3] != "8":
    raise config_lib.ConfigError(f"--topology={name!r}: GPU topologies are nodes of 8 ({m[2]}-8, or e.g. "
                                 f"2x{m[2]}-8)")
  kind, n, slices = m[2], int(m[3]), int(m[1] or 1)
  if slices < 1:
    raise config_lib.ConfigError(f"--topology={name!r}: {slices} slices; use at least 1 (or leave out the Kx)")
  if kind in TPUS:
    try:
      slice_shape(n // 2 if TPUS[kind][2] == 3 else n, TPUS[kind][2])
    except ValueError as e:
      raise config_lib.ConfigError(f"--topology={name!r}: {e}") from None
  return kind, n, slices


# The attention kernels (config.model.attention) each platform runs; Pallas's splash kernel is TPU code (on another
# platform it compiles only as the interpreter), cuDNN's is NVIDIA's.
KERNELS = {"tpu": ("xla", "splash"), "cuda": ("xla", "cudnn")}


def check_kernel(attention: str, name: str):
  """ConfigError (exit 2) when model.attention cannot run on topology `name`'s platform."""
  platform = "cuda" if parse(name)[0] in GPUS else "tpu"
  if attention in {k for ks in KERNELS.values() for k in ks} - set(KERNELS[platform]):
    raise config_lib.ConfigError(f"model.attention={attention!r} cannot run on --topology={name} ({platform.upper()}"
                                 f" is {' or '.join(map(repr, KERNELS[platform]))}): set --config.model.attention="
                                 f"{KERNELS[platform][1]} or xla")


def get(name: str) -> Topology:
  """The devices of topology `name` (module docstring), built without the hardware."""
  kind, n, slices = parse(name)
  if kind in GPUS:
    with open(os.path.join(SPECS_DIR, GPUS[kind])) as f:
      desc = topologies.get_topology_desc(platform="cuda", topology=f"{slices}x1x8", target_config=f.read())
    return Topology(name, "cuda", tuple(desc.devices), slices)
  prefix, chip_config, dims = TPUS[kind]
  chips = n // 2 if dims == 3 else n
  shape = slice_shape(chips, dims)
  wrap = tuple(all(s >= 4 for s in shape) for _ in shape) if dims == 3 else tuple(s == 16 for s in shape)
  host = (2, 4, 1) if dims == 2 and chips == 8 else (2, 2, 1) if chips >= 4 else (1, 1, 1)
  desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, shape))}",
                                      chip_config_name=chip_config, chips_per_host_bounds=host, num_slices=slices,
                                      wrap=(*wrap, False)[:3])
  return Topology(name, "tpu", tuple(desc.devices), slices)


def prepare():
  """Lets this process compile for TPU / GPU topologies on a CPU host: CPU as the only backend that runs, the CUDA
  plugin without its CUDA-library check (it compiles; nothing runs), libtpu without its one-process lock, and no
  persistent compilation cache (JAX_COMPILATION_CACHE_DIR): it would store compile-only executables that no later
  process can load (each read is a warning, 'PjRtCompiler must be constructed with a Client'). Call before JAX
  starts a backend."""
  jax.config.update("jax_enable_compilation_cache", False)
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # no TPU to guard: compiles may run side by side
  jax.config.update("jax_platforms", "cpu")

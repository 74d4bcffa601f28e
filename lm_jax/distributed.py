"""Join JAX's multi-controller runtime when this process is one host of several.

Every host runs the same program; `jax.distributed.initialize` connects them so that
`jax.devices()` spans the whole slice or cluster and orbax can coordinate saves. It must run
before anything starts a JAX backend, which is why `main.py` calls `maybe_initialize()` first.

Launchers recognised (first match wins):
  local   launch/local.sh sets LM_JAX_COORDINATOR, LM_JAX_NUM_PROCESSES, LM_JAX_PROCESS_ID.
  slurm   `srun` with more than one task (SLURM_NTASKS > 1, SLURM_STEP_NODELIST set).
  tpu     a Cloud TPU VM (Google TPU chips on the PCI bus, or TPU_WORKER_HOSTNAMES /
          MEGASCALE_COORDINATOR_ADDRESS set): JAX reads the slice topology from the metadata server.
"""
import os
import pathlib

import jax

# Google's PCI vendor id and its TPU chips' device ids (v2/v3, unnamed, v4, v5p, v5e, v6e, TPU7x): JAX's own
# table, which grows with each generation (docs/toolchain.md#tpu-detection).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def _has_tpu_chips(pci_devices: str = "/sys/bus/pci/devices") -> bool:
  """A TPU chip on the PCI bus; other Google devices (e.g. the gVNIC network card) share the vendor id."""
  for device in pathlib.Path(pci_devices).glob("*"):
    try:
      vendor, device_id = ((device / name).read_text().strip() for name in ("vendor", "device"))
    except OSError:  # not a readable PCI device entry
      continue
    if vendor == _GOOGLE_PCI_VENDOR and device_id in _TPU_PCI_DEVICES:
      return True
  return False


def launcher() -> str:
  """Which multi-process launcher started this process: 'local', 'slurm', 'tpu', or '' for none."""
  env = os.environ
  if int(env.get("LM_JAX_NUM_PROCESSES", "1")) > 1:
    return "local"
  if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_NODELIST" in env:
    return "slurm"
  if "TPU_WORKER_HOSTNAMES" in env or "MEGASCALE_COORDINATOR_ADDRESS" in env or _has_tpu_chips():
    return "tpu"
  return ""


def _slurm_local_device_ids():
  """All GPUs of the node when SLURM runs one task per node.

  JAX's SLURM default binds task SLURM_LOCALID to GPU SLURM_LOCALID (one task per GPU); with a
  single task per node that would leave all GPUs but the first idle.
  """
  env = os.environ
  nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
  gpus = int(env.get("SLURM_GPUS_ON_NODE", "0"))
  if int(env["SLURM_NTASKS"]) == nodes and gpus > 1:
    return list(range(gpus))
  return None


def maybe_initialize() -> str:
  """Calls jax.distributed.initialize() for a multi-process launch; no-op for one process.

  Returns the launcher name ('' when single-process or already initialised).
  """
  kind = launcher()
  if not kind or jax.distributed.is_initialized():
    return ""
  env = os.environ
  if kind == "local":
    for name in ("LM_JAX_COORDINATOR", "LM_JAX_PROCESS_ID"):
      if name not in env:
        raise ValueError(f"LM_JAX_NUM_PROCESSES={env['LM_JAX_NUM_PROCESSES']} but {name} is not set")
    jax.distributed.initialize(coordinator_address=env["LM_JAX_COORDINATOR"],
                               num_processes=int(env["LM_JAX_NUM_PROCESSES"]),
                               process_id=int(env["LM_JAX_PROCESS_ID"]))
  elif kind == "slurm":
    jax.distributed.initialize(local_device_ids=_slurm_local_device_ids())
  else:
    jax.distributed.initialize()
  return kind


def is_lead() -> bool:
  """Whether this process is the one that writes what the run shares (console lines, logs, files in the workdir,
  exports): process 0. Every host runs the same program; the others only compute."""
  return jax.process_index() == 0

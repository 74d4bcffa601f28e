"""A TPU slice by the names lm_jax.plan.topology knows (v4-32, v5e-256, v6e-16, ...): its hosts, chips per host, chip
grid, and the names Ray and GKE give its accelerator. One slice; several (KxNAME) need the engines' multi-slice
set-up, which these launchers do not do.

Hosts follow Cloud TPU's documented VM shapes, as lm_jax.plan.topology builds them: 4 chips per host (2x2x1), except
that a v5e / v6e slice of at most 8 chips is one host of all of them.
"""
import dataclasses

from lm_jax.plan import topology

RAY = {"v4": "TPU-V4", "v5p": "TPU-V5P", "v5e": "TPU-V5LITEPOD", "v6e": "TPU-V6E"}   # ray.util.accelerators
GKE = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice", "v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str
  kind: str            # v4, v5p, v5e, v6e
  chips: int
  grid: str            # chip grid, e.g. '2x2x4': Ray's `topology` and GKE's gke-tpu-topology
  hosts: int
  chips_per_host: int

  @property
  def ray_accelerator(self) -> str:
    return RAY[self.kind]

  @property
  def gke_accelerator(self) -> str:
    return GKE[self.kind]


def get(name: str) -> Slice:
  """The slice `name`; config_lib.ConfigError (one line, exit 2) for a GPU, several slices or an unknown name."""
  kind, n, slices = topology.parse(name)
  if kind not in topology.TPUS or slices != 1:
    raise topology.config_lib.ConfigError(f"--topology={name!r}: one TPU slice is needed here (v4-N, v5e-N, v5p-N, "
                                          "v6e-N)")
  dims = topology.TPUS[kind][2]
  chips = n // 2 if dims == 3 else n
  shape = topology.slice_shape(chips, dims)
  per_host = chips if dims == 2 and chips <= 8 else 4
  return Slice(name, kind, chips, "x".join(map(str, shape)), chips // per_host, per_host)

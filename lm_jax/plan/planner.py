"""--mode=compile --plan: the fastest setting of a run that fits a topology, found before paying for it.

Candidates: every mesh (data x fsdp x tensor, powers of two, tensor dividing the heads), microbatches that split
the per-device rows evenly, remat policy (none, minimal, full) and scan_layers. lm_jax.plan.memory's analytic model
ranks them in seconds: those it predicts to fit, fastest first. Predicted time is the model's training FLOPs
plus remat's recomputation (minimal: the attention and FFN activations' matmuls again, counted as a third of the
forward pass; full: the forward pass again) at the stated MFU; at equal time the less communication first (data
parallelism before fsdp before tensor), then fewer microbatches; the config's own scan setting before the other
(the model cannot tell them apart; the compiler can). The first few are compiled (lm_jax.plan.aot) until `keep` of
them fit: the compiler has the last word on memory. The estimate leaves out what XLA adds (all-gathered FSDP
weights, gradient buffers of gathered embeddings, fusion temporaries), so a setting it ranks first can still fail
to compile; the table says so and the next one is tried.
"""
import copy
import dataclasses
import itertools
import json

from lm_jax import checks, config_lib, objectives
from lm_jax.plan import aot, hardware, memory, topology

RECOMPUTE = {"none": 0.0, "minimal": 1 / 3, "full": 1.0}   # extra forward passes, in forward passes


@dataclasses.dataclass(frozen=True)
class Candidate:
  mesh: tuple
  microbatches: int
  remat: str
  scan: bool
  estimate: int      # lm_jax.plan.memory's total bytes per device
  seconds: float     # predicted step time

  def overrides(self) -> dict:
    data, fsdp, tensor = self.mesh
    return {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "microbatches": self.microbatches,
            "model.remat_policy": self.remat, "model.scan_layers": self.scan}

  def flags(self) -> str:
    return " ".join(f"--config.{k}={v}" for k, v in self.overrides().items())


def meshes(n: int, heads: int):
  """(data, fsdp, tensor) of powers of two with product n and tensor dividing `heads`."""
  twos = [2**i for i in range(n.bit_length()) if n % 2**i == 0]
  for fsdp, tensor in itertools.product(twos, twos):
    if n % (fsdp * tensor) == 0 and heads % tensor == 0:
      yield n // (fsdp * tensor), fsdp, tensor


def _with(config, overrides: dict):
  return config_lib.override(copy.deepcopy(config), overrides)


def candidates(config, topo: topology.Topology, mfu: float) -> list[Candidate]:
  """Every setting the analytic model predicts to fit, best first (module docstring)."""
  n, has = len(topo.devices), topology.device_memory(topo.kind)
  peak = hardware.peak(list(topo.devices), config.peak_tflops)[0]
  train_flops = objectives.get(config.objective).flops_per_example(config) * config.batch_size
  out = []
  for mesh in meshes(n, config.model.num_heads):
    data, fsdp, tensor = mesh
    if config.batch_size % (data * fsdp) or (topo.slices > 1 and data % topo.slices):
      continue
    try:
      base = memory.estimate(config, mesh=mesh)
    except ValueError:   # a parameter dimension does not split over this mesh
      continue
    rows = config.batch_size // (data * fsdp)
    for mb, remat in itertools.product([m for m in (1, 2, 4, 8, 16, 32) if rows % m == 0], RECOMPUTE):
      est = memory.rescheduled(base, _with(config, {"microbatches": mb, "model.remat_policy": remat}))
      if est.total > has:
        continue
      seconds = train_flops * (1 + RECOMPUTE[remat] / 3) / (peak * mfu)   # recompute: forward = 1/3 of training
      for scan in (config.model.scan_layers, not config.model.scan_layers):
        out.append(Candidate(mesh, mb, remat, scan, est.total, seconds))
  order = lambda c: (c.scan != config.model.scan_layers, round(c.seconds, 9), c.mesh[2], c.mesh[1], c.microbatches)
  return sorted(out, key=order)


def run(config, topology_name: str, mfu: float = 0.4, json_path: str = "", keep: int = 3, max_compiles: int = 6):
  """Prints the table of compiled candidates and the best one's --config overrides; returns its report."""
  topo = topology.get(topology_name)
  checks.validate(config, len(topo.devices), topo.hosts)
  ranked = candidates(config, topo, mfu)
  if not ranked:
    raise aot.OutOfMemory(f"no mesh / microbatches / remat setting fits {len(topo.devices)} x {topo.kind} by "
                          f"lm_jax.plan.memory's estimate: use more devices, a smaller batch or a smaller model")
  print(f"plan: {len(ranked)} settings fit by lm_jax.plan.memory's estimate; compiling the best (at most "
        f"{max_compiles})", flush=True)
  rows, best = [], None
  for cand in ranked[:max_compiles]:
    try:
      lay, train, evaluate = aot.compile_steps(_with(config, cand.overrides()), topo)
    except aot.OutOfMemory as e:
      rows.append((cand, None, str(e).split(";")[0]))
      continue
    report = aot.report(lay, topo, train, evaluate, mfu)
    rows.append((cand, report, "fits"))
    best = best or (cand, report)
    if sum(r is not None for _, r, _ in rows) >= keep:
      break
  print(format_table(rows))
  if best is None:
    raise aot.OutOfMemory(f"none of the {len(rows)} best settings by lm_jax.plan.memory's estimate compiles within "
                          f"{topology.device_memory(topo.kind) / aot.GiB:.2f} GiB per {topo.kind}: {aot.CHANGES}")
  cand, report = best
  print(aot.format_report(report))
  print(f"best: {cand.flags()}", flush=True)
  if json_path:
    with open(json_path, "w") as f:
      json.dump({**report, "plan": [{**dataclasses.asdict(c), "compiled": r and r["memory_per_device"]["total"],
                                         "result": why} for c, r, why in rows]}, f, indent=1)
  return report


def format_table(rows) -> str:
  head = f"  {'data fsdp tensor':>16} {'mb':>3} {'remat':>7} {'scan':>5} {'estimate':>9} {'compiled':>9} {'step':>9}"
  lines = [head]
  for cand, report, why in rows:
    compiled = f"{report['memory_per_device']['total'] / aot.GiB:7.2f}G" if report else f"{'-':>8}"
    lines.append(f"  {' '.join(map(str, cand.mesh)):>16} {cand.microbatches:>3} {cand.remat:>7} {str(cand.scan):>5} "
                 f"{cand.estimate / aot.GiB:8.2f}G {compiled:>9} {cand.seconds * 1e3:7.1f}ms  {why}")
  return "\n".join(lines)

"""Per-device training memory for a config on a mesh, without the devices: pick a mesh before paying.

  python -m lm_jax.plan.memory --config=configs/bert.py:large --devices=16 --config.mesh.fsdp=16

params, optimizer state: exact. The train state's abstract params and optimizer state (lm_jax.layout) are
  placed by the trainer's own rules (sharding.logical_to_sharding, opt_state_sharding) on an AbstractMesh of the
  requested sizes; bytes = sum of shard sizes, also shown per parameter (NF4-quantised weights, lm_jax.models.nf4,
  count as the weights they stand for: ~0.516 bytes each).
gradients: float32 copy of the trainable params' shards (step.py casts them; the params Policy's trainable mask: frozen
  params, LoRA's base and its NF4 weights get none), twice with microbatches (accumulator plus the current
  microbatch's gradient).
activations: analytic, what the backward pass keeps: the family's count (Family.activation_bytes, summed from
  lm_jax/models/costs.py's per-layer formula, Korthikanti et al. 2022 §4 without sequence parallelism, with the
  remat policy's savings) per example, with heads, FFN and vocabulary split over the mesh axes they map to.
  Rows per device = batch_size / microbatches / (mesh size of 'batch'). Not counted: XLA temporaries (gradients of
  the logits, fusion buffers), all-gathered FSDP weights in flight, the optimizer update's temporaries: measured
  peaks run higher (see README).
eval step: params and one microbatch's forward pass (step.make_eval_step runs the train step's microbatches one at
  a time), less than the train step keeps: a setting whose train step fits has an eval step that fits.
kv cache (kv_cache_bytes): a decoding cache's keys and values, the family's count (Family.kv_cache_bytes).
"""
import dataclasses
import math

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AbstractMesh

from lm_jax import config_lib, layout as layout_lib, models, objectives, params as params_lib, sharding
from lm_jax.models import nf4

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes per device. `mesh` is (data, fsdp, tensor); `rows` = examples per device per microbatch;
  `param_count` = parameters per device that `params` bytes hold."""
  mesh: tuple
  rows: int
  remat: str
  params: int
  param_count: int
  opt_state: int
  grads: int
  activations: int
  microbatches: int = 1

  @property
  def total(self) -> int:
    return self.params + self.opt_state + self.grads + self.activations

  def __str__(self) -> str:
    return format_table(self)


def format_table(est: Estimate) -> str:
  data, fsdp, tensor = est.mesh
  head = (f"per-device memory: mesh data={data} fsdp={fsdp} tensor={tensor} ({data * fsdp * tensor} devices), "
          f"{est.rows} rows/device, remat={est.remat}")
  rows = [("params", est.params), ("optimizer state", est.opt_state), ("gradients", est.grads),
          ("activations (approx.)", est.activations), ("total", est.total)]
  lines = [f"  {name:<22} {b / GiB:9.3f} GiB" for name, b in rows]
  lines[0] += f"  ({est.params / max(est.param_count, 1):.3f} bytes/param)"
  return "\n".join([head] + lines)


def _sharded_bytes(abstract, shardings) -> int:
  return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
             for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def param_bytes(abstract_params, shardings) -> tuple[int, int]:
  """Per device: (bytes, parameters they hold) of abstract params placed by `shardings`; an NF4 weight holds the
  share of its parameters that its parts' shards hold of its bytes."""
  nbytes = count = 0
  for a, s in zip(jax.tree.leaves(abstract_params, is_leaf=nf4.is_nf4),
                  jax.tree.structure(abstract_params, is_leaf=nf4.is_nf4).flatten_up_to(shardings)):
    local = _sharded_bytes(a, s)
    nbytes += local
    if nf4.is_nf4(a):
      stored, represented = nf4.storage(a)
      count += represented * local // stored
    else:
      count += local // np.dtype(a.dtype).itemsize
  return nbytes, count


def _mesh_size(rules, sizes: dict, logical: str) -> int:
  """Number of devices the logical axis `logical` is split over."""
  axes = nn.logical_to_mesh_axes((logical,), rules)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(sizes[a] for a in axes)


def activation_bytes(config, rows: int, div: dict) -> int:
  """Analytic bytes kept for the backward pass per device (module docstring); div = devices that split
  'heads', 'mlp', 'vocab'."""
  lengths = objectives.get(config.objective).lengths(config)
  return int(rows * models.family(config.model).activation_bytes(config.model, lengths, div))


def kv_cache_bytes(model_cfg, rows: int, length: int, inputs: int = 0) -> int:
  """Bytes of the keys and values a decoding cache holds for `rows` sequences of `length` (decoder) positions;
  `inputs`: the encoder's length, whose keys and values an encoder-decoder caches for cross-attention."""
  fam = models.family(model_cfg)
  if fam.kv_cache_bytes is None:
    raise ValueError(f"model.family={fam.name!r} has no decoder to cache keys and values for")
  return int(fam.kv_cache_bytes(model_cfg, rows, length, inputs))


def estimate(config, *, num_devices: int | None = None, mesh=None, layout=None) -> Estimate:
  """Per-device memory of training `config`.

  layout: the run's layout.Layout when it has one (the trainer, --mode=compile): its state is counted as built.
  Otherwise one is built on an abstract mesh: mesh gives (data, fsdp, tensor) sizes for a 'what if' mesh; default
  config.mesh with its -1 filled from num_devices (default jax.device_count()).
  """
  if layout is not None:
    mesh = tuple(layout.mesh.shape[a] for a in sharding.AXES)
  elif mesh is None:
    mesh = sharding.mesh_shape(config, num_devices or jax.device_count())
  mesh = tuple(int(n) for n in mesh)
  if len(mesh) != 3 or min(mesh) < 1:
    raise ValueError(f"mesh must be 3 positive sizes (data, fsdp, tensor), got {mesh}")
  if layout is None:
    rules = sharding.rules(config)
    sharding.check_divisible(models.abstract_params(config.model), models.logical_axes(config.model),
                             dict(zip(sharding.AXES, mesh)), rules)
    layout = layout_lib.build(config, AbstractMesh(mesh, sharding.AXES), rules)
  abstract, state_sh = layout.abstract_state, layout.state_sharding
  params_sh, abstract_opt, opt_sh = state_sh["params"], abstract["opt_state"], state_sh["opt_state"]

  params, param_count = param_bytes(abstract["params"], params_sh)
  mask = layout.policy.trainable
  trainable = param_bytes(params_lib.split(abstract["params"], mask)[0], params_lib.split(params_sh, mask)[0])[1]
  est = Estimate(mesh=mesh, rows=0, remat="", params=params, param_count=param_count,
                 opt_state=_sharded_bytes(abstract_opt, opt_sh), grads=4 * trainable, activations=0)
  return rescheduled(est, config)


def rescheduled(est: Estimate, config) -> Estimate:
  """`est` (same model, optimizer and mesh) for config's batch size, microbatches and remat policy, without
  building the state layout again: only the rows, the gradient accumulator and the activations change."""
  sizes, rules = dict(zip(sharding.AXES, est.mesh)), sharding.rules(config)
  trainable_grads = est.grads // (2 if est.microbatches > 1 else 1)
  rows = -(-config.batch_size // (config.microbatches * _mesh_size(rules, sizes, "batch")))
  div = {name: _mesh_size(rules, sizes, name) for name in ("heads", "mlp", "vocab")}
  return dataclasses.replace(est, rows=rows, remat=config.model.remat_policy, microbatches=config.microbatches,
                             grads=trainable_grads * (2 if config.microbatches > 1 else 1),
                             activations=activation_bytes(config, rows, div))


@dataclasses.dataclass(frozen=True)
class Compiled:
  """Per-device bytes of one compiled step (compiled.memory_analysis) and XLA's FLOPs (None where unusable)."""
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int
  xla_flops: float | None

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def measure(compiled, counts_flops: bool = True) -> Compiled:
  """compiled.memory_analysis() (per device) and cost_analysis()'s flops where `counts_flops`."""
  mem = compiled.memory_analysis()
  flops = None
  if counts_flops:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost["flops"]) if cost and cost.get("flops", -1) > 0 else None
  return Compiled(mem.argument_size_in_bytes, mem.output_size_in_bytes, mem.alias_size_in_bytes,
                  mem.temp_size_in_bytes, mem.generated_code_size_in_bytes, flops)


def compiled_line(c: Compiled, est: Estimate) -> str:
  """The trainer's start-up line: the compiled step's per-device memory (measure) next to this module's estimate,
  in MiB."""
  mib = lambda b: f"{b / 2**20:.1f}"
  return (f"memory per device (MiB): compiled step arguments {mib(c.arguments)} (params, optimizer state, batch), "
          f"outputs {mib(c.outputs)} (aliased {mib(c.aliased)}), temporaries {mib(c.temporaries)}, code "
          f"{mib(c.code)}, total {mib(c.total)} | lm_jax.plan.memory: params {mib(est.params)}, optimizer state "
          f"{mib(est.opt_state)}, gradients {mib(est.grads)}, activations {mib(est.activations)}, total "
          f"{mib(est.total)}")


def device_stats(device) -> dict:
  """Memory in use and its peak on `device` in GiB (jax.Device.memory_stats: GPU, TPU), {} where not reported."""
  stats = device.memory_stats() or {}
  names = {"bytes_in_use": "device_memory_gib", "peak_bytes_in_use": "device_memory_peak_gib"}
  return {name: stats[key] / GiB for key, name in names.items() if key in stats}


if __name__ == "__main__":
  from absl import app, flags

  _CONFIG = flags.DEFINE_string("config", None, "configs/<file>.py[:<variant>]; override fields with --config.a.b=v")
  _DEVICES = flags.DEFINE_integer("devices", None, "number of devices (default: this host's jax.device_count())")

  def _main(args):
    _, overrides = args
    with config_lib.user_errors():
      print(estimate(config_lib.load(_CONFIG.value, overrides), num_devices=_DEVICES.value))

  flags.mark_flags_as_required(["config"])
  app.run(_main, flags_parser=config_lib.parse_flags)

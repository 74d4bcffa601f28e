"""Compile a run's real train and eval steps for a TPU / GPU topology on a CPU host, before paying for it.

  python -m lm_jax.main --mode=compile --config=configs/bert.py:large --topology=v4-32 [--plan] [--mfu=0.4]

The steps are the trainer's own (lm_jax.layout, step.make_train_step, make_eval_step: mesh, rules, microbatches,
remat, scan, dtypes, objective, adapters) lowered on ShapeDtypeStructs of the train state and of the objective's
batch features, so no tokenizer is trained, no data read and nothing written. XLA compiles them for the topology's
devices (lm_jax.plan.topology) and reports per-device memory (compiled.memory_analysis); the TPU compiler refuses a step
that does not fit, and so does this module for any device whose memory the step exceeds (topology.MEMORY_GIB).

FLOPs per step are lm_jax.flops' exact matmul count (3x forward). XLA's own count (cost_analysis) is shown only
where it is right: on TPU, without a scanned layer stack or microbatch loop (a scan's body is counted once) and it
includes remat's recomputation; the CUDA compiler gives none. Predicted time = our FLOPs / (peak x MFU), peak from
lm_jax.plan.hardware's table, the MFU stated; communication is not modelled. The input line says how many tokens/s
per host that step needs and how many cores this pipeline takes for it, on the fly and prepared
(lm_jax.plan.input_rate, from bench/data_throughput.py's measurement, kept in lm_jax/plan/input_rates.json).
"""
import importlib.util
import json
import re
import sys

import jax
import numpy as np
from flax import linen as nn

from lm_jax import checks, config_lib, init_from, layout as layout_lib, sharding, step
from lm_jax.models import layers
from lm_jax.plan import hardware, input_rate, memory, topology

GiB = memory.GiB


class OutOfMemory(ValueError):
  """The step does not fit the device: one line, what it needs, what the device has, what to change."""


def abstract_inputs(config, objective, abstract_state, state_sharding, mesh):
  """(train state, batch) as ShapeDtypeStructs placed as the trainer places them."""
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state,
                       state_sharding)
  batch_sh = sharding.batch_sharding(mesh)
  batch = {k: jax.ShapeDtypeStruct((config.batch_size, *shape), np.dtype(dtype), sharding=batch_sh)
           for k, (shape, dtype) in objective.features(config).items()}
  return state, batch


def _out_of_memory(error: Exception, what: str, kind: str, has: float) -> OutOfMemory | None:
  """The compiler's RESOURCE_EXHAUSTED as one line, else None."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  sizes = [f"{n}{unit}" for n, unit in re.findall(r"(\d+(?:\.\d+)?)([KMGT])\b", text)]
  needs = sizes[0] if sizes else "more than it has"
  available = f"{sizes[1]} available to XLA of " if len(sizes) > 1 else ""
  return OutOfMemory(f"{what} needs {needs} per device; a {kind} has {available}{has / GiB:.2f} GiB: {CHANGES}")


CHANGES = ("run --plan, or raise config.microbatches, set config.model.remat_policy=full, or shard the state "
           "with config.mesh.fsdp")


def compile_steps(config, topo: topology.Topology):
  """(the run's layout.Layout, train step memory.Compiled, eval step memory.Compiled or None without evals) for
  `topo`; OutOfMemory if either does not fit."""
  config = init_from.resolve(config)
  devices = list(topo.devices)
  checks.validate(config, len(devices), topo.hosts)
  lay = layout_lib.build(config, sharding.make_mesh(config, devices))
  objective, mesh, rules, state_sh = lay.objective, lay.mesh, lay.rules, lay.state_sharding
  state, batch = abstract_inputs(config, objective, lay.abstract_state, state_sh, mesh)
  has = topology.device_memory(topo.kind)
  # a scan (scanned layers, the microbatch loop) is counted once by cost_analysis; CUDA gives no count
  counts = topo.platform == "tpu" and not config.model.scan_layers and config.microbatches == 1
  results = []
  steps = [("the train step", step.make_train_step(lay.policy, objective, lay.tx, lay.lr_schedule, state_sh, mesh),
            (state, batch))]
  if config.eval_every:   # the trainer builds its evaluator only then
    steps.append(("the eval step",
                  step.make_eval_step(lay.policy, objective, state_sh["params"], mesh), (state["params"], batch)))
  target = layers.compiling_for("gpu" if topo.platform == "cuda" else "tpu")
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), target:   # jits built outside: they make arrays eagerly
    for what, jitted, args in steps:
      try:
        compiled = jitted.lower(*args).compile()
      except Exception as e:  # noqa: BLE001 - XLA raises its own runtime error type
        if "cuDNN not found" in str(e):
          raise ValueError(f"model.attention='cudnn' cannot be compiled for {topo.kind} on this host: {e} (the "
                           "compile-only CUDA plugin has no cuDNN library to lower cuDNN attention with)") from None
        oom = _out_of_memory(e, what, topo.kind, has)
        if oom is None:
          raise
        raise oom from None
      result = memory.measure(compiled, counts)
      if result.total > has:
        raise OutOfMemory(f"{what} needs {result.total / GiB:.2f} GiB per device; a {topo.kind} has "
                          f"{has / GiB:.2f} GiB: {CHANGES}")
      results.append(result)
  return lay, results[0], results[1] if len(results) > 1 else None


def report(lay: layout_lib.Layout, topo: topology.Topology, train: memory.Compiled,
           evaluate: memory.Compiled | None, mfu: float) -> dict:
  """The numbers a run's plan needs (module docstring), per device unless named otherwise."""
  config, objective, mesh = lay.config, lay.objective, lay.mesh
  n = len(topo.devices)
  est = memory.estimate(config, layout=lay)
  peak, peak_source = hardware.peak(list(topo.devices), config.peak_tflops)
  flops = objective.flops_per_example(config) * config.batch_size
  seconds = flops / (peak * mfu)
  steps = config.phase_end_step or config.total_steps
  days = steps * seconds / 86400
  rows = config.batch_size // (mesh.shape["data"] * mesh.shape["fsdp"])   # the batch is split over data x fsdp
  batch_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize * rows
                    for shape, dtype in objective.features(config).values())
  return {
      "topology": topo.name, "device_kind": topo.kind, "devices": n, "hosts": topo.hosts, "slices": topo.slices,
      "mesh": dict(mesh.shape), "microbatches": config.microbatches, "remat_policy": config.model.remat_policy,
      "scan_layers": bool(config.model.scan_layers), "attention": config.model.get("attention", "xla"),
      "memory_per_device": {
          "params": est.params, "optimizer_state": est.opt_state,
          "params_and_optimizer_compiled": train.arguments - batch_bytes - 4,   # 4: the int32 step counter
          "arguments": train.arguments, "batch": batch_bytes, "temporaries": train.temporaries,
          "code": train.code, "total": train.total, "eval_total": evaluate and evaluate.total,
          "device": topology.device_memory(topo.kind), "estimate_total": est.total},
      "flops_per_step": flops, "flops_per_device_ours": flops / n, "flops_per_device_xla": train.xla_flops,
      "peak_flops": peak, "peak_source": peak_source, "mfu": mfu,
      "step_seconds_at_peak": flops / peak, "step_seconds": seconds,
      "tokens_per_second": objective.tokens_per_example(config) * config.batch_size / seconds,
      "steps": steps, "days": days, "chip_days": days * n,
      "input": input_rate.plan(config, objective.tokens_per_example(config) * config.batch_size / seconds, topo.hosts),
  }


def format_report(r: dict) -> str:
  m = r["memory_per_device"]
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
  g = lambda b: f"{b / GiB:8.3f} GiB" if b >= GiB else f"{b / 2**20:8.2f} MiB"
  xla = r["flops_per_device_xla"]
  lines = [
      f"{r['topology']}: {r['devices']} x {r['device_kind']} ({r['hosts']} hosts, {r['slices']} slice(s)), mesh "
      f"{mesh}, microbatches {r['microbatches']}, remat {r['remat_policy']}, scan_layers {r['scan_layers']}, "
      f"attention {r['attention']}",
      "memory per device (train step, compiled):",
      f"  params             {g(m['params'])}   (their shardings)",
      f"  optimizer state    {g(m['optimizer_state'])}   (their shardings)",
      f"  arguments          {g(m['arguments'])}   (compiled: params + optimizer state "
      f"{m['params_and_optimizer_compiled'] / GiB:.3f} GiB, batch {m['batch'] / 2**20:.1f} MiB)",
      f"  temporaries        {g(m['temporaries'])}",
      f"  code               {g(m['code'])}",
      f"  total              {g(m['total'])}   of {m['device'] / GiB:.2f} GiB ({m['total'] / m['device']:.0%}); "
      + (f"eval step {m['eval_total'] / GiB:.3f} GiB; " if m["eval_total"] else "no eval step (eval_every=0); ")
      + f"lm_jax.plan.memory's estimate {m['estimate_total'] / GiB:.3f} GiB",
      f"FLOPs per step {r['flops_per_step']:.4g} (per device: ours {r['flops_per_device_ours']:.4g}, XLA "
      + (f"{xla:.4g})" if xla else "not counted: scan / microbatch loop or GPU)"),
      f"step {r['step_seconds_at_peak'] * 1e3:.3g} ms at peak ({r['peak_source']}), {r['step_seconds'] * 1e3:.3g} ms "
      f"at MFU {r['mfu']:.0%}: {r['tokens_per_second']:,.0f} tokens/s",
      f"{r['steps']:,} steps: {r['days']:.3g} days, {r['chip_days']:.3g} chip-days (at MFU {r['mfu']:.0%})",
      input_rate.describe(r["input"]),
  ]
  return "\n".join(lines)


# The compilers --mode=compile needs, from requirements-aot.txt: {platform: (module, package)}.
COMPILERS = {"tpu": ("libtpu", "libtpu"), "cuda": ("jax_plugins.xla_cuda12", "the compile-only CUDA plugin")}


def check_compiler(topology_name: str):
  """ConfigError (exit 2) naming the environment to use when this Python lacks the topology's compiler: JAX's own
  error is a 25-line traceback saying 'TPU support not installed'."""
  platform = "cuda" if topology.parse(topology_name)[0] in topology.GPUS else "tpu"
  module, package = COMPILERS[platform]
  if importlib.util.find_spec(module.partition(".")[0]) is None or importlib.util.find_spec(module) is None:
    raise config_lib.ConfigError(
        f"--mode=compile --topology={topology_name} needs {package}, which {sys.executable} lacks: run it with "
        ".venv-aot/bin/python (README.md, Install: python -m venv .venv-aot && .venv-aot/bin/pip install "
        "-r requirements.txt -r requirements-aot.txt)")


def run(config, topology_name: str, mfu: float = 0.4, json_path: str = "") -> dict:
  """--mode=compile: compiles, prints the report, writes it as JSON to json_path if given."""
  if not 0 < mfu <= 1:
    raise ValueError(f"--mfu={mfu} must be in (0, 1]")
  topo = topology.get(topology_name)
  lay, train, evaluate = compile_steps(config, topo)
  r = report(lay, topo, train, evaluate, mfu)
  print(format_report(r), flush=True)
  if json_path:
    with open(json_path, "w") as f:
      json.dump(r, f, indent=1)
  return r

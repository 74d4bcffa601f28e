"""The trainer: validate the config, build mesh, tokenizer and data, init or restore the sharded state,
run the jitted step with periodic logs, evals and checkpoints, stop cleanly on SIGTERM.

The hot loop never waits for the device: metrics stay on device and are fetched every log_every steps
(and before each checkpoint, to make sure no non-finite loss is ever saved).
"""
import functools
import math
import signal
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import checkpoint, evaluate, flops, metrics_log, models, objectives, optim, sharding, step
from lm_jax.data import pipeline, tokenizer as tokenizer_lib
from lm_jax.objectives import span_corruption

# Dense bf16 peak TFLOP/s per device, by substring of jax.Device.device_kind (first match wins).
PEAK_TFLOPS = (("TPU v2", 22.5), ("TPU v3", 61.5), ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
               ("TPU v5", 459.0), ("TPU v6", 918.0), ("H100", 989.0), ("H200", 989.0), ("B200", 2250.0),
               ("A100", 312.0), ("A10G", 125.0), ("L4", 121.0), ("V100", 125.0))


# ----------------------------------------------------------------------------------------------- config checks
def validate(config, num_devices: int, process_count: int = 1):
  """One-line ValueError / FileNotFoundError naming the field, before anything is built or compiled."""
  def require(ok, message):
    if not ok:
      raise ValueError(message)

  objectives.check(config)  # unknown objective, objective/family mismatch, seq_len vs positions, masking/noise
  models.validate(config.model)  # sizes, heads vs d_model, activation, dtypes, remat policy, dropout
  m, o = config.model, config.optimizer
  require(o.name in optim.OPTIMIZERS, f"config.optimizer.name={o.name!r} unknown; use {', '.join(optim.OPTIMIZERS)}")
  require(o.schedule in optim.SCHEDULES,
          f"config.optimizer.schedule={o.schedule!r} unknown; use {', '.join(optim.SCHEDULES)}")
  for field in ("total_steps", "microbatches", "log_every", "checkpoint_every", "batch_size"):
    require(config[field] >= 1, f"config.{field} must be >= 1, got {config[field]}")
  require(config.eval_every >= 0, f"config.eval_every must be >= 0, got {config.eval_every}")
  require(0 <= config.phase_end_step <= config.total_steps,
          f"config.phase_end_step={config.phase_end_step} must be in [0, total_steps={config.total_steps}] (0 = total_steps)")
  data, fsdp, tensor = sharding.mesh_shape(config, num_devices)
  require(m.num_heads % tensor == 0,
          f"config.model.num_heads={m.num_heads} is not divisible by config.mesh.tensor={tensor}")
  require(config.batch_size % process_count == 0,
          f"config.batch_size={config.batch_size} is not divisible by the {process_count} processes")
  shards = config.microbatches * data * fsdp
  require(config.batch_size % shards == 0,
          f"config.batch_size={config.batch_size} is not divisible by config.microbatches * mesh.data * mesh.fsdp "
          f"= {config.microbatches}*{data}*{fsdp} = {shards}")
  sharding.check_divisible(models.abstract_params(m), models.logical_axes(m),
                           dict(zip(sharding.AXES, (data, fsdp, tensor))), sharding.rules(config))


# ----------------------------------------------------------------------------------------------------- setup
def _state_sharding(config, tx, mesh, rules):
  """(abstract train state, its shardings) for this mesh."""
  abstract_params = models.abstract_params(config.model)
  logical = models.logical_axes(config.model)
  params_sh = sharding.logical_to_sharding(logical, mesh, rules)
  abstract = jax.eval_shape(lambda p: step.init_state(p, tx), abstract_params)
  opt_sh = sharding.opt_state_sharding(abstract["opt_state"], abstract_params, params_sh, mesh)
  return abstract, {"params": params_sh, "opt_state": opt_sh, "step": NamedSharding(mesh, P())}


def _init_state(config, tx, state_sh):
  key = jax.random.fold_in(jax.random.key(config.seed), 0)
  init = lambda k: step.init_state(models.init(config.model, k), tx)
  return jax.jit(init, out_shardings=state_sh)(key)


def _peak_flops(config, devices) -> float:
  """Total peak FLOP/s of the mesh: config.peak_tflops, the device table, or on CPU a measured f32 matmul."""
  kind = devices[0].device_kind
  if config.peak_tflops:
    return config.peak_tflops * 1e12 * len(devices)
  for name, tflops in PEAK_TFLOPS:
    if name in kind:
      return tflops * 1e12 * len(devices)
  return matmul_flops_per_s()  # CPU devices share the host's cores: one measurement is the whole machine


@functools.cache
def matmul_flops_per_s(n: int = 2048, dtype: str = "float32", repeats: int = 10) -> float:
  """Median rate of a jitted n^3 jnp.dot after 3 warm-ups: the CPU's MFU denominator here and the roofline
  of bench/train_step.py (a best-of-3 at 1024^3 wobbled by +-13% between runs)."""
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


def _flops_per_sequence(config) -> float:
  d = config.data
  target_len = span_corruption.target_len(config) if config.objective == "span_corruption" else 0
  preds = d.max_predictions_per_seq if config.objective == "mlm" else 0
  return flops.train_flops_per_sequence(config.model, d.seq_len, target_len, preds)


def _tokens_per_sequence(config) -> int:
  extra = span_corruption.target_len(config) if config.objective == "span_corruption" else 0
  return config.data.seq_len + extra


class _Preemption:
  """SIGTERM sets a flag; the loop saves after the current step and exits 0."""

  def __init__(self):
    self.requested = False
    self.previous = None

  def __enter__(self):
    try:
      self.previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread: leave signals alone
      pass
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)


def _any_process(flag: bool) -> bool:
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def _print(line: str):
  """Console output from process 0 only (every host runs this loop)."""
  if jax.process_index() == 0:
    print(line, flush=True)


def _to_host(metrics: list) -> list[dict]:
  return [{k: float(v) for k, v in m.items()} for m in jax.device_get(metrics)]


def _check_finite(host_metrics: list[dict], first_step: int, mngr):
  for i, m in enumerate(host_metrics):
    if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
      checkpoint.finish(mngr)
      last = mngr.latest_step()
      raise FloatingPointError(f"non-finite loss ({m['loss']}) or grad norm ({m['grad_norm']}) at step "
                               f"{first_step + i + 1}; not saved. Last good checkpoint: step {last}")


# ----------------------------------------------------------------------------------------------- entry points
def _setup(config, workdir, devices=None):
  """Validated config -> (objective, tokenizer, mesh, rules, tx, lr, abstract state, state shardings)."""
  metrics_log.quiet_libraries()
  devices = jax.devices() if devices is None else list(devices)
  validate(config, len(devices), jax.process_count())
  objective = objectives.get(config.objective, config)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizer_lib.load_or_train(config, workdir)
  mesh = sharding.make_mesh(config, devices)
  rules = sharding.rules(config)
  tx, lr = optim.make(config, models.logical_axes(config.model))
  abstract, state_sh = _state_sharding(config, tx, mesh, rules)
  return objective, tokenizer, mesh, rules, tx, lr, abstract, state_sh


def _eval_fn(config, objective, tokenizer, mesh, params_sh):
  """params -> eval record (without step), over the cached eval batches."""
  it = pipeline.make_eval_iterator(config, tokenizer, process_index=jax.process_index(),
                                   process_count=jax.process_count())
  batches = list(it)
  eval_step = step.make_eval_step(config, objective, params_sh, mesh)
  batch_sh = sharding.batch_sharding(mesh)

  def run(params):
    out = [eval_step(params, sharding.global_batch(b, batch_sh)) for b in batches]
    return evaluate.summarize(jax.device_get(out), it.bytes_per_token)
  return run


def train(config, workdir: str, *, devices=None) -> dict:
  """Trains (or resumes) to config.phase_end_step or total_steps. Returns {'step', 'train': last train
  record, 'eval': last eval record, 'state': final train state}."""
  objective, tokenizer, mesh, rules, tx, lr, abstract, state_sh = _setup(config, workdir, devices)
  peak = _peak_flops(config, list(mesh.devices.flat))
  end = config.phase_end_step or config.total_steps
  mngr = checkpoint.manager(workdir, config.keep_checkpoints)
  train_it = pipeline.make_train_iterator(config, tokenizer, process_index=jax.process_index(),
                                          process_count=jax.process_count())
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    restored = checkpoint.restore_latest(mngr, abstract, state_sh, config, with_data=True)
    latest = restored.step if restored else None
    if restored is None:
      state = _init_state(config, tx, state_sh)
    else:
      state, data_state, changes = restored.state, restored.data_state, restored.data_changes
      if not changes and len(data_state["processes"]) != jax.process_count():
        changes = [f"processes: {len(data_state['processes'])} -> {jax.process_count()}"]
      if changes:
        _print(f"resumed step {latest}; data config changed ({'; '.join(changes)}): fresh data iterator")
      else:
        train_it.set_state(data_state["processes"][jax.process_index()])
        _print(f"resumed step {latest} from {mngr.directory}")
    start = latest or 0
    log = metrics_log.MetricsLog(workdir, start)
    train_step = step.make_train_step(config, objective, tx, lr, state_sh, mesh)
    run_eval = _eval_fn(config, objective, tokenizer, mesh, state_sh["params"]) if config.eval_every else None
    batch_sh = sharding.batch_sharding(mesh)
    flops_per_seq = _flops_per_sequence(config)
    tokens_per_step = config.batch_size * _tokens_per_sequence(config)
    result = {"step": start, "train": None, "eval": None}
    pending, window_start, t_window, paused = [], start, time.perf_counter(), 0.0
    if start >= end:
      _print(f"nothing to do: checkpoint step {start} >= end step {end}")

    with _Preemption() as preemption:
      for s in range(start + 1, end + 1):
        state, metrics = train_step(state, sharding.global_batch(next(train_it), batch_sh))
        checkpoint.check_save(mngr)
        pending.append(metrics)
        last = s == end
        log_now = s % config.log_every == 0 or last or s == 1  # step 1: the initial loss, right after compiling
        stop = _any_process(preemption.requested) if (log_now or jax.process_count() == 1) else False
        if log_now:
          host = _to_host(pending)
          _check_finite(host, window_start, mngr)
          seconds = (time.perf_counter() - t_window - paused) / len(pending)
          last_metrics = host[-1]
          record = {"step": s, "loss": last_metrics.pop("loss"), "lr": last_metrics.pop("lr"), **last_metrics,
                    "tokens_per_sec": tokens_per_step / seconds,
                    "mfu": flops_per_seq * config.batch_size / seconds / peak}
          log.write(record)
          result["train"] = record
          _print(metrics_log.console(record, end, seconds))
          pending, window_start, t_window, paused = [], s, time.perf_counter(), 0.0
        t_pause = time.perf_counter()
        if run_eval and (s % config.eval_every == 0 or last):
          record = {"step": s, **run_eval(state["params"])}
          log.write(record)
          result["eval"] = record
          _print(metrics_log.console(record, end))
        if s % config.checkpoint_every == 0 or last or stop:
          _check_finite(_to_host(pending), window_start, mngr)
          checkpoint.save(mngr, s, state, checkpoint.data_state(train_it), config)
        paused += time.perf_counter() - t_pause  # evals and saves do not count against throughput
        result["step"] = s
        if stop:
          _print(f"SIGTERM: saved step {s}, exiting")
          break
    checkpoint.finish(mngr)
    mngr.close()
    log.close()
    train_it.close()
  result["state"] = state
  return result


def _restore_params(config, workdir):
  """(objective, tokenizer, mesh, rules, params_sharding, params, step) of the latest checkpoint."""
  objective, tokenizer, mesh, rules, _, _, abstract, state_sh = _setup(config, workdir)
  mngr = checkpoint.manager(workdir, config.keep_checkpoints)
  with jax.set_mesh(mesh):
    restored = checkpoint.restore_latest(mngr, abstract, state_sh, config, with_data=False)
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {mngr.directory}; train first (--mode=train)")
  mngr.close()
  return objective, tokenizer, mesh, rules, state_sh["params"], restored.state["params"], restored.step


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Held-out loss, perplexity, bits per byte and accuracies of the latest checkpoint; printed, then appended
  to metrics.jsonl (a workdir that cannot be written only warns)."""
  objective, tokenizer, mesh, rules, params_sh, params, latest = _restore_params(config, workdir)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    record = {"step": latest, **_eval_fn(config, objective, tokenizer, mesh, params_sh)(params)}
  _print(metrics_log.console(record, latest))
  metrics_log.MetricsLog(workdir, resume_step=10**12, tensorboard=False).write(record)  # no-op off process 0
  return record


def export_checkpoint(config, workdir: str, export_dir: str):
  """The latest checkpoint's params as a Hugging Face directory (lm_jax.export.save_hf)."""
  from lm_jax import export
  *_, params, latest = _restore_params(config, workdir)
  if jax.process_count() > 1:  # every host holds only its shards
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    export.save_hf(config.model, jax.device_get(params), export_dir)
  _print(f"exported step {latest} to {export_dir}")
  return export_dir

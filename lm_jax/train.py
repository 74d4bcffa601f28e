"""The trainer: config -> setup (objective, tokenizer, mesh, optimizer, state layout) -> init or restore ->
a loop of jitted steps with four schedules (log, eval, checkpoint, preemption) -> the final state.

The hot loop never waits for the device: metrics stay on device and are fetched every log_every steps
(and before each checkpoint, so no non-finite loss is ever saved).
"""
import dataclasses
import math
import os
import time
from typing import Callable

import jax
from etils import epath
from flax import linen as nn
from jax.sharding import Mesh

from lm_jax import (checkpoint, config_lib, finetune, hardware, init_from, metrics_log, objectives, predict, sharding,
                    step)
from lm_jax.data import pipeline, tokenizer as tokenizer_lib
from lm_jax.peft import lora


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything a run builds from its config before the first step."""
  config: object
  objective: objectives.Objective
  tokenizer: tokenizer_lib.Tokenizer
  mesh: Mesh
  rules: tuple
  tx: object                 # optax.GradientTransformation
  lr_schedule: Callable
  abstract_state: dict       # ShapeDtypeStructs of {params, opt_state, step}
  state_sharding: dict       # their NamedShardings on `mesh`


def setup(config, workdir: str, devices=None) -> Setup:
  """Validates the config (one-line errors before anything is built), then builds the run's parts. With
  config.init_from the model architecture and tokenizer are the pre-trained model's (init_from.resolve)."""
  metrics_log.quiet_libraries()
  config = init_from.resolve(config)
  devices = jax.devices() if devices is None else list(devices)
  config_lib.validate(config, len(devices), jax.process_count())
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizer_lib.load_or_train(config, workdir)
  mesh, rules = sharding.make_mesh(config, devices), sharding.rules(config)
  tx, lr, abstract, state_sh = step.state_layout(config, mesh, rules)
  return Setup(config, objectives.get(config.objective), tokenizer, mesh, rules, tx, lr, abstract, state_sh)


def _print(line: str):
  """Console output from process 0 only (every host runs the loop)."""
  if jax.process_index() == 0:
    print(line, flush=True)


def _hosts(kind: str, s: Setup, **kwargs):
  make = pipeline.make_train_iterator if kind == "train" else pipeline.make_eval_iterator
  return make(s.config, s.tokenizer, s.objective, process_index=jax.process_index(),
              process_count=jax.process_count(), **kwargs)


def make_evaluator(s: Setup) -> Callable:
  """params -> eval record (without step), over the eval batches, built once."""
  it = _hosts("eval", s)
  batches = list(it)
  eval_step = step.make_eval_step(s.config, s.objective, s.state_sharding["params"], s.mesh)
  return lambda params: predict.eval_record(s.objective, predict.eval_outputs(eval_step, params, batches, s.mesh),
                                            it.text_per_token)


def _init_or_restore(s: Setup, mngr, train_it):
  """(state, start step): the latest checkpoint with its data position, or a fresh state at step 0."""
  restored = checkpoint.restore_latest(mngr, s.abstract_state, s.state_sharding, s.config, with_data=True)
  if restored is None:
    state = step.fresh_state(s.config, s.tx, s.state_sharding)
    if s.config.init_from:   # pre-trained params; new heads keep the seeded init
      params, report = init_from.start_params(s.config, state["params"], s.mesh, s.rules, s.state_sharding["params"])
      state = dict(state, params=params)
      _print(report)
    return state, 0
  changes = restored.data_changes
  if restored.data_state is not None and "shards" not in restored.data_state:
    changes = ["data-iterator state of an older lm_jax"]
  if changes:
    _print(f"resumed step {restored.step}; data config changed ({'; '.join(changes)}): fresh data iterator")
  else:
    train_it.set_state(restored.data_state)
    _print(f"resumed step {restored.step} from {mngr.directory}")
  return restored.state, restored.step


# ------------------------------------------------------------------------------------- the loop's schedules
class _Meter:
  """Metrics of the steps since the last log (kept on device) and their wall time, evals and saves excluded."""

  def __init__(self, step: int):
    self.first_step, self.pending, self.start, self.paused = step, [], time.perf_counter(), 0.0

  def host_metrics(self) -> list[dict]:
    return [{k: float(v) for k, v in m.items()} for m in jax.device_get(self.pending)]

  def check_finite(self, mngr, host: list[dict] | None = None):
    """Raises before anything non-finite can be logged as fine or saved."""
    for i, m in enumerate(self.host_metrics() if host is None else host):
      if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
        checkpoint.finish(mngr)
        raise FloatingPointError(f"non-finite loss ({m['loss']}) or grad norm ({m['grad_norm']}) at step "
                                 f"{self.first_step + i + 1}; not saved. Last good checkpoint: step {mngr.latest_step()}")


def _log(s: Setup, meter: _Meter, step_: int, end: int, log, peak: float, mngr) -> tuple[dict, _Meter]:
  """Writes the train record of the last step (throughput over the window) and starts a new window."""
  host = meter.host_metrics()
  meter.check_finite(mngr, host)
  seconds = (time.perf_counter() - meter.start - meter.paused) / len(host)
  last, batch = host[-1], s.config.batch_size
  record = {"step": step_, "loss": last.pop("loss"), "lr": last.pop("lr"), **last,
            "tokens_per_sec": s.objective.tokens_per_example(s.config) * batch / seconds,
            "mfu": s.objective.flops_per_example(s.config) * batch / seconds / peak}
  log.write(record)
  _print(metrics_log.console(record, end, seconds))
  return record, _Meter(step_)


def _evaluate(run_eval, state, step_: int, end: int, log) -> dict:
  record = {"step": step_, **run_eval(state["params"])}
  log.write(record)
  _print(metrics_log.console(record, end))
  return record


def _loop(s: Setup, state, start: int, mngr, train_it, log) -> tuple[dict, dict]:
  """Steps start+1 .. end with the log / eval / checkpoint / preemption schedules. Returns (state, result)."""
  c = s.config
  end = c.phase_end_step or c.total_steps
  train_step = step.make_train_step(c, s.objective, s.tx, s.lr_schedule, s.state_sharding, s.mesh)
  run_eval = make_evaluator(s) if c.eval_every else None
  batch_sh, peak = sharding.batch_sharding(s.mesh), hardware.peak_flops(list(s.mesh.devices.flat), c.peak_tflops)
  result, meter = {"step": start, "train": None, "eval": None}, _Meter(start)
  best = checkpoint.Best(str(mngr.directory.parent), c) if run_eval and c.finetune.best_metric else None
  if start >= end:
    _print(f"nothing to do: checkpoint step {start} >= end step {end}")
  with checkpoint.Preemption() as preemption:
    for i in range(start + 1, end + 1):
      state, metrics = train_step(state, sharding.global_batch(next(train_it), batch_sh))
      checkpoint.check_save(mngr)   # a background save that failed stops the run now, in one line
      meter.pending.append(metrics)
      last, log_now = i == end, i % c.log_every == 0 or i == end or i == 1  # step 1: loss right after compiling
      stop = preemption.any_process() if (log_now or jax.process_count() == 1) else False
      if log_now:
        result["train"], meter = _log(s, meter, i, end, log, peak, mngr)
      t_pause = time.perf_counter()
      if run_eval and (i % c.eval_every == 0 or last):
        result["eval"] = _evaluate(run_eval, state, i, end, log)
        if best and best.offer(result["eval"], state, checkpoint.data_state(train_it), c):
          _print(f"best {c.finetune.best_metric} so far: step {i}, kept in {best.dir}")
      if i % c.checkpoint_every == 0 or last or stop:
        meter.check_finite(mngr)
        checkpoint.save(mngr, i, state, checkpoint.data_state(train_it), c)
      meter.paused += time.perf_counter() - t_pause
      result["step"] = i
      if stop:
        _print(f"SIGTERM: saved step {i}, exiting")
        break
  if best:
    best.close()
  return state, result


# ----------------------------------------------------------------------------------------------- entry points
def train(config, workdir: str, *, devices=None) -> dict:
  """Trains (or resumes) to config.phase_end_step or total_steps. Returns {'step', 'train': last train
  record, 'eval': last eval record, 'state': final train state}. An objective with a loop of its own (PPO) runs
  that instead."""
  loop = objectives.get(config.objective).loop
  if loop:
    return loop(config, workdir, devices=devices)
  s = setup(config, workdir, devices)
  trainable, total = finetune.trainable_count(s.config)
  _print(f"parameters: {trainable:,} trainable of {total:,}")
  mngr = checkpoint.manager(workdir, config.keep_checkpoints)
  train_it = _hosts("train", s)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    state, start = _init_or_restore(s, mngr, train_it)
    log = metrics_log.MetricsLog(workdir, start)
    state, result = _loop(s, state, start, mngr, train_it, log)
    checkpoint.finish(mngr)
    mngr.close()
    log.close()
    train_it.close()
  return {**result, "state": state}


def restore_params(config, workdir: str):
  """(setup, params placed on the mesh, step) of init_from.eval_source: the latest checkpoint in workdir, or without
  one config.init_from's model."""
  config, source = init_from.eval_source(config, workdir)
  s = setup(config, workdir if init_from.is_hf(source) else source)   # a run's tokenizer lives in its workdir
  return (s, *init_from.restore_params(s, source))


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Held-out metrics of the latest checkpoint (or of config.init_from): printed first, then appended to
  workdir/metrics.jsonl."""
  s, params, latest = restore_params(config, workdir)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    record = {"step": latest, **make_evaluator(s)(params)}
  _print(metrics_log.console(record, latest))
  metrics_log.MetricsLog(workdir, resume_step=10**12, tensorboard=False).write(record)  # no-op off process 0
  return record


def export_checkpoint(config, workdir: str, export_dir: str, merged: bool = False):
  """The latest checkpoint's params and the run's tokenizer as a Hugging Face directory (lm_jax.hf.export.save_hf).
  A LoRA run writes its base model there and its adapters in the PEFT format to export_dir/adapter, or with
  `merged` the model with the adapters merged in."""
  from lm_jax.hf import export
  from lm_jax.peft import peft_format
  s, params, latest = restore_params(config, workdir)
  if jax.process_count() > 1:  # every host holds only its shards
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    params = jax.device_get(params)
    plain = jax.device_get(lora.merged(s.config, params)) if merged else lora.base(s.config, params)
    export.save_hf(s.config.model, plain, export_dir, tokenizer=s.tokenizer)
    if lora.enabled(s.config) and not merged:
      peft_format.save(s.config, params, os.path.join(export_dir, "adapter"))
  _print(f"exported step {latest} to {export_dir}")
  return export_dir

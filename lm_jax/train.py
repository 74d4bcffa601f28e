"""The trainer: config -> setup (objective, tokenizer, mesh, optimizer, state layout) -> init or restore ->
a loop of jitted steps on the schedules every trainer shares (lm_jax.loop: log, eval, checkpoint, preemption,
resume) -> the final state. Dependencies: main and rlhf call it; it builds on loop, step, objectives, data,
sharding, checkpoint.
"""
import contextlib
import dataclasses
import os
import pathlib
import shutil
from typing import Callable

import jax
from etils import epath
from flax import linen as nn
from jax.experimental import multihost_utils

from lm_jax import (checkpoint, checks, config_lib, init_from, layout as layout_lib, loop, objectives,
                    params as params_lib, sharding, step, workdir_lock)
from lm_jax.data import pipeline, tokenizer as tokenizer_lib
from lm_jax.evals import lm_eval_adapter, predict
from lm_jax.hf import export
from lm_jax.obs import goodput, metrics_log
from lm_jax.plan import hardware, memory


@dataclasses.dataclass(frozen=True)
class Setup(layout_lib.Layout):
  """Everything a run builds from its config before the first step: its layout and its tokenizer."""
  tokenizer: tokenizer_lib.Tokenizer


def setup(config, workdir: str, devices=None, *, held: contextlib.ExitStack | None = None) -> Setup:
  """Validates the config (one-line errors before anything is built), then builds the run's parts. With
  config.init_from the model architecture and tokenizer are the pre-trained model's (init_from.resolve). A trainer
  passes `held`, the stack its run holds: the workdir's lock (lm_jax.workdir_lock) goes into it once the config is
  valid and before anything is written there, so a mistaken config leaves no trace and a second run writes nothing."""
  metrics_log.quiet_libraries()
  config = init_from.resolve(config)
  devices = jax.devices() if devices is None else list(devices)
  checks.validate(config, len(devices), jax.process_count())
  lm_eval_adapter.check(config)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  if held is not None:
    held.enter_context(workdir_lock.hold(workdir))
  tokenizer = tokenizer_lib.load_or_train(config, workdir)
  layout = layout_lib.build(config, sharding.make_mesh(config, devices))
  return Setup(**vars(layout), tokenizer=tokenizer)


def _hosts(kind: str, s: Setup, **kwargs):
  make = pipeline.make_train_iterator if kind == "train" else pipeline.make_eval_iterator
  return make(s.config, s.tokenizer, s.objective, process_index=jax.process_index(),
              process_count=jax.process_count(), **kwargs)


def make_evaluator(s: Setup) -> Callable:
  """(params, step or None) -> eval record (without step), over the eval batches, built once; with
  config.eval.lm_eval_tasks also the tasks' metrics at the steps lm_eval_adapter.due names (None: always)."""
  it = _hosts("eval", s)
  batches = list(it)
  eval_step = step.make_eval_step(s.policy, s.objective, s.state_sharding["params"], s.mesh)
  harness = lm_eval_adapter.Harness(s.config, s.tokenizer) if s.config.eval.lm_eval_tasks else None

  def evaluate(params, i=None):
    outputs = predict.eval_outputs(eval_step, params, batches, s.mesh)
    record = predict.eval_record(s.objective, outputs, it.text_per_token)
    for name, (part, per_token) in it.sources.items():   # a data mixture: each source's metrics too
      own = predict.eval_record(s.objective, outputs[part], per_token)
      record.update({f"eval_{name}_{k.removeprefix('eval_')}": v for k, v in own.items()})
    if harness and (i is None or lm_eval_adapter.due(s.config, i)):
      record.update(harness(params))
    return record
  return evaluate


def _init_or_restore(s: Setup, mngr, train_it):
  """(state, start step): the latest checkpoint with its data position, or a fresh state at step 0."""
  restored = checkpoint.restore_latest(mngr, s.abstract_state, s.state_sharding, s.config, with_data=True)
  if restored is None:
    state = step.fresh_state(s.policy, s.tx, s.state_sharding)
    if s.config.init_from:   # pre-trained params; new heads keep the seeded init
      params, report = init_from.start_params(s.config, state["params"], s.mesh, s.rules, s.state_sharding["params"])
      state = dict(state, params=params)
      loop.say(report)
    return state, 0
  return restored.state, loop.resume(restored, mngr.directory, train_it)


def _record(s: Setup, peak: float) -> Callable:
  """(window's host metrics, seconds per step) -> log record: the last step's metrics, the window's throughput."""
  tokens, flops = (s.config.batch_size * f(s.config) for f in (s.objective.tokens_per_example,
                                                               s.objective.flops_per_example))

  device = next(d for d in s.mesh.devices.flat if d.process_index == jax.process_index())   # this host's

  def record(host: list[dict], seconds: float) -> dict:
    last = dict(host[-1])
    return {"loss": last.pop("loss"), "lr": last.pop("lr"), **last, "tokens_per_sec": tokens / seconds,
            "mfu": flops / seconds / peak, **memory.device_stats(device)}
  return record


def _loop(s: Setup, state, start: int, mngr, train_it, log, ledger) -> tuple[dict, dict]:
  """Steps start+1 .. end on the log / eval / checkpoint / preemption schedules (lm_jax.loop)."""
  c = s.config
  train_step = compile_train_step(s)
  evaluator = make_evaluator(s) if c.eval_every else None
  batch_sh = sharding.batch_sharding(s.mesh)
  peak, source = hardware.peak(list(s.mesh.devices.flat), c.peak_tflops)
  loop.say(hardware.describe(peak, source))
  data_state = lambda: checkpoint.data_state(train_it)
  schedules = loop.Schedules(
      c, mngr, log, _record(s, peak), save=lambda i, state: checkpoint.save(mngr, i, state, data_state(), c),
      ledger=ledger, data_state=data_state,
      evaluate=(lambda state: evaluator(state["params"], int(state["step"]))) if evaluator else None,
      tokens_per_step=c.batch_size * s.objective.tokens_per_example(c),
      best=checkpoint.Best(str(mngr.directory.parent), c) if evaluator and c.finetune.best_metric else None)
  batches = ledger.waited(train_it)   # the time in next() is the data wait
  train_one = lambda state, i: train_step(state, sharding.global_batch(next(batches), batch_sh))
  return loop.run(schedules, train_one, state, start, c.phase_end_step or c.total_steps)


def compile_train_step(s: Setup) -> Callable:
  """The train step, compiled once at its first call (inside the first step's window, where the time split books
  compilations) from that call's arguments; its per-device memory is printed then, next to lm_jax.plan.memory's
  estimate, and the compiled executable runs every step."""
  jitted = step.make_train_step(s.policy, s.objective, s.tx, s.lr_schedule, s.state_sharding, s.mesh)
  compiled = []

  def train_step(state, batch):
    if not compiled:
      compiled.append(jitted.lower(state, batch).compile())
      est = memory.estimate(s.config, layout=s)
      loop.say(memory.compiled_line(memory.measure(compiled[0], counts_flops=False), est))
    return compiled[0](state, batch)
  return train_step


# ----------------------------------------------------------------------------------------------- entry points
def train(config, workdir: str, *, devices=None) -> dict:
  """Trains (or resumes) to config.phase_end_step or total_steps. Returns {'step', 'train': last train
  record, 'eval': last eval record, 'state': final train state}. An objective that trains on its own rollouts
  (PPO) has a trainer of its own: lm_jax.rlhf.ppo.train."""
  if objectives.get(config.objective).rollouts:
    raise ValueError(f"config.objective={config.objective!r} trains on rollouts: lm_jax.rlhf.ppo.train runs it "
                     "(python -m lm_jax.main picks it)")
  with contextlib.ExitStack() as held:   # one run per workdir
    return _train(config, workdir, devices, held)


def _train(config, workdir: str, devices, held: contextlib.ExitStack) -> dict:
  ledger = goodput.Ledger()
  s = setup(config, workdir, devices, held=held)
  trainable, total = params_lib.count(s.policy)
  loop.say(f"parameters: {trainable:,} trainable of {total:,}")
  mngr = checkpoint.manager(workdir, config.keep_checkpoints)
  train_it = _hosts("train", s)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    with ledger.timing("restore"):
      state, start = _init_or_restore(s, mngr, train_it)
    log = metrics_log.MetricsLog(workdir, start, config=s.config)
    state, result = _loop(s, state, start, mngr, train_it, log, ledger)
    with ledger.timing("checkpoint"):
      checkpoint.finish(mngr)
    mngr.close()
    loop.finish(log, ledger)
    train_it.close()
  return {**result, "state": state}


@contextlib.contextmanager
def removed_if_unused(workdir: str):
  """Removes `workdir` when the block fails and the workdir did not exist before it and holds no result yet (no
  checkpoint step, no metrics record): a run that stops at start leaves no run.lock, empty checkpoints/ or trained
  tokenizer behind, so the corrected command starts afresh. Process 0 removes; remote workdirs are left alone."""
  created = "://" not in workdir and not os.path.lexists(workdir)
  try:
    yield
  except BaseException:
    if created and jax.process_index() == 0 and os.path.isdir(workdir) and not _has_results(workdir):
      shutil.rmtree(workdir, ignore_errors=True)
    raise


def _has_results(workdir: str) -> bool:
  metrics = os.path.join(workdir, "metrics.jsonl")
  return _holds_run_steps(pathlib.Path(workdir)) or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


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
  loop.say(metrics_log.console(record, latest))
  metrics_log.MetricsLog(workdir, resume_step=10**12, tensorboard=False).write(record)  # no-op off process 0
  return record


def export_checkpoint(config, workdir: str, export_dir: str, merged: bool = False, overwrite: bool = False):
  """The latest checkpoint's params and the run's tokenizer as a Hugging Face directory (lm_jax.hf.export.save_hf).
  An adapter run (LoRA, IA³) writes its base model there and its adapters in the PEFT format to export_dir/adapter,
  or with `merged` the model with the adapters merged in. Atomic (export.writing): a non-empty export_dir is refused
  before anything is read, unless `overwrite` replaces it whole; one that is or holds a run never is
  (_check_export_target)."""
  _check_export_target(config, workdir, export_dir, overwrite)
  export.check_target(export_dir, overwrite)
  s, params, latest = restore_params(config, workdir)
  if jax.process_count() > 1:  # every host holds only its shards
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    params = jax.device_get(params)
    plain = jax.device_get(params_lib.folded(s.policy, params)) if merged else params_lib.base(s.policy, params)
    with export.writing(export_dir, overwrite) as out:
      export.save_hf(s.config.model, plain, out, tokenizer=s.tokenizer)
      if not merged:
        params_lib.save_adapter(s.policy, params, os.path.join(out, "adapter"))
  loop.say(f"exported step {latest} to {export_dir}")
  return export_dir


def _check_export_target(config, workdir: str, export_dir: str, overwrite: bool):
  """ConfigError for an export_dir that would replace a run: the run's workdir, one holding it, its init_from or
  adapter (nothing writes into them), a folder inside a run's checkpoints/, or with `overwrite` a folder holding any
  run (its run.lock or a checkpoint anywhere in it). Real paths: a symlink or '..' spells the same folder."""
  target = os.path.realpath(export_dir)
  sources = {"the run's own workdir": workdir, "config.init_from": config.init_from,
             **{f"config.{g}.init_from": config[g].init_from for g in params_lib.ADAPTER_GROUPS}}
  for what, path in sources.items():
    if path and "://" not in path and _within(os.path.realpath(path), target):
      raise config_lib.ConfigError(f"--export_dir={export_dir} would replace {what} {path}; choose another "
                                   "--export_dir")
  for folder in (pathlib.Path(target), *pathlib.Path(target).parents):
    if folder.name == "checkpoints" and _holds_run(folder.parent, []):
      raise config_lib.ConfigError(f"--export_dir={export_dir} is inside the checkpoints of the run in "
                                   f"{folder.parent}; choose another --export_dir")
  if overwrite:   # without it a non-empty export_dir is refused anyway (export.check_target)
    for folder, _, files in os.walk(target):
      if _holds_run(pathlib.Path(folder), files):
        raise config_lib.ConfigError(f"--export_dir={export_dir} --overwrite would replace the run in {folder}; "
                                     "choose another --export_dir")


def _holds_run(folder: pathlib.Path, files: list[str]) -> bool:
  """Whether `folder` is a run's workdir: its lock file (files: os.walk's listing, else looked up) or a step."""
  return workdir_lock.NAME in files or (folder / workdir_lock.NAME).exists() or _holds_run_steps(folder)


def _holds_run_steps(folder: pathlib.Path) -> bool:
  """Whether folder/checkpoints holds a step folder, complete or not (a run that never finished a save is a run)."""
  steps = folder / "checkpoints"
  return steps.is_dir() and any(p.name.split(".")[0].isdigit() for p in steps.iterdir())


def _within(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or inside it (both real paths)."""
  return os.path.commonpath([path, folder]) == folder

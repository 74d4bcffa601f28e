"""The trainer: config -> setup (objective, tokenizer, mesh, params policy, optimizer, state layout) -> init or
restore -> a loop of jitted steps on the schedules every trainer shares, inside its session (lm_jax.loop: log, eval,
checkpoint, preemption, resume, teardown) -> the final state. The read-only modes read a run back elsewhere:
evals/run_eval.py (eval, restore) and checkpoint_export.py (export). Dependencies: main, rlhf and evals.run_eval
call it; it builds on loop, step, objectives, data, sharding, checkpoint.
"""
import contextlib
import dataclasses
from typing import Callable

import jax
from etils import epath

from lm_jax import (checkpoint, checks, init_from, layout as layout_lib, loop, models, objectives, params as params_lib,
                    sharding, step, workdir_lock)
from lm_jax.data import pipeline, tokenizer as tokenizer_lib
from lm_jax.evals import lm_eval_adapter, predict
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
  tokenizer = tokenizer_lib.load_or_train(config, workdir, models.family(config.model))
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


def _record(s: Setup, peak: float, train_it) -> Callable:
  """(window's host metrics, seconds per step) -> log record: the last step's metrics, the window's throughput, the
  bad records skipped so far."""
  tokens, flops = (s.config.batch_size * f(s.config) for f in (s.objective.tokens_per_example,
                                                               s.objective.flops_per_example))

  device = next(d for d in s.mesh.devices.flat if d.process_index == jax.process_index())   # this host's

  def record(host: list[dict], seconds: float) -> dict:
    last = dict(host[-1])
    return {"loss": last.pop("loss"), "lr": last.pop("lr"), **last, "tokens_per_sec": tokens / seconds,
            "mfu": flops / seconds / peak, **memory.device_stats(device), **pipeline.skipped(train_it)}
  return record


def _loop(s: Setup, state, start: int, run: loop.Session, train_it) -> tuple[dict, dict]:
  """Steps start+1 .. end on the log / eval / checkpoint / preemption schedules (lm_jax.loop)."""
  c, mngr, ledger = s.config, run.mngr, run.ledger
  train_step = compile_train_step(s)
  evaluator = make_evaluator(s) if c.eval_every else None
  batch_sh = sharding.batch_sharding(s.mesh)
  peak, source = hardware.peak(list(s.mesh.devices.flat), c.peak_tflops)
  loop.say(hardware.describe(peak, source))
  data_state = lambda: checkpoint.data_state(train_it)
  schedules = loop.Schedules(
      c, mngr, run.log, _record(s, peak, train_it),
      save=lambda i, state: checkpoint.save(mngr, i, state, data_state(), c), ledger=ledger, data_state=data_state,
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
  with loop.session(workdir, s, ledger) as run:
    train_it = run.closes(_hosts("train", s))
    with ledger.timing("restore"):
      state, start = _init_or_restore(s, run.mngr, train_it)
    run.open_log(start)
    state, result = _loop(s, state, start, run, train_it)
  return {**result, "state": state}

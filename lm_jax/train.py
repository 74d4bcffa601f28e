"""The trainer: config -> setup (lm_jax.setup: objective, tokenizer, mesh, params policy, optimizer, state layout)
-> init or restore -> a loop of jitted steps on the schedules every trainer shares, inside its session (lm_jax.loop:
log, eval, checkpoint, preemption, resume, teardown) -> the final state; its evaluators, evals/evaluators.py. The
read-only modes read a run back elsewhere: evals/run_eval.py (eval, restore) and checkpoint_export.py (export).
Dependencies: main and rlhf call it; it builds on setup, loop, step, objectives, data, sharding, checkpoint.
"""
import contextlib
from typing import Callable

import jax

from lm_jax import checkpoint, config_lib, init_from, loop, objectives, optim, params as params_lib, sharding, step
from lm_jax.data import pipeline
from lm_jax.evals import evaluators
from lm_jax.obs import goodput
from lm_jax.plan import hardware, memory
from lm_jax.setup import Setup, setup


def _train_iterator(s: Setup):
  return pipeline.make_train_iterator(s.config, s.tokenizer, s.objective, process_index=jax.process_index(),
                                      process_count=jax.process_count())


def _init_or_restore(s: Setup, mngr, train_it):
  """(state, start step): the latest checkpoint with its data position, or a fresh state at step 0."""
  restored = checkpoint.restore_latest(mngr, s.abstract_state, s.state_sharding, s.config, with_data=True)
  if restored is None and optim.branches_cooldown(s.config) and not init_from.is_hf(s.config.init_from):
    own = s.config.data.tokenizer.startswith(s.config.init_from)   # the one the stable run trained: no data change
    config = config_lib.replaced(s.config, {"data.tokenizer": ""}) if own else s.config
    source = checkpoint.manager(s.config.init_from, 1, read_only=True)   # WSD: the stable run's state, step, data
    try:
      restored = optim.check_branch(s.config, checkpoint.restore_latest(source, s.abstract_state, s.state_sharding,
                                                                        config, with_data=True))
    finally:
      source.close()
    return restored.state, loop.resume(restored, source.directory, train_it)
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
  evaluator = evaluators.make(s) if c.eval_every else None
  batch_sh = sharding.batch_sharding(s.mesh)
  peak, source = hardware.peak(list(s.mesh.devices.flat), c.peak_tflops)
  loop.say(hardware.describe(peak, source))
  data_state = lambda: checkpoint.data_state(train_it)
  schedules = loop.Schedules(
      c, mngr, run.log, _record(s, peak, train_it),
      save=lambda i, state: checkpoint.save(mngr, i, state, data_state(), c), ledger=ledger, data_state=data_state,
      evaluate=(lambda state: evaluator(optim.eval_params(state, s.policy.trainable), int(state["step"])))
      if evaluator else None,
      tokens_per_step=c.batch_size * s.objective.tokens_per_example(c),
      best=checkpoint.Best(str(mngr.directory.parent), c) if evaluator and c.finetune.best_metric else None)
  batches = ledger.waited(train_it)   # the time in next() is the data wait
  if jax.process_count() == 1:   # the compiled step places the numpy rows by its own input sharding: a third of
    train_one = lambda state, i: train_step(state, next(batches))   # device_put's host time (bench/README.md)
  else:
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
    train_it = run.closes(_train_iterator(s))
    with ledger.timing("restore"):
      state, start = _init_or_restore(s, run.mngr, train_it)
    run.open_log(start)
    state, result = _loop(s, state, start, run, train_it)
  return {**result, "state": state}

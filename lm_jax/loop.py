"""The schedules every training loop shares, written once: lm_jax.train runs its jitted steps on them and
lm_jax.rlhf.ppo its PPO iterations.

A step's outputs are a new state and its metrics. The loop keeps the metrics on device and fetches them every
config.log_every steps (and before each checkpoint, so nothing non-finite is ever saved): between logs it never
waits for the device. It writes the log record and console line, evaluates every config.eval_every steps (offering
each eval to the best-checkpoint hook), checkpoints every config.checkpoint_every steps, at the end and on SIGTERM,
and says where a run resumed.

Each train record splits its window's wall time (lm_jax.obs.goodput): step, data wait, host overhead, eval, checkpoint
and compilation, in {name}_s fields. Throughput is the steps' wall time over the window (data wait and compilation
included), with evaluations, saves and the loop's own work left out. A pause first waits for the steps still queued on
the device: their time is step time, not pause (without the wait, an eval's window would report the queued steps' work
done in no time). config.profile traces chosen steps (lm_jax.obs.profiling).

What every trainer sets up around its loop and tears down after it is one context manager, `session`: the mesh and
logical rules, the checkpoint managers, the goodput ledger, the metrics log, and at a clean end the final saves
awaited, the managers closed, the goodput line and the log closed, the data iterators closed. (The workdir's lock is
taken earlier, by lm_jax.setup, once the config is valid.) SIGTERM is handled by `Preemption` inside `run`.

Dependencies: checkpoint, goodput, metrics_log, profiling; the trainers (train, rlhf) build on this module.
"""
import contextlib
import dataclasses
import math
import signal
import time
from typing import Callable

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import multihost_utils

from lm_jax import checkpoint, distributed
from lm_jax.obs import goodput, metrics_log, profiling


def say(line: str):
  """Console output from process 0 only (every host runs the loop)."""
  if distributed.is_lead():
    print(line, flush=True)


def resume(restored: checkpoint.Restored, directory, data_it=None, unit: str = "step") -> int:
  """Puts data_it (None: a loop without a data stream) where the restored run left it, or says why it starts fresh,
  and prints where the run resumed. Returns the restored step."""
  changes = restored.data_changes if data_it else []
  if changes:
    say(f"resumed {unit} {restored.step}; data config changed ({'; '.join(changes)}): fresh data iterator")
  else:
    if data_it and restored.data_state:
      data_it.set_state(restored.data_state)
    say(f"resumed {unit} {restored.step} from {directory}")
  return restored.step


class Meter:
  """The steps since the last log: their metrics (device arrays until fetched) and the window's time split."""

  def __init__(self, step: int, ledger: goodput.Ledger, start: float | None = None):
    self.first_step, self.pending, self.window = step, [], goodput.Window(ledger, start)

  def fetch(self) -> list[dict]:
    return [{k: float(v) for k, v in m.items()} for m in jax.device_get(self.pending)]

  def close(self, now: float) -> tuple[float, dict]:
    """(seconds per step: the window's wall time less eval, checkpoint and host, its time split); once per window."""
    split = self.window.split(now)
    paused = sum(split[f"{k}_s"] for k in ("eval", "checkpoint", "host"))
    return (now - self.window.start - paused) / len(self.pending), split

  @contextlib.contextmanager
  def pause(self, what: str):
    """Books the block as `what`, after the queued steps have finished (they are step time)."""
    jax.block_until_ready(self.pending)
    with self.window.ledger.timing(what):
      yield


def check_finite(host: list[dict], first_step: int, mngr, unit: str = "step"):
  """Raises before anything non-finite can be logged as fine or saved (host: the metrics of steps first_step+1...)."""
  for i, metrics in enumerate(host):
    bad = [f"{k} ({v})" for k, v in metrics.items() if not math.isfinite(v)]
    if bad:
      checkpoint.finish(mngr)
      raise FloatingPointError(f"non-finite {', '.join(bad)} at {unit} {first_step + i + 1}; not saved. Last good "
                               f"checkpoint: {unit} {mngr.latest_step()}")


@dataclasses.dataclass
class Schedules:
  """A trainer's part in the schedules; records and eval results come without their step, which run() adds."""
  config: object
  mngr: object                  # the run's checkpoint manager (check_finite reports its latest step)
  log: metrics_log.MetricsLog
  record: Callable              # (host metrics of the window's steps, seconds per step) -> the log record
  save: Callable                # (step, state) -> None: the step's checkpoint(s)
  ledger: goodput.Ledger        # the trainer's time, from its start: run() books the loop's part
  data_state: Callable = dict   # () -> the data position the best checkpoint keeps
  evaluate: Callable | None = None   # state -> eval record
  best: checkpoint.Best | None = None
  unit: str = "step"            # what the messages count: step, iteration
  tokens_per_step: int = 0      # > 0: train records count the run's tokens so far in `tokens`


def run(s: Schedules, step: Callable, state, start: int, end: int) -> tuple[object, dict]:
  """state, metrics = step(state, i) for i = start+1 .. end on the schedules -> (state, {'step', 'train': last log
  record, 'eval': last eval record})."""
  c, unit, ledger = s.config, s.unit, s.ledger
  result, meter = {"step": start, "train": None, "eval": None}, Meter(start, ledger)
  profiler = profiling.Profiler(c, s.log.workdir, start)
  if start >= end:
    say(f"nothing to do: checkpoint {unit} {start} >= end {unit} {end}")
  with Preemption() as preemption:
    for i in range(start + 1, end + 1):
      with profiler.step(i):
        state, metrics = step(state, i)
      meter.pending.append(metrics)
      last, log_now = i == end, i % c.log_every == 0 or i == end or i == 1  # step 1: loss right after compiling
      if profiler.ends(i):
        jax.block_until_ready(state)   # the range's device work is in the trace (and is step time)
        with ledger.timing("host"):
          profiler.stop()
      with ledger.timing("host"):
        checkpoint.check_save(s.mngr)   # a background save that failed stops the run now, in one line
        stop = preemption.any_process() if (log_now or jax.process_count() == 1) else False
      if log_now:
        host, now = meter.fetch(), time.perf_counter()
        seconds, split = meter.close(now)
        meter = Meter(i, ledger, now)
        with ledger.timing("host"):
          check_finite(host, i - len(host), s.mngr, unit)
          tokens = {"tokens": i * s.tokens_per_step} if s.tokens_per_step else {}
          result["train"] = {"step": i, **s.record(host, seconds), **tokens, **split}
          s.log.write(result["train"])
          say(metrics_log.console(result["train"], end, seconds))
      evaluate_now = s.evaluate is not None and (i % c.eval_every == 0 or last)
      save_now = i % c.checkpoint_every == 0 or last or stop
      if evaluate_now:
        with meter.pause("eval"):
          result["eval"] = _evaluate(s, state, i, end)
      if save_now:
        check_finite(meter.fetch(), meter.first_step, s.mngr, unit)
        with meter.pause("checkpoint"):
          s.save(i, state)
      result["step"] = i
      if stop:
        say(f"{preemption.signal_name or 'a stop on another host'}: saved {unit} {i}, exiting")
        break
  if profiler.tracing:   # the run ended inside the profiled range
    jax.block_until_ready(state)
    with ledger.timing("host"):
      profiler.stop()
  meter.window.split(time.perf_counter())   # the last window's step time, for the goodput line
  if s.best:
    s.best.close()
  return state, result


class Session:
  """What a trainer's run holds from its restore to its end (made by `session`)."""

  def __init__(self, workdir: str, config, ledger: goodput.Ledger):
    self.workdir, self.config, self.ledger, self.log = workdir, config, ledger, None
    self.mngr = checkpoint.manager(workdir, config.keep_checkpoints)   # the run's checkpoints
    self._managers, self._closing = [self.mngr], []

  def adopt(self, mngr):
    """Another checkpoint manager of the run (PPO's policy workdir): its saves awaited and closed at the end."""
    self._managers.append(mngr)
    return mngr

  def closes(self, thing):
    """A data iterator (or None) to close at the end."""
    if thing is not None:
      self._closing.append(thing)
    return thing

  def open_log(self, start: int) -> metrics_log.MetricsLog:
    """The run's metrics log, from `start` (the restored step: later records of an earlier run are dropped)."""
    self.log = metrics_log.MetricsLog(self.workdir, start, config=self.config)
    return self.log

  def _end(self):
    for mngr in self._managers:
      with self.ledger.timing("checkpoint"):
        checkpoint.finish(mngr)
      mngr.close()
    summary = self.ledger.summary()
    say(goodput.line(summary))   # on the console; its numbers in W&B's summary
    self.log.close(summary)
    for thing in self._closing:
      thing.close()


@contextlib.contextmanager
def session(workdir: str, s, ledger: goodput.Ledger | None = None):
  """A trainer's run in `workdir` on s (its layout: config, mesh, rules): yields its Session inside the mesh and
  logical rules. On a clean exit the final saves are awaited and every manager, the log (after the goodput line)
  and the data iterators are closed; an error leaves them as a crash would (the saves already complete are kept).
  ledger: the run's time from its start (default: from here)."""
  run = Session(workdir, s.config, ledger or goodput.Ledger())
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    yield run
    run._end()


class Preemption:
  """SIGTERM (a preemption notice), SIGHUP (the terminal or ssh session closed) or a first Ctrl-C (SIGINT) sets a
  flag; the trainer saves after the current step and exits 0. A second Ctrl-C interrupts at once
  (KeyboardInterrupt). Without this, Ctrl-C raised wherever the interpreter was, and inside JAX's garbage-collection
  callback it was swallowed: the run went on; SIGHUP killed the run unsaved."""

  SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

  def __init__(self):
    self.requested, self.signal_name, self._previous = False, "", {}

  def __enter__(self):
    try:
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    except ValueError:  # not the main thread: leave signals alone
      pass
    return self

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, self._previous[signal.SIGINT])   # the next Ctrl-C interrupts at once
      say("\nCtrl-C: saving after this step, then exiting (Ctrl-C again to stop without saving)")
    self.requested, self.signal_name = True, self.signal_name or signal.Signals(signum).name

  def __exit__(self, *exc):
    for s, previous in self._previous.items():
      signal.signal(s, previous)

  def any_process(self) -> bool:
    """Whether any host received SIGTERM, SIGHUP or Ctrl-C (all hosts must stop at the same step)."""
    if jax.process_count() == 1:
      return self.requested
    return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


def _evaluate(s: Schedules, state, i: int, end: int) -> dict:
  record = {"step": i, **s.evaluate(state)}
  s.log.write(record)
  say(metrics_log.console(record, end))
  if s.best and s.best.offer(record, state, s.data_state(), s.config):
    say(f"best {s.best.metric} so far: {s.unit} {i}, kept in {s.best.dir}")
  return record

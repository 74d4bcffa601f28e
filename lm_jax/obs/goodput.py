"""Where a run's wall time goes: a ledger of seconds by what they went to, the time split of each log window, and
the goodput line that ends a run: productive step time over wall time, and what the rest went to (goodput as
MaxText's ml-goodput-measurement and Levanter report it).

The ledger starts when the trainer starts. What it books:
  data        waiting for the next batch (the time in next() of the training iterator, Ledger.waited)
  eval        evaluations, after the steps queued on the device have finished (those are step time)
  checkpoint  saves, and the wait for the last background save at the end
  restore     restoring the latest checkpoint or initialising a fresh state
  host        the loop's own work: log records, console, TensorBoard / W&B, the preemption check, profile traces
  compile     tracing, lowering and XLA compilation wherever they happen (jax.monitoring's compile events), taken
              out of the category they happened in
  step        the rest of the loop: dispatching steps and waiting for the device (the productive time)
  setup       the rest of the wall time: config, tokenizer, data iterators, evaluator, closing

Dependencies: none in lm_jax; loop, train and rlhf use it.
"""
import collections
import contextlib
import datetime
import time

import jax

# jax.monitoring's duration events of one compilation: trace to jaxpr, lower to MLIR, XLA compile (sequential).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
SPLIT = ("step", "data", "host", "eval", "checkpoint", "compile")   # a log record's {name}_s fields, in this order


class Ledger:
  """The run's seconds by category (module docstring), from construction to summary()."""

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._heard)

  def _heard(self, event: str, seconds: float, **_):
    if event in COMPILE_EVENTS:
      self.seconds["compile"] += seconds

  @contextlib.contextmanager
  def timing(self, what: str):
    """Books the block's wall time as `what`, less any compilation inside it (booked as compile)."""
    start, compiled = time.perf_counter(), self.seconds["compile"]
    try:
      yield
    finally:
      self.seconds[what] += time.perf_counter() - start - (self.seconds["compile"] - compiled)

  def waited(self, iterator):
    """iterator's items; the time spent in next() is booked as data (and marked in profile traces)."""
    while True:
      with self.timing("data"), jax.profiler.TraceAnnotation("data_wait"):
        try:
          item = next(iterator)
        except StopIteration:
          return
      yield item

  def summary(self) -> dict:
    """{'goodput': step / wall, 'wall_s', '{category}_s', ...}; stops listening for compilations."""
    jax.monitoring.unregister_event_duration_listener(self._heard)
    wall = time.perf_counter() - self.start
    spent = {k: v for k, v in self.seconds.items() if v > 0}
    spent["setup"] = max(wall - sum(spent.values()), 0.0)
    return {"goodput": spent.get("step", 0.0) / wall, "wall_s": wall, **{f"{k}_s": v for k, v in spent.items()}}


class Window:
  """The ledger's bookings since `start` (one log window): split() closes it and books its rest as step."""

  def __init__(self, ledger: Ledger, start: float | None = None):
    self.ledger, self.booked = ledger, ledger.seconds.copy()
    self.start = time.perf_counter() if start is None else start

  def spent(self, what: str) -> float:
    return float(self.ledger.seconds[what] - self.booked[what])

  def split(self, now: float) -> dict:
    """{'step_s', 'data_s', ...} of the window up to `now`: they add up to its wall time."""
    spent = {k: self.spent(k) for k in SPLIT[1:]}
    step = now - self.start - sum(spent.values())
    self.ledger.seconds["step"] += step
    return {f"{k}_s": v for k, v in {"step": step, **spent}.items()}


def line(summary: dict) -> str:
  """'goodput G% of H:MM:SS wall | step S.Ss | compile C.Cs (c%) | ...': the share of productive step time, then the
  rest by size."""
  wall = summary["wall_s"]
  rest = sorted(((k.removesuffix("_s"), v) for k, v in summary.items() if k.endswith("_s") and k not in
                 ("wall_s", "step_s")), key=lambda kv: -kv[1])
  parts = [f"goodput {summary['goodput']:.1%} of {datetime.timedelta(seconds=round(wall))} wall",
           f"step {summary.get('step_s', 0.0):.1f}s"]
  parts += [f"{k} {v:.1f}s ({v / wall:.1%})" for k, v in rest]
  return " | ".join(parts)

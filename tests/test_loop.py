"""The loop's schedules: no step waits for the device between logs; the steps queued on the device before an eval
are timed as steps, not as the eval's pause; each record's time split and the goodput line; profile traces of chosen
steps."""
import collections
import contextlib
import io
import re
import threading
import time

import jax
import numpy as np
import pytest

from lm_jax import checks, config_lib, train
from lm_jax.data import pipeline
from lm_jax.evals import evaluators
from lm_jax.obs import metrics_log
from conftest import REPO, load_config, records


def test_a_slow_eval_does_not_inflate_its_windows_throughput(shared_data, tmp_path, monkeypatch):
  """Windows of 10 steps; the eval at step 19 sleeps 3 s. Its window (steps 11-20) logs the tokens/s of its
  neighbours (2-10, 21-30) within 2x (a loaded, shared CPU): the steps 11-19 still queued when the eval starts ran
  during its sleep, and they count as steps. Timing from the eval's call, the window would report them as free."""
  def slow_evaluator(s):
    def run(params, step):
      time.sleep(3)
      return {"eval_loss": 1.0}
    return run
  monkeypatch.setattr(evaluators, "make", slow_evaluator)
  config = load_config("clm", shared_data, total_steps=30, log_every=10, eval_every=19, checkpoint_every=1000,
                       batch_size=16, **{"model.d_model": 128, "model.num_layers": 2, "model.d_ff": 512,
                                         "data.seq_len": 64})
  train.train(config, str(tmp_path))
  speed = {r["step"]: r["tokens_per_sec"] for r in records(tmp_path)}
  neighbours = np.sqrt(speed[10] * speed[30])
  assert 0.5 < speed[20] / neighbours < 2, speed


# ------------------------------------------------------------------- where the time goes; profile traces
SLEEP = 0.2   # seconds the slow data source takes per batch


class _SlowBatches:
  """A training iterator whose batches take SLEEP seconds each (a slow input pipeline)."""

  def __init__(self, it):
    self.it = it

  def __getattr__(self, name):
    return getattr(self.it, name)

  def __iter__(self):
    return self

  def __next__(self):
    time.sleep(SLEEP)
    return next(self.it)


def _count_waits(patch) -> set:
  """Every way the main thread can wait for the device (jax.device_get, jax.block_until_ready, an array's own
  block_until_ready, reading its value: float(), np.asarray, .item()) adds the number of train steps dispatched so
  far to the set returned."""
  array_type = type(jax.numpy.zeros(()))   # jax's concrete Array class, found without naming a private module
  dispatched, waits = [0], set()

  def counted(fn):
    def wrapper(*args, **kwargs):
      if threading.current_thread() is threading.main_thread():
        waits.add(dispatched[0])
      return fn(*args, **kwargs)
    return wrapper

  def counting_step(s, compile_train_step=train.compile_train_step):
    step = compile_train_step(s)

    def one(*args):
      dispatched[0] += 1
      return step(*args)
    return one
  patch.setattr(train, "compile_train_step", counting_step)
  for name in ("device_get", "block_until_ready"):
    patch.setattr(jax, name, counted(getattr(jax, name)))
  patch.setattr(array_type, "block_until_ready", counted(array_type.block_until_ready))
  patch.setattr(array_type, "_value", property(counted(array_type._value.fget)))
  return waits


@pytest.fixture(scope="module")
def slow_run(shared_data, tmp_path_factory):
  """(workdir, console output, the steps at which the host waited for the device) of 12 tiny steps on a slow data
  source, logging every 6, evaluating and saving at 6 and 12, with steps 3-4 profiled (with the host's Python
  calls)."""
  workdir = tmp_path_factory.mktemp("slow")
  config = load_config("clm", shared_data, total_steps=12, log_every=6, eval_every=6, checkpoint_every=6,
                       **{"profile.steps": (3, 2), "profile.host": True})
  make = pipeline.make_train_iterator
  with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
    patch.setattr(pipeline, "make_train_iterator", lambda *a, **k: _SlowBatches(make(*a, **k)))
    waits = _count_waits(patch)
    train.train(config, str(workdir))
  return workdir, out.getvalue(), waits


def test_steps_between_logs_never_wait_for_the_device(slow_run):
  """The main thread waits for the device only at step 1 and the log, eval and save steps 6 and 12 (and at 4, the
  end of the profiled range, whose device work the trace must hold). A wait at any other step (a metric read, a
  sync in the step call, the data or the loop) would keep the device from running steps ahead: each step would
  pay a host round trip."""
  *_, waits = slow_run
  assert waits - {0} == {1, 4, 6, 12}, sorted(waits)   # 0: before the first step (init, restore)


def test_the_time_split_shows_the_data_wait(slow_run):
  """Each train record splits its window: steps 7-12 waited 6 x SLEEP for data (the time in next()), and their
  window also holds step 6's eval (with the eval step's compilation) and save; the console line shows the shares, and
  the run ends with the goodput line."""
  workdir, out, _ = slow_run
  recs = {r["step"]: r for r in records(workdir)}
  assert sorted(recs) == [1, 6, 12]
  last = recs[12]
  assert 6 * SLEEP <= last["data_s"] < 6 * SLEEP + 3.0, last   # + the real pipeline's waits on a loaded machine
  assert last["data_s"] > last["step_s"] and last["eval_s"] > 0 and last["checkpoint_s"] > 0, last
  assert recs[1]["compile_s"] > 0 and last["compile_s"] > 0    # the train step's, then the eval step's
  assert all(r[k] >= 0 for r in recs.values() for k in metrics_log.TIME_SPLIT), recs
  assert last["tokens"] == 12 * 8 * 32    # steps x batch x seq_len
  line = next(l for l in out.splitlines() if l.startswith("step 12/12 | loss"))
  assert re.search(r"\| 3,072 tokens \| time (\w+ \d+% )*data \d+% .*\| eta ", line), line
  summary = out.splitlines()[-1]
  assert summary.startswith("goodput ") and " wall | step " in summary, out[-2000:]
  for part in ("compile", "data", "eval", "checkpoint", "restore", "setup"):
    assert f"| {part} " in summary, summary
  share = float(summary.split()[1].rstrip("%"))
  assert 0 < share < 50, summary   # compiling and waiting for data took most of this run


def test_a_profiled_run_leaves_a_trace_of_its_steps(slow_run):
  """config.profile.steps = (3, 2): WORKDIR/profile holds the session TensorBoard's profile plugin lists, its
  .xplane.pb (read here with jaxlib's reader of the same proto) holds the train step's XLA ops, the step markers of
  steps 3 and 4 only, the data waits and (config.profile.host) the input pipeline's Python calls; Perfetto's trace
  lies beside it."""
  workdir, *_ = slow_run
  session = workdir / "profile" / "plugins" / "profile" / "steps_3-4"
  xplanes = list(session.glob("*.xplane.pb"))
  assert len(xplanes) == 1 and (session / "perfetto_trace.json.gz").is_file(), list(session.iterdir())
  data_files = tuple(f"${p.name}:" for p in (REPO / "lm_jax" / "data").glob("*.py"))   # Python events: $file:line
  modules, steps, waits, pipeline_calls = collections.Counter(), set(), 0, 0
  for plane in jax.profiler.ProfileData.from_file(str(xplanes[0])).planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        modules[stats.get("hlo_module")] += "hlo_op" in stats
        steps |= {stats["step_num"]} if event.name == "train" and "step_num" in stats else set()
        waits += event.name == "data_wait"
        pipeline_calls += event.name.startswith(data_files)
  assert modules["jit_step"] > 0, modules   # lm_jax.step.make_train_step's jitted `step`
  assert steps == {3, 4} and waits == 2 and pipeline_calls > 0, (steps, waits, pipeline_calls)


def test_profile_steps_must_be_a_start_and_a_count(shared_data):
  config = load_config("clm", shared_data, **{"profile.steps": (0, 2)})
  with pytest.raises(config_lib.ConfigError, match=r"^config.profile.steps=\(0, 2\): want \(first step, number of"):
    checks.validate(config, 1)

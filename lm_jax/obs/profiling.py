"""jax.profiler traces of chosen steps (config.profile): WORKDIR/profile/plugins/profile/steps_A-B/HOST.xplane.pb,
which TensorBoard's profile plugin (xprof) opens with `tensorboard --logdir WORKDIR/profile`, and beside it
perfetto_trace.json.gz for ui.perfetto.dev.

Each step runs inside a StepTraceAnnotation (the plugin's step markers); the time in next() of the training iterator
shows as `data_wait` (goodput.Ledger.waited). With config.profile.host the Python tracer also records the host's
calls (the input pipeline, the loop). Only process 0 traces unless config.profile.all_processes; the others write
sessions named ..._process_N.

Dependencies: none in lm_jax; loop uses it.
"""
import contextlib
import sys

import jax
from etils import epath

from lm_jax import distributed


def check(config):
  """One-line error for a bad config.profile.steps, or one that starts after the run's last step (it would trace
  nothing, silently); checks.validate calls it before anything is built."""
  steps = tuple(config.profile.steps)
  if steps and not (len(steps) == 2 and all(isinstance(n, int) and n >= 1 for n in steps)):
    raise ValueError(f"config.profile.steps={steps!r}: want (first step, number of steps), both >= 1; () = off")
  if steps and steps[0] > config.total_steps:
    raise ValueError(f"config.profile.steps={steps!r} starts after the run's last step (total_steps="
                     f"{config.total_steps}); profile steps 1..{config.total_steps}")


class Profiler:
  """Traces steps first .. first + count - 1 (config.profile.steps) of those this run executes (after `start`, the
  step it resumed at: a range already run is a warning, not a silent nothing)."""

  def __init__(self, config, workdir: str, start: int = 0):
    p = config.profile
    self.first, count = tuple(p.steps) or (0, 0)
    self.last = self.first + count - 1
    self.on = bool(count) and (p.all_processes or distributed.is_lead())
    if self.on and self.last <= start:
      self.on = False
      print(f"warning: config.profile.steps={tuple(p.steps)!r}: steps {self.first}..{self.last} ran before this run "
            f"resumed at step {start}; nothing is profiled", file=sys.stderr, flush=True)
    self.tracing = False
    self.dir = epath.Path(workdir) / "profile"
    self.options = jax.profiler.ProfileOptions()
    self.options.python_tracer_level = 1 if p.host else 0
    self.options.host_tracer_level = 3 if p.host else 2
    self.options.session_id = f"steps_{self.first}-{self.last}" + (
        f"_process_{jax.process_index()}" if jax.process_index() else "")

  @contextlib.contextmanager
  def step(self, i: int):
    """Runs step i inside its trace annotation, starting the trace at the first step of the range."""
    if self.on and not self.tracing and self.first <= i <= self.last:
      with self._unless_failing("start"):
        jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True, profiler_options=self.options)
        self.tracing = True
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
      yield

  def ends(self, i: int) -> bool:
    """Whether step i ends the traced range (the caller waits for its outputs, then stop())."""
    return self.tracing and i >= self.last

  def stop(self):
    """Writes the trace."""
    self.tracing = False
    with self._unless_failing("write"):
      jax.profiler.stop_trace()

  @contextlib.contextmanager
  def _unless_failing(self, what: str):
    """A profile that cannot start or be written (an unwritable profile/ folder, a full disk): one warning and no
    more profiling; the run goes on."""
    try:
      yield
    except Exception as e:  # noqa: BLE001 - the profiler raises its own runtime errors
      self.on = False
      text = str(e).strip().splitlines()
      print(f"warning: cannot {what} the profile in {self.dir} ({type(e).__name__}: {text[0] if text else ''}); "
            "training goes on without it", file=sys.stderr, flush=True)

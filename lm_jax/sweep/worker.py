"""A sweep worker: runs the trials of one grid that no other worker runs, each as its own
`python -m lm_jax.main --workdir=ROOT/<trial> ...` process, until every trial is done or failed.

Any number of workers (processes, SLURM array tasks, hosts) share a root, local or gs://. The claim on a trial is its
trainer's workdir lock (lm_jax.workdir_lock): a worker starts the trial's trainer, and a trainer refused with "in use"
means another worker has it. That lock goes with the trainer however it ends, kill -9 of the worker's process group
included, so a dead worker's trial is free at once (on gs:// once its lock object is stale) and the next worker
resumes it from its checkpoint: every trial is an ordinary run. In a local root the worker also holds the kernel's
lock on ROOT/<trial>/sweep.lock from before the trainer starts until the trial is recorded (it too dies with the
worker), so no worker starts a trainer in the moment between another's trainer ending and its record; workers probe
both locks without holding them before starting a trainer. (On gs:// a trainer started in that moment finds the run
at its end and stops: a start, no step repeated.) Per trial, in ROOT/<trial>/:
  trial.json          the config, its swept values and the shared overrides (written before each start)
  sweep_done.json     written once the trainer exited 0 with its metrics at the last step: the trial is skipped
  sweep_failed.json   after 1 + --retries failed starts: the error line; the trial is skipped (delete it to retry)
"""
import contextlib
import datetime
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

from lm_jax import storage, workdir_lock
from lm_jax.obs import metrics_log
from lm_jax.sweep import grid

DONE, FAILED, TRIAL, CLAIM = "sweep_done.json", "sweep_failed.json", "trial.json", "sweep.lock"
IN_USE = " is in use by "   # workdir_lock.WorkdirInUse's line: another worker's trainer holds the trial
POLL_S = {False: 2.0, True: 30.0}   # waiting for other workers' trials: local, remote (stale locks take minutes)


def path(root: str, *names: str) -> str:
  return "/".join([root.rstrip("/"), *names]) if storage.is_remote(root) else os.path.join(root, *names)


def write_json(url: str, value: dict):
  """The file whole or not at all: a local one written beside and renamed over, a remote object uploaded at once."""
  data = json.dumps(value, indent=1, default=str).encode()
  if storage.is_remote(url):
    with storage.open(url, "wb") as f:
      f.write(data)
    return
  folder = os.path.dirname(url)
  os.makedirs(folder, exist_ok=True)
  storage.refuse_link(url)
  os.replace(storage.write_new(folder, ".sweep", data), url)


def state(root: str, t: grid.Trial) -> str:
  """done, failed, running (its local lock is held) or left."""
  folder = path(root, t.name)
  return recorded(folder) or ("running" if _locked(folder) else "left")


def recorded(folder: str) -> str:
  """'done' or 'failed' for a trial with its record, else ''."""
  return next((s for s, name in (("done", DONE), ("failed", FAILED)) if storage.exists(path(folder, name))), "")


def _locked(folder: str) -> bool:
  """Whether a worker or trainer holds a local trial's lock: each tried and let go at once (one taking it in that
  instant is refused and moves on; the trial stays left for the next pass). Remote: the trainer decides."""
  if storage.is_remote(folder):
    return False
  for name in (CLAIM, workdir_lock.NAME):
    try:
      fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return True
    finally:
      os.close(fd)
  return False


@contextlib.contextmanager
def _claim(folder: str):
  """Yields whether this worker holds the local trial's sweep.lock for the block (always True remotely)."""
  if storage.is_remote(folder):
    yield True
    return
  os.makedirs(folder, exist_ok=True)
  fd = os.open(os.path.join(folder, CLAIM), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    held = True
  except OSError:
    held = False
  try:
    yield held
  finally:
    os.close(fd)   # releases the lock


class Stop:
  """SIGTERM, SIGHUP or Ctrl-C: no trial starts after, and the running trainer checkpoints and exits (SIGTERM passed
  on; a Ctrl-C reached it with the terminal's process group, and a second one would stop it unsaved). A signal sent to
  the trainer alone stops the worker too: the trainer saves and exits 0 before its last step, not a failure to retry."""

  def __init__(self):
    self.requested, self.child = False, None
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
      signal.signal(s, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.requested = True
    if signum != signal.SIGINT and self.child is not None and self.child.poll() is None:
      self.child.send_signal(signal.SIGTERM)


def run(spec: str, root: str, trials: list[grid.Trial], retries: int) -> int:
  """Works on the grid until every trial is done or failed (or a signal stops it). Returns the exit code: 1 when a
  trial failed, else 0."""
  stop, busy = Stop(), {}   # busy: trial -> until when a refused start counts it as running
  order = random.Random(f"{socket.gethostname()}:{os.getpid()}").sample(trials, len(trials))   # workers spread out
  states = _states(root, trials, busy)
  if all(s in ("done", "failed") for s in states.values()):
    print(f"sweep: all {len(trials)} trials in {root} are finished ({_counts(states)}); nothing to start", flush=True)
    return int("failed" in states.values())
  while not stop.requested:
    print(f"sweep: {_counts(states)} of {len(trials)} trials in {root}", flush=True)
    todo = [t for t in order if states[t.name] == "left"]
    if not todo and "running" not in states.values():
      break
    if todo:
      _attempt(spec, root, todo[0], retries, stop, busy)
    else:
      time.sleep(POLL_S[storage.is_remote(root)])
    states = _states(root, trials, busy)
  if stop.requested:
    print(f"sweep: stopped; {_counts(states)} of {len(trials)} trials in {root}", flush=True)
  return int("failed" in states.values())


def _states(root, trials, busy) -> dict:
  now = time.monotonic()
  return {t.name: "running" if s == "left" and busy.get(t.name, 0) > now else s
          for t, s in ((t, state(root, t)) for t in trials)}


def _counts(states: dict) -> str:
  n = lambda s: sum(v == s for v in states.values())
  return f"{n('done')} done, {n('running')} running, {n('failed')} failed, {n('left')} left"


def _attempt(spec, root, t: grid.Trial, retries: int, stop: Stop, busy: dict):
  """The trial, if no other worker has it and it is not recorded yet."""
  folder = path(root, t.name)
  with _claim(folder) as held:
    if held and not recorded(folder):
      _train_trial(spec, root, t, retries, stop, busy)
    elif not held:
      busy[t.name] = time.monotonic() + POLL_S[storage.is_remote(root)]


def _train_trial(spec, root, t: grid.Trial, retries: int, stop: Stop, busy: dict):
  """Starts the trial's trainer up to 1 + retries times; records it done, failed, or (refused) running elsewhere."""
  folder = path(root, t.name)
  write_json(path(folder, TRIAL), {"config": spec, "swept": t.swept, "overrides": t.fixed})
  for attempt in range(1, retries + 2):
    print(f"sweep: {t.name}: start (attempt {attempt})", flush=True)
    code, error, seconds = _train(spec, folder, t, stop)
    if error and IN_USE in error:
      print(f"sweep: {t.name}: in use by another worker", flush=True)
      busy[t.name] = time.monotonic() + POLL_S[storage.is_remote(root)]
      return
    last = max((r.get("step", 0) for r in metrics_log.read(path(folder, "metrics.jsonl"))), default=0)
    if code == 0 and last == t.end:
      write_json(path(folder, DONE), {"steps": last, "seconds": round(seconds, 1), "finished": _now()})
      print(f"sweep: {t.name}: done, step {last} ({seconds:.0f} s)", flush=True)
      return
    if stop.requested or code == 0:   # checkpointed on a signal (a trainer exits 0 early on no other cause)
      stop.requested = True   # a signal to the trainer alone (a scheduler's, a user's) stops this worker too
      print(f"sweep: {t.name}: stopped at step {last}; a worker started later resumes it", flush=True)
      return
    error = (f"killed by {signal.Signals(-code).name} at step {last}" if code < 0 else
             error or f"exit code {code} at step {last} of {t.end}")
    print(f"sweep: {t.name}: attempt {attempt} failed: {error}", flush=True)
  write_json(path(folder, FAILED), {"error": error, "exit_code": code, "attempts": retries + 1, "failed": _now()})


def _train(spec, folder, t: grid.Trial, stop: Stop) -> tuple[int, str, float]:
  """(exit code, its error line or '', seconds) of lm_jax.main training the trial. Its stdout and stderr pass
  through (a refusal's line aside); it stays in this worker's process group, so killing the group stops it too."""
  start = time.monotonic()
  cmd = [sys.executable, "-m", "lm_jax.main", f"--config={spec}", f"--workdir={folder}", *t.args]
  stop.child = child = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace")
  error = ""
  for line in child.stderr:
    if line.startswith("error: ") or (line.strip() and not line.startswith(" ")):
      error = line.strip().removeprefix("error: ")
    if IN_USE not in line:
      sys.stderr.write(line)
      sys.stderr.flush()
  code = child.wait()
  stop.child = None
  return code, error if code else "", time.monotonic() - start


def _now() -> str:
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")

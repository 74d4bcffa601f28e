"""One run per workdir: the trainers (lm_jax.train.train, lm_jax.rlhf.ppo.train) hold WORKDIR/run.lock from the
moment their config is valid (lm_jax.setup) to their end, so a second run in the same workdir stops at start in one
line naming the holder's host and pid, instead of both writing metrics.jsonl and checkpoints (one run's results
lost). Read-only modes (eval, export, generate, predict, fill_mask, zeroshot, summary) take no lock.

The lock is the kernel's (flock) on an open file, not the file's existence: it goes with the holding process however
that process ends, kill -9 included, so no lock is ever stale and none has to be guessed stale by age or pid. The
file only tells a refused run who holds it (host, pid, start time); it stays in place between runs, since removing a
locked file would let a third run lock a new file beside a second one still waiting on the old. On a shared file
system the lock spans hosts where it supports locks (NFS: a crashed host's locks go when its lease expires); one that
refuses locks gets a warning and no lock.

On gs:// the lock is the object WORKDIR/run.lock, created only if absent (generation-match precondition 0, which GCS
checks atomically), renewed every RENEW_S seconds by a thread (each renewal is conditional on the generation this
run last wrote) and deleted at the end. Object storage has no lock that dies with its process, so a lock object is
stale once it is STALE_S seconds unrenewed, or at once when its holder is a pid on this host that no longer runs (a
kill -9 and an immediate resume); a stale lock is replaced under the precondition of its own generation, so of two
runs that find it stale one wins. Other URLs (no preconditions) get a warning and no lock.

Nothing lm_jax writes in the workdir goes through a symbolic link placed there: before the lock is taken every name
the run writes (the lock, WRITES and the entries of the folders among them) is checked, so links there stop the run
in one line naming them before anything is written, and the lock file is opened with O_NOFOLLOW.

A multi-host run is one run: process 0 holds the lock and tells the others whether it got it, so all start or all
stop. Locks per process would each see the other processes' locks as another run in a shared workdir.
"""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import pathlib
import shutil
import socket
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from lm_jax import distributed, storage
from lm_jax.obs import metrics_log

NAME = "run.lock"
RENEW_S = 30.0     # a gs:// lock's renewal period
STALE_S = 300.0    # a gs:// lock unrenewed this long is stale (clocks of host and server may differ by seconds)
# What a run writes in its workdir (besides the lock and its tokenizer, written by rename): no link may stand there.
WRITES = ("metrics.jsonl", "tensorboard", "wandb", "wandb_run_id", "profile", "checkpoints", "best", "policy")
WRITES_IN = ("tensorboard", "checkpoints", "best", "policy")   # folders whose entries lm_jax names (steps, events)

_TAKEN: set[str] = set()   # the local workdirs whose lock this process has held


class WorkdirInUse(OSError):
  """Another run is training in the workdir (exit code 1 on the command line)."""


@contextlib.contextmanager
def hold(workdir: str):
  """Holds workdir's lock for the block; WorkdirInUse (on every process) when another run holds it, StorageError
  when a link stands where the run writes (check_no_links)."""
  f, error = None, None
  if distributed.is_lead():
    try:
      if not storage.is_remote(workdir):
        check_no_links(workdir)
        f = _acquire(os.path.join(workdir, NAME))
        _TAKEN.add(workdir)
      elif workdir.startswith("gs://"):
        f = _GcsLock(f"{workdir.rstrip('/')}/{NAME}")
      else:
        metrics_log.warn(f"{workdir}: no lock on this kind of storage; nothing stops a second run in this workdir")
    except (WorkdirInUse, storage.StorageError) as e:   # in use, a link where the run writes, storage errors
      error = e
  if jax.process_count() > 1:
    held = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    error = error or (None if held else WorkdirInUse(f"{workdir} is in use by another run (see process 0)"))
  if error is not None:
    raise error
  try:
    yield
  finally:
    if f is not None:
      f.close()   # releases the lock


@contextlib.contextmanager
def removed_if_unused(workdir: str):
  """Removes `workdir` when the block fails and the workdir did not exist before it and holds no result yet (no
  checkpoint step, no metrics record): a run that stops at start leaves no run.lock, empty checkpoints/ or trained
  tokenizer behind, so the corrected command starts afresh. Only a run that held the workdir's lock removes it, and
  only while holding it again: of runs started together on a new workdir, the refused ones (which also saw no
  workdir) leave the winner's alone. Process 0 removes; remote workdirs are left alone."""
  created = "://" not in workdir and not os.path.lexists(workdir)
  try:
    yield
  except BaseException:
    if created and distributed.is_lead() and workdir in _TAKEN:
      _remove_unless_used(workdir)
    raise


def _remove_unless_used(workdir: str):
  """Removes workdir unless it holds results or another run has locked it since this run let go."""
  try:
    fd = os.open(os.path.join(workdir, NAME), os.O_RDWR | os.O_NOFOLLOW)
  except OSError:   # no lock file (or a link): not the folder this run locked
    return
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    if os.path.isdir(workdir) and not _has_results(workdir):
      shutil.rmtree(workdir, ignore_errors=True)
  except OSError:   # locked by another run
    pass
  finally:
    os.close(fd)


def check_no_links(workdir: str):
  """StorageError naming every symbolic link where the run writes in a local workdir (see WRITES), in one line."""
  places = [os.path.join(workdir, name) for name in (NAME, *WRITES)]
  for name in WRITES_IN:
    folder = os.path.join(workdir, name)
    if os.path.isdir(folder) and not os.path.islink(folder):
      places += [os.path.join(folder, entry) for entry in sorted(os.listdir(folder))]
  storage.refuse_links([p for p in places if os.path.islink(p)])


def _has_results(workdir: str) -> bool:
  metrics = os.path.join(workdir, "metrics.jsonl")
  return _holds_steps(pathlib.Path(workdir)) or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)


def holds_run(folder: pathlib.Path, files: list[str] = ()) -> bool:
  """Whether `folder` is a run's workdir: its lock file (files: os.walk's listing, else looked up) or a step."""
  return NAME in files or (folder / NAME).exists() or _holds_steps(folder)


def _holds_steps(folder: pathlib.Path) -> bool:
  """Whether folder/checkpoints holds a step folder, complete or not (a run that never finished a save is a run)."""
  steps = folder / "checkpoints"
  return steps.is_dir() and any(p.name.split(".")[0].isdigit() for p in steps.iterdir())


def _acquire(path: str):
  """The open lock file, locked and naming this process; WorkdirInUse naming the holder when it is locked."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  try:   # created if missing, never truncated before it is ours, never opened through a link
    f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a+", encoding="utf-8")
  except OSError as e:
    if e.errno == errno.ELOOP:
      storage.refuse_link(path)
    raise
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EAGAIN, errno.EACCES):   # a file system without locks
      metrics_log.warn(f"cannot lock {path} ({e.strerror}); nothing stops a second run in this workdir")
      return f
    f.seek(0)
    holder = f.read()
    f.close()
    raise _in_use(os.path.dirname(path), holder) from None
  f.seek(0)
  f.truncate()
  f.write(_holder())
  f.flush()
  return f


def _holder() -> str:
  return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                     "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})


def _in_use(workdir: str, holder: str) -> WorkdirInUse:
  return WorkdirInUse(f"{workdir} is in use by {_describe(holder)}; wait for it, stop it, or use another --workdir")


def _retry():
  from google.cloud.storage import retry
  return retry.DEFAULT_RETRY


class _GcsLock:
  """WORKDIR/run.lock on GCS, held from construction to close() (see the module docstring)."""

  def __init__(self, url: str):
    from google.api_core import exceptions
    self.url, self.blob, self._stop, self._warned = url, storage.gcs_blob(url), threading.Event(), False
    self._precondition = exceptions.PreconditionFailed
    self.text = text = _holder()
    try:
      self.blob.upload_from_string(text, if_generation_match=0)
    except exceptions.PreconditionFailed:
      self._replace_stale(text)
    except Exception as e:  # noqa: BLE001  (missing bucket, credentials, permission, server gone)
      raise storage.StorageError(f"cannot create the workdir lock {url}: {storage.describe(e)}") from None
    self.generation = self.blob.generation
    self._thread = threading.Thread(target=self._renew, name="workdir-lock", daemon=True)
    self._thread.start()

  def _replace_stale(self, text: str):
    """Takes the lock over if its holder is gone; WorkdirInUse naming the holder otherwise."""
    old = self.blob.bucket.get_blob(self.blob.name)
    if old is None:   # released between our two requests
      return self.blob.upload_from_string(text, if_generation_match=0)
    holder = old.download_as_text(if_generation_match=old.generation)
    if not _stale(holder, time.time() - old.updated.timestamp()):
      raise _in_use(self.url.rsplit("/", 1)[0], holder)
    try:
      self.blob.upload_from_string(text, if_generation_match=old.generation)
    except self._precondition:   # another run replaced it first
      raise _in_use(self.url.rsplit("/", 1)[0], self.blob.bucket.blob(self.blob.name).download_as_text()) from None
    metrics_log.warn(f"replaced the stale workdir lock {self.url} of {_describe(holder)}")

  def _renew(self):
    while not self._stop.wait(RENEW_S):
      try:
        self.blob.upload_from_string(self.text, if_generation_match=self.generation,
                                     retry=_retry().with_timeout(RENEW_S))
        self.generation = self.blob.generation
      except self._precondition:
        metrics_log.warn(f"the workdir lock {self.url} was taken over by another run; this run no longer holds it")
        return
      except Exception as e:  # noqa: BLE001  (a passing network error: the next renewal retries)
        if not self._warned:
          metrics_log.warn(f"cannot renew the workdir lock {self.url}: {storage.describe(e)[:200]}", remote=True)
        self._warned = True

  def close(self):
    self._stop.set()
    self._thread.join()
    try:
      self.blob.delete(if_generation_match=self.generation, retry=_retry().with_timeout(10.0))
    except Exception:  # noqa: BLE001  (taken over, or the server is gone: the lock goes stale by itself)
      pass


def _stale(holder: str, age_s: float) -> bool:
  """A lock STALE_S unrenewed, or held by a pid of this host that no longer runs."""
  if age_s > STALE_S:
    return True
  try:
    owner = json.loads(holder)
    if owner["host"] != socket.gethostname():
      return False
    os.kill(int(owner["pid"]), 0)
  except ProcessLookupError:
    return True
  except (ValueError, TypeError, KeyError, OSError):
    pass
  return False


def _describe(text: str) -> str:
  """'the run of pid P on host H (started T)' from a lock file's content."""
  try:
    holder = json.loads(text)
    return f"the run of pid {holder['pid']} on host {holder['host']} (started {holder['started']})"
  except (ValueError, TypeError, KeyError):   # it has locked the file and not written it yet
    return "another run that is starting"

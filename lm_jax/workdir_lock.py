"""One run per workdir: the trainers (lm_jax.train.train, lm_jax.rlhf.ppo.train) hold WORKDIR/run.lock from the
moment their config is valid (train.setup) to their end, so a second run in the same workdir stops at start in one
line naming the holder's host and pid, instead of both writing metrics.jsonl and checkpoints (one run's results
lost). Read-only modes (eval, export, generate, predict, fill_mask, zeroshot, summary) take no lock.

The lock is the kernel's (flock) on an open file, not the file's existence: it goes with the holding process however
that process ends, kill -9 included, so no lock is ever stale and none has to be guessed stale by age or pid. The
file only tells a refused run who holds it (host, pid, start time); it stays in place between runs, since removing a
locked file would let a third run lock a new file beside a second one still waiting on the old. On a shared file
system the lock spans hosts where it supports locks (NFS: a crashed host's locks go when its lease expires); one that
refuses locks gets a warning and no lock. A remote workdir (gs://...) has no lock.

A multi-host run is one run: process 0 holds the lock and tells the others whether it got it, so all start or all
stop. Locks per process would each see the other processes' locks as another run in a shared workdir.
"""
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from lm_jax.obs import metrics_log

NAME = "run.lock"


class WorkdirInUse(OSError):
  """Another run is training in the workdir (exit code 1 on the command line)."""


@contextlib.contextmanager
def hold(workdir: str):
  """Holds workdir's lock for the block; WorkdirInUse (on every process) when another run holds it."""
  f, error = None, None
  if "://" not in workdir and jax.process_index() == 0:
    try:
      f = _acquire(os.path.join(workdir, NAME))
    except WorkdirInUse as e:
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


def _acquire(path: str):
  """The open lock file, locked and naming this process; WorkdirInUse naming the holder when it is locked."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  f = open(path, "a+", encoding="utf-8")   # created if missing, never truncated before it is ours
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    if e.errno not in (errno.EAGAIN, errno.EACCES):   # a file system without locks
      metrics_log.warn(f"cannot lock {path} ({e.strerror}); nothing stops a second run in this workdir")
      return f
    f.seek(0)
    holder = f.read()
    f.close()
    raise WorkdirInUse(f"{os.path.dirname(path)} is in use by {_describe(holder)}; wait for it, stop it, or use "
                       "another --workdir") from None
  f.seek(0)
  f.truncate()
  f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                      "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}))
  f.flush()
  return f


def _describe(text: str) -> str:
  """'the run of pid P on host H (started T)' from a lock file's content."""
  try:
    holder = json.loads(text)
    return f"the run of pid {holder['pid']} on host {holder['host']} (started {holder['started']})"
  except (ValueError, TypeError, KeyError):   # it has locked the file and not written it yet
    return "another run that is starting"

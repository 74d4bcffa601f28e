"""Worker processes that tokenize on the fly (config.data.workers > 1): a Corpus hands each batch of documents to N
spawned processes, each holding the run's tokenizer, in N contiguous parts, and puts the results back in order.
Tokenizing is a pure function of the text and the tokenizer (corpus.tokenize), so the batches are those of one
worker; only the time changes. The pool starts with the first corpus of a tokenizer and is shared by its others.

The workers ignore SIGINT and SIGTERM: a Ctrl-C or a preemption sent to the whole process group is the trainer's to
handle (it saves, then exits and the workers are killed). Each part is sent over the worker's own pipe and waited for
together with the worker's exit, so a worker that dies (the OOM killer, kill -9) stops the run with one line naming
it, rather than leaving the trainer waiting for ever. More workers than CPUs are capped at the CPU count.
"""
import atexit
import contextlib
import functools
import math
import multiprocessing
import os
import signal
import threading
from multiprocessing import connection

from absl import logging

from lm_jax.data import corpus as corpus_lib
from lm_jax.data import tokenizer as tokenizer_lib

_POOLS = {}
_SIGNALS = (signal.SIGINT, signal.SIGTERM)    # the trainer's to handle


def count(requested: int) -> int:
  """config.data.workers capped at the CPUs this process may use, with one warning when it is more."""
  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  if requested > cpus:
    _warn_capped(requested, cpus)
  return min(requested, cpus)


@functools.cache
def _warn_capped(requested: int, cpus: int):
  logging.warning("data: data.workers=%d is more than the %d CPUs this process may use: tokenizing in %d worker "
                  "processes", requested, cpus, cpus)


class Workers:
  """tokenize(texts, as_sentences) over `n` processes; with n = 1, or a few texts, in this process."""

  def __init__(self, tok, n: int):
    self._tok, self.n = tok, n
    if n > 1:
      self._pool()               # here, in the thread that builds the pipeline (the main one, for signals)

  def tokenize(self, texts: list, as_sentences: bool) -> list:
    if self.n <= 1 or len(texts) < 2 * self.n:
      return corpus_lib.tokenize(texts, self._tok, as_sentences)
    size = math.ceil(len(texts) / self.n)
    parts = [(texts[k:k + size], as_sentences) for k in range(0, len(texts), size)]
    return [entry for part in self._pool().map(parts) for entry in part]

  def _pool(self) -> "_Pool":
    key = (self._tok.path, self._tok.family.name, self.n)
    if key not in _POOLS:
      _POOLS[key] = _Pool(self.n, self._tok.path, self._tok.family)
    return _POOLS[key]


class _Pool:
  """n spawned processes, one pipe each; map() sends part k to worker k and waits for its answer or its death."""

  def __init__(self, n: int, path: str, family):
    ctx = multiprocessing.get_context("spawn")
    self._lock, self._pipes, self._procs = threading.Lock(), [], []
    with _ignoring_signals():
      for _ in range(n):
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(theirs, path, family), daemon=True)
        proc.start()
        theirs.close()
        self._pipes.append(mine)
        self._procs.append(proc)
    atexit.register(self.close)    # registered after multiprocessing's own exit hook, so it runs first

  def map(self, parts: list) -> list:
    with self._lock:                # one batch at a time: the pipes carry one part each
      for k, part in enumerate(parts):
        try:
          self._pipes[k].send(part)
        except OSError:             # a broken pipe: the worker is gone
          self._died(k)
      return [self._receive(k) for k in range(len(parts))]

  def _receive(self, k: int):
    connection.wait([self._pipes[k], self._procs[k].sentinel])
    try:
      answer = self._pipes[k].recv() if self._pipes[k].poll() else None
    except (EOFError, OSError):
      answer = None
    if answer is None:
      self._died(k)
    if isinstance(answer, Exception):   # raised here, as in one process
      raise answer
    return answer

  def _died(self, k: int):
    proc = self._procs[k]
    proc.join()
    how = f"signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
    raise ChildProcessError(f"data worker {k} (pid {proc.pid}) died ({how}); the run stops: rerun the command to "
                            "resume from the last checkpoint (fewer data.workers if memory ran out)")

  def close(self):
    """Kills the workers (they ignore SIGTERM) and waits for them."""
    for proc in self._procs:
      proc.kill()
    for proc in self._procs:
      proc.join()


@contextlib.contextmanager
def _ignoring_signals():
  """Processes started inside ignore SIGINT and SIGTERM from their start (an ignored signal stays ignored in a
  child); only the main thread may change them, elsewhere _serve does as soon as it runs."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.signal(s, signal.SIG_IGN) for s in _SIGNALS}
  try:
    yield
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _serve(pipe, path: str, family):
  """A worker: tokenizes the parts it is sent until the trainer's end of the pipe closes."""
  for s in _SIGNALS:
    signal.signal(s, signal.SIG_IGN)
  tok = tokenizer_lib.load(path, family)
  try:
    while True:
      texts, as_sentences = pipe.recv()
      try:
        answer = corpus_lib.tokenize(texts, tok, as_sentences)
      except Exception as e:   # the trainer raises it
        answer = e
      pipe.send(answer)
  except (EOFError, BrokenPipeError):    # the trainer is gone
    return

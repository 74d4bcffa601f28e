"""Worker processes that tokenize on the fly (config.data.workers > 1): a Corpus hands each batch of documents to N
spawned processes, each holding the run's tokenizer, in N contiguous parts, and puts the results back in order.
Tokenizing is a pure function of the text and the tokenizer (corpus.tokenize), so the batches are those of one
worker; only the time changes. The pool is made on first use and shared by the corpora of one tokenizer.
"""
import atexit
import math
import multiprocessing

from lm_jax.data import corpus as corpus_lib
from lm_jax.data import tokenizer as tokenizer_lib

_POOLS = {}
_TOKENIZER = None            # in a worker: the run's tokenizer


class Workers:
  """tokenize(texts, as_sentences) over `n` processes; with n = 1, or a few texts, in this process."""

  def __init__(self, tok, n: int):
    self._tok, self.n = tok, n

  def tokenize(self, texts: list, as_sentences: bool) -> list:
    if self.n <= 1 or len(texts) < 2 * self.n:
      return corpus_lib.tokenize(texts, self._tok, as_sentences)
    size = math.ceil(len(texts) / self.n)
    parts = [(texts[k:k + size], as_sentences) for k in range(0, len(texts), size)]
    return [entry for part in self._pool().map(_tokenize, parts, chunksize=1) for entry in part]

  def _pool(self):
    key = (self._tok.path, self._tok.family.name, self.n)
    if key not in _POOLS:
      _POOLS[key] = multiprocessing.get_context("spawn").Pool(self.n, _start, (self._tok.path, self._tok.family))
    return _POOLS[key]


def _start(path: str, family):
  global _TOKENIZER
  _TOKENIZER = tokenizer_lib.load(path, family)


def _tokenize(job):
  texts, as_sentences = job
  return corpus_lib.tokenize(texts, _TOKENIZER, as_sentences)


@atexit.register
def _close():
  for pool in _POOLS.values():
    pool.terminate()
  _POOLS.clear()

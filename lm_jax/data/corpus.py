"""Tokenized documents of one split, encoded in batches and cached in memory up to a token budget.

Bad records (records.Bad), empty documents and documents of fewer than MIN_TOKENS tokens are counted in
`tally` (by reason, with where the first ones are) and stored as empty, so the rows built on top skip them and a
warning can report them.
"""
import numpy as np

from lm_jax.data import nsp, records

DOCS_PER_CALL = 32            # documents tokenized per batched encode call
_CACHE_TOKENS = 50_000_000    # tokenized documents kept in memory (small corpora are tokenized once)
MIN_TOKENS = 2                # shorter documents are counted as too short and skipped


class Corpus:
  """Tokenized documents of one split, encoded in batches and cached.

  stats counts records as they are tokenized: once each for a corpus that fits in the cache, on every
  visit for larger ones.
  """

  def __init__(self, docs, tokenizer, *, as_sentences: bool):
    self.docs, self.path = docs, docs.path
    self._tok, self._as_sentences = tokenizer, as_sentences
    self._cache, self._cached, self._recent = {}, 0, {}
    self.tally = records.Tally(docs, ("empty", "undecodable", "malformed", "too_short"))
    self.bytes = self.chars = self.tokens_count = 0

  @property
  def stats(self) -> dict:
    return self.tally.counts

  def __len__(self):
    return len(self.docs)

  def tokens(self, ids: list[int]) -> list:
    """Per id: a token array (stream mode) or a list of sentence arrays (as_sentences); empty if bad."""
    missing = [i for i in dict.fromkeys(ids) if i not in self._cache and i not in self._recent]
    if missing:
      self._tokenize(missing)
    return [self._cache[i] if i in self._cache else self._recent[i] for i in ids]

  def _tokenize(self, ids):
    texts, good = [], []
    for i in ids:
      text = self.docs[i]
      bad = text if isinstance(text, records.Bad) else (records.Bad("empty") if not text.strip() else None)
      if bad:
        self._store(i, [] if self._as_sentences else np.zeros(0, np.int32), bad)
      else:
        good.append(i)
        texts.append(nsp.sentences(text) if self._as_sentences else text)
    if self._as_sentences:
      flat = self._tok.encode_batch([s for t in texts for s in t])
      k = 0
      for i, t in zip(good, texts):
        segs = [np.asarray(s, np.int32) for s in flat[k:k + len(t)] if s]
        k += len(t)
        n = sum(map(len, segs))
        self._count(t, n)
        self._store(i, segs if n >= MIN_TOKENS else [], None if n >= MIN_TOKENS else _too_short(n))
    else:
      for i, t, ids_ in zip(good, texts, self._tok.encode_batch(texts)):
        self._count([t], len(ids_))
        ok = len(ids_) >= MIN_TOKENS
        self._store(i, np.asarray(ids_ if ok else [], np.int32), None if ok else _too_short(len(ids_)))

  def _count(self, texts, n):
    self.bytes += sum(len(t.encode("utf-8")) for t in texts)
    self.chars += sum(map(len, texts))
    self.tokens_count += n

  def _store(self, i, value, bad):
    self.tally.count(i, bad and bad.reason, bad and bad.detail)
    size = sum(map(len, value)) if self._as_sentences else len(value)
    if self._cached + size <= _CACHE_TOKENS:
      self._cache[i] = value
      self._cached += size
    else:                        # cache full: keep the last few hundred documents only
      self._recent[i] = value
      if len(self._recent) > 8 * DOCS_PER_CALL:
        del self._recent[next(iter(self._recent))]


def _too_short(n: int) -> records.Bad:
  return records.Bad("too_short", f"{n} tokens")

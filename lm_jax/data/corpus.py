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

  def __init__(self, docs, tokenizer, *, as_sentences: bool, workers=None):
    self.docs, self.path = docs, docs.path
    self._tok, self._as_sentences, self._workers = tokenizer, as_sentences, workers
    # documents the rows tokenize ahead in one call, enough for every worker process (data/workers.py) to have a
    # share; they are counted when asked for, as without workers
    self.read_ahead = DOCS_PER_CALL * 4 * workers.n if workers else 0
    self._ahead = {}
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
    have = {i: self._cache[i] if i in self._cache else self._recent[i] for i in dict.fromkeys(ids)
            if i in self._cache or i in self._recent}     # before storing the missing ones may drop them from _recent
    missing = [i for i in dict.fromkeys(ids) if i not in have]
    if missing:
      have.update(self._tokenize(missing))
    return [have[i] for i in ids]

  def prefetch(self, ids: list[int]):
    """Tokenizes these documents in one call (over the workers) for tokens() to find; nothing is counted yet."""
    keep = {i: self._ahead[i] for i in ids if i in self._ahead}
    missing = [i for i in dict.fromkeys(ids) if i not in self._cache and i not in self._recent and i not in keep]
    self._ahead = {**keep, **dict(zip(missing, self._encode([self.docs[i] for i in missing])))}

  def _tokenize(self, ids) -> dict:
    fresh = [i for i in ids if i not in self._ahead]
    made = dict(zip(fresh, self._encode([self.docs[i] for i in fresh]))) if fresh else {}
    out = {}
    for i in ids:
      value, bad, n_bytes, n_chars, n_tokens = self._ahead.pop(i) if i in self._ahead else made[i]
      self.bytes += n_bytes
      self.chars += n_chars
      self.tokens_count += n_tokens
      self._store(i, value, bad)
      out[i] = value
    return out

  def _encode(self, texts: list) -> list:
    if self._workers:
      return self._workers.tokenize(texts, self._as_sentences)
    return tokenize(texts, self._tok, self._as_sentences)

  def _store(self, i, value, bad):
    self.tally.count(i, bad and bad.reason, bad and bad.detail)
    size = sum(map(len, value)) if self._as_sentences else len(value)
    if self._cached + size <= _CACHE_TOKENS:
      self._cache[i] = value
      self._cached += size
    else:                        # cache full: keep the last few hundred documents only
      self._recent[i] = value
      if len(self._recent) > 8 * DOCS_PER_CALL + self.read_ahead:
        del self._recent[next(iter(self._recent))]


def tokenize(texts: list, tokenizer, as_sentences: bool) -> list:
  """Per text (or records.Bad): (token array, or sentence arrays with as_sentences; empty if unusable), the Bad it
  counts as or None, and its bytes, characters and tokens (0 for a bad record or an empty text). A pure function
  of the texts and the tokenizer: worker processes (data.workers) and data.prepared shards give what a Corpus
  makes."""
  out, good, parts = [None] * len(texts), [], []
  for k, text in enumerate(texts):
    bad = text if isinstance(text, records.Bad) else (records.Bad("empty") if not text.strip() else None)
    if bad:
      out[k] = ([] if as_sentences else np.zeros(0, np.int32), bad, 0, 0, 0)
    else:
      good.append(k)
      parts.append(nsp.sentences(text) if as_sentences else [text])
  flat = tokenizer.encode_batch([s for t in parts for s in t]) if as_sentences else tokenizer.encode_batch(
      [t[0] for t in parts])
  j = 0
  for k, t in zip(good, parts):
    size = (sum(len(x.encode("utf-8")) for x in t), sum(map(len, t)))
    if as_sentences:
      segs = [np.asarray(s, np.int32) for s in flat[j:j + len(t)] if s]
      j += len(t)
      n = sum(map(len, segs))
      out[k] = (segs if n >= MIN_TOKENS else [], None if n >= MIN_TOKENS else _too_short(n), *size, n)
    else:
      ids = flat[j]
      j += 1
      ok = len(ids) >= MIN_TOKENS
      out[k] = (np.asarray(ids if ok else [], np.int32), None if ok else _too_short(len(ids)), *size, len(ids))
  return out


def _too_short(n: int) -> records.Bad:
  return records.Bad("too_short", f"{n} tokens")

"""How documents become model rows. An objective picks one of two layouts and says how to build its rows:

  Stream       documents concatenated (each followed by `separator`) and cut into rows of `width` tokens:
               packed causal LM rows, [CLS] chunk [SEP] rows, raw chunks for span corruption
  PerDocument  each document yields a list of instances (e.g. BERT's sentence pairs), a pure function of
               (seed, shard, epoch, document); `assemble` stacks instances into rows. With `corpus` the
               documents are the layout's own (data.tasks: one labelled example each), not config.data's

ShardRows builds rows in windows from a cursor (position in the epoch's document order, offset inside
that document), so a window is rebuilt exactly from its starting cursor on resume.
"""
import dataclasses
from typing import Callable

import numpy as np

from lm_jax.data import corpus as corpus_lib


@dataclasses.dataclass(frozen=True)
class Stream:
  """build(tokens, docs) -> rows dict: tokens is the stream's next rows*width (+ lookahead) tokens, docs
  their document numbers. With drop_remainder the epoch's last partial row is dropped (and counted) instead
  of being handed to build."""
  width: int
  build: Callable
  separator: int | None = None
  lookahead: int = 0
  drop_remainder: bool = False
  as_sentences = False


@dataclasses.dataclass(frozen=True)
class PerDocument:
  """instances(segments, rng, other_doc) -> list of instances of one document (segments: its sentences as
  token arrays; other_doc(rng) -> the segments of a random other document); assemble(list) -> rows dict;
  real_tokens(instance) -> its number of non-padding tokens; rows are `width` tokens long.
  corpus(split) -> the split's tokenized documents (data.tasks.Examples) instead of config.data's; padding(n) ->
  n rows that count in no metric, to fill the last eval batch so that every example is evaluated."""
  width: int
  instances: Callable
  assemble: Callable
  real_tokens: Callable
  corpus: Callable | None = None
  padding: Callable | None = None
  as_sentences = True


class ShardRows:
  """Rows of one layout from a corpus in a per-epoch document order (order[e * epoch_len + i])."""

  def __init__(self, layout, corpus, order, *, seed: int, shard: int):
    self.layout, self.corpus, self._order = layout, corpus, order
    self._seed, self._shard = seed, shard
    self._ahead_until = (0, 0)     # (epoch, position) the corpus has tokenized ahead to
    self.epoch_len = len(order)
    self.dropped_tokens = 0
    self.real_tokens = self.row_tokens = 0   # filled vs total row positions, for the padding warning

  def doc_id(self, epoch: int, pos: int) -> int:
    return int(self._order[epoch * self.epoch_len + pos])

  def window(self, epoch: int, cursor, n_rows: int):
    """(rows dict, cursor after them); the cursor is (epoch_len, 0) once the epoch is used up."""
    if isinstance(self.layout, PerDocument):
      return self._instance_window(epoch, cursor, n_rows)
    lay = self.layout
    need = n_rows * lay.width
    tokens, docs, end = self._stream(epoch, cursor, need, lay.lookahead)
    used = min(len(tokens), need)
    if lay.drop_remainder:
      keep = used // lay.width * lay.width
      self.dropped_tokens += used - keep
      tokens, docs, used = tokens[:keep], docs[:keep], keep
    rows = lay.build(tokens[:need + lay.lookahead], docs[:need + lay.lookahead])
    self._count(used, rows, lay.width)
    return rows, end

  def _read_ahead(self, epoch: int, pos: int):
    """With worker processes: let the corpus tokenize the next read_ahead documents at once."""
    ahead = getattr(self.corpus, "read_ahead", 0)
    if ahead and (epoch, pos) >= self._ahead_until:
      stop = min(pos + ahead, self.epoch_len)
      self.corpus.prefetch([self.doc_id(epoch, p) for p in range(pos, stop)])
      self._ahead_until = (epoch, stop)

  def _count(self, real, rows, width):
    self.real_tokens += real
    self.row_tokens += len(next(iter(rows.values()))) * width

  def _stream(self, epoch, cursor, need, lookahead):
    """Tokens of the concatenated documents from cursor (and their positions as document numbers)."""
    pos, off = cursor
    pieces, total, start = [], 0, pos
    sep = self.layout.separator
    while total < need + lookahead and pos < self.epoch_len:
      stop = min(pos + corpus_lib.DOCS_PER_CALL, self.epoch_len)
      self._read_ahead(epoch, pos)
      for p, toks in zip(range(pos, stop), self.corpus.tokens([self.doc_id(epoch, p) for p in range(pos, stop)])):
        if len(toks) and sep is not None:
          toks = np.append(toks, sep)
        toks = toks[off:] if p == start else toks
        pieces.append((p, off if p == start else 0, toks))
        total += len(toks)
        pos = p + 1
        if total >= need + lookahead:
          break
    end = (self.epoch_len, 0)
    seen = 0
    for p, first, toks in pieces:      # the cursor is the stream position `need`
      if seen + len(toks) > need:
        end = (p, first + need - seen)
        break
      seen += len(toks)
    else:
      if pos < self.epoch_len:
        end = (pos, 0)
    if not pieces:
      return np.zeros(0, np.int32), np.zeros(0, np.int64), end
    tokens = np.concatenate([t for _, _, t in pieces]).astype(np.int32)
    docs = np.concatenate([np.full(len(t), p, np.int64) for p, _, t in pieces])
    return tokens, docs, end

  def instances(self, epoch: int, pos: int) -> list:
    """The instances of the document at `pos`: prepared ahead (data/prepared.py's PreparedRows) or drawn here."""
    doc = self.doc_id(epoch, pos)
    if hasattr(self.corpus, "instances"):
      return self.corpus.instances(epoch, doc)
    return self.doc_instances(epoch, doc)

  def doc_instances(self, epoch: int, doc: int) -> list:
    """The instances of document `doc` in `epoch`, a pure function of (seed, shard, epoch, document)."""
    segments = self.corpus.tokens([doc])[0]
    if not segments:
      return []

    def other_doc(rng):
      for _ in range(10):
        j = self.doc_id(epoch, int(rng.integers(0, self.epoch_len)))
        segs = self.corpus.tokens([j])[0]
        if j != doc and segs:
          return segs
      return segments                   # a one-document corpus: BERT also falls back after 10 tries
    rng = np.random.default_rng([self._seed, self._shard, epoch, doc])
    return self.layout.instances(segments, rng, other_doc)

  def _instance_window(self, epoch, cursor, n_rows):
    pos, off = cursor
    out, ready = [], pos
    while len(out) < n_rows and pos < self.epoch_len:
      if pos >= ready and not hasattr(self.corpus, "instances"):   # tokenize the next documents in one call
        ready = min(pos + corpus_lib.DOCS_PER_CALL, self.epoch_len)
        self._read_ahead(epoch, pos)
        self.corpus.tokens([self.doc_id(epoch, p) for p in range(pos, ready)])
      found = self.instances(epoch, pos)
      take = found[off:off + n_rows - len(out)]
      out += take
      off += len(take)
      if off >= len(found):
        pos, off = pos + 1, 0
    rows = self.layout.assemble(out)
    self._count(sum(map(self.layout.real_tokens, out)), rows, self.layout.width)
    return rows, (pos, off)

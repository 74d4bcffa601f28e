"""The input pipeline: documents -> tokens -> rows -> objective transform -> batches of numpy arrays.

Rows per objective:
  clm              packed rows of the document stream (each document + eos), segment ids and positions
  span_corruption  chunks of the stream of the raw length T5's rule gives (512 -> 568), then corrupt_spans
  mlm              [CLS] A [SEP] B [SEP] pairs from document structure with config.data.nsp (BERT), else
                   [CLS] chunk [SEP] of the stream (documents separated by [SEP]); then mask_tokens

Determinism and resumption: host h takes documents h, h + P, ... (P = process_count) and visits them in a
new grain shuffle each epoch. Rows are made in windows of `window_rows` from a cursor (position in the
epoch's document order, offset inside that document) and shuffled within the window by a seeded
permutation. The iterator state (epoch, window, cursor at the window start, rows used, batch index) is a
small JSON dict: restoring rebuilds the window from its cursor and skips the used rows, so a resumed run
sees exactly the batches it would have seen. Masking / span corruption draw from
np.random.default_rng([seed, process_index, batch_index]).
"""
import queue
import threading

import grain
import numpy as np
from absl import logging

from lm_jax.data import corruption, masking, nsp, packing, sources

WINDOW_ROWS = 1024            # rows shuffled together; a restore rebuilds at most this many
_DOCS_PER_CALL = 32           # documents tokenized per batched encode call
_CACHE_TOKENS = 50_000_000    # tokenized documents kept in memory (small corpora are tokenized once)
_MIN_TOKENS = 2               # shorter documents are counted as too short and skipped


class Corpus:
  """Tokenized documents of one split, encoded in batches and cached.

  stats counts records as they are tokenized: once each for a corpus that fits in the cache, on every
  visit for larger ones.
  """

  def __init__(self, docs, tokenizer, *, as_sentences: bool):
    self.docs, self.path = docs, docs.path
    self._tok, self._as_sentences = tokenizer, as_sentences
    self._cache, self._cached, self._recent = {}, 0, {}
    self.stats = dict(documents=0, empty=0, undecodable=0, malformed=0, too_short=0)
    self.bytes = self.tokens_count = 0

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
      reason = text.reason if isinstance(text, sources.Bad) else ("empty" if not text.strip() else None)
      if reason:
        self._store(i, [] if self._as_sentences else np.zeros(0, np.int32), reason)
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
        self._store(i, segs if n >= _MIN_TOKENS else [], None if n >= _MIN_TOKENS else "too_short")
    else:
      for i, t, ids_ in zip(good, texts, self._tok.encode_batch(texts)):
        self._count([t], len(ids_))
        ok = len(ids_) >= _MIN_TOKENS
        self._store(i, np.asarray(ids_ if ok else [], np.int32), None if ok else "too_short")

  def _count(self, texts, n):
    self.bytes += sum(len(t.encode("utf-8")) for t in texts)
    self.tokens_count += n

  def _store(self, i, value, reason):
    self.stats["documents"] += 1
    if reason:
      self.stats[reason] += 1
    size = sum(map(len, value)) if self._as_sentences else len(value)
    if self._cached + size <= _CACHE_TOKENS:
      self._cache[i] = value
      self._cached += size
    else:                        # cache full: keep the last few hundred documents only
      self._recent[i] = value
      if len(self._recent) > 8 * _DOCS_PER_CALL:
        del self._recent[next(iter(self._recent))]


class Rows:
  """Rows of one objective from a corpus in a per-epoch document order, restartable from a cursor."""

  def __init__(self, config, tokenizer, corpus, order, *, seed, process_index):
    d = config.data
    self.corpus, self._order, self._tok = corpus, order, tokenizer
    self._seed, self._host = seed, process_index
    self.kind = "nsp" if config.objective == "mlm" and d.nsp else config.objective
    if self.kind not in ("clm", "span_corruption", "mlm", "nsp"):
      raise ValueError(f"config.objective={config.objective!r} has no input pipeline")
    self.seq_len = d.seq_len
    self.width = {"clm": d.seq_len, "mlm": d.seq_len - 2, "nsp": 0,
                  "span_corruption": raw_length(config)}[self.kind]
    self._sep = {"clm": tokenizer.eos_id, "mlm": tokenizer.sep_id}.get(self.kind)
    self.epoch_len = len(order)
    self.dropped_tokens = 0

  def doc_id(self, epoch: int, pos: int) -> int:
    return int(self._order[epoch * self.epoch_len + pos])

  def window(self, epoch: int, cursor, n_rows: int):
    """(rows dict, cursor after them); the cursor is (epoch_len, 0) once the epoch is used up."""
    if self.kind == "nsp":
      return self._pair_window(epoch, cursor, n_rows)
    need = n_rows * self.width
    tokens, docs, end = self._stream(epoch, cursor, need, lookahead=int(self.kind == "clm"))
    t = self._tok
    if self.kind == "clm":
      return packing.causal_rows(tokens[:need + 1], docs[:need + 1], self.seq_len, t.pad_id), end
    if self.kind == "span_corruption":
      rows = packing.chunk_rows(tokens[:need], self.width, pad_id=None)
      self.dropped_tokens += min(len(tokens), need) - rows.size
      return {"tokens": rows}, end
    chunks = packing.chunk_rows(tokens[:need], self.width, pad_id=t.pad_id)
    return packing.bert_rows(chunks, cls_id=t.cls_id, sep_id=t.sep_id, pad_id=t.pad_id), end

  def _stream(self, epoch, cursor, need, lookahead):
    """Tokens of the concatenated documents from cursor (and their positions as document numbers)."""
    pos, off = cursor
    pieces, total, start = [], 0, pos
    while total < need + lookahead and pos < self.epoch_len:
      stop = min(pos + _DOCS_PER_CALL, self.epoch_len)
      for p, toks in zip(range(pos, stop), self.corpus.tokens([self.doc_id(epoch, p) for p in range(pos, stop)])):
        if len(toks) and self._sep is not None:
          toks = np.append(toks, self._sep)
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

  def pairs(self, epoch: int, pos: int) -> list:
    """The NSP pairs of the document at `pos`, a pure function of (seed, host, epoch, document)."""
    doc = self.doc_id(epoch, pos)
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
    rng = np.random.default_rng([self._seed, self._host, epoch, doc])
    return nsp.instances(segments, rng=rng, seq_len=self.seq_len, other_doc=other_doc)

  def _pair_window(self, epoch, cursor, n_rows):
    pos, off = cursor
    out, ready = [], pos
    while len(out) < n_rows and pos < self.epoch_len:
      if pos >= ready:     # tokenize the next documents together, one batched call
        ready = min(pos + _DOCS_PER_CALL, self.epoch_len)
        self.corpus.tokens([self.doc_id(epoch, p) for p in range(pos, ready)])
      pairs = self.pairs(epoch, pos)
      take = pairs[off:off + n_rows - len(out)]
      out += take
      off += len(take)
      if off >= len(pairs):
        pos, off = pos + 1, 0
    t = self._tok
    rows = nsp.assemble(out, seq_len=self.seq_len, cls_id=t.cls_id, sep_id=t.sep_id, pad_id=t.pad_id)
    return rows, (pos, off)


def raw_length(config) -> int:
  d = config.data
  return corruption.span_lengths(d.seq_len, d.noise_density, d.mean_noise_span_length)[0]


def target_length(config) -> int:
  d = config.data
  return d.target_len or corruption.span_lengths(d.seq_len, d.noise_density, d.mean_noise_span_length)[1]


def make_transform(config, tokenizer):
  """rows dict, rng -> the objective's batch features (masking / span corruption happen here)."""
  d, t = config.data, tokenizer
  if config.objective == "mlm":
    def transform(rows, rng):
      ids = rows["input_ids"]
      starts = t.word_starts(ids) if d.whole_word_mask else None
      masked = masking.mask_tokens(ids, rng=rng, vocab_size=t.vocab_size, mask_id=t.mask_id,
                                   special_ids=t.special_ids, rate=d.mlm_probability,
                                   max_predictions=d.max_predictions_per_seq, word_starts=starts)
      return {**rows, **masked}
  elif config.objective == "span_corruption":
    targets_length = target_length(config)

    def transform(rows, rng):
      out = corruption.corrupt_spans(rows["tokens"], rng=rng, vocab_size=t.sentinel_id(0) + 1,
                                     eos_id=t.eos_id, noise_density=d.noise_density,
                                     mean_span=d.mean_noise_span_length, inputs_length=d.seq_len,
                                     targets_length=targets_length)
      targets = out["decoder_target_ids"]
      start = config.model.get("decoder_start_token_id", 0)
      real = (targets != t.pad_id).astype(np.int32)
      return dict(input_ids=out["input_ids"], attention_mask=(out["input_ids"] != t.pad_id).astype(np.int32),
                  decoder_input_ids=np.concatenate([np.full((len(targets), 1), start, np.int32),
                                                    targets[:, :-1]], 1).astype(np.int32),
                  decoder_target_ids=targets, decoder_attention_mask=real, weights=real.astype(np.float32))
  else:
    def transform(rows, rng):
      del rng
      return rows
  return transform


def _take(rows: dict, idx) -> dict:
  return {k: v[idx] for k, v in rows.items()}


def _concat(parts: list) -> dict:
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class TrainIterator:
  """Endless local batches; get_state() / set_state() for checkpoints; a thread prepares batches ahead."""

  def __init__(self, rows: Rows, transform, *, batch_size, seed, process_index, process_count,
               shuffle=True, window_rows=WINDOW_ROWS, prefetch=2):
    self._rows, self._transform, self._batch = rows, transform, batch_size
    self._seed, self._host, self._hosts = seed, process_index, process_count
    self._shuffle, self._window_rows, self._prefetch = shuffle, window_rows, prefetch
    self._state = dict(epoch=0, window=0, cursor=[0, 0], row=0, batch_index=0)
    self._consumed = dict(self._state)
    self._win = self._logged = None
    self._thread = self._queue = None
    self._stop = threading.Event()

  @property
  def stats(self) -> dict:
    """Bad records skipped so far (each counted once) and tokens dropped at epoch ends."""
    return {**self._rows.corpus.stats, "dropped_tokens": self._rows.dropped_tokens}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if not self._prefetch:
      batch, self._consumed = self._produce()
      return batch
    if self._thread is None:
      self._start()
    item = self._queue.get()
    if isinstance(item, BaseException):
      self._thread = None
      raise item
    batch, self._consumed = item
    return batch

  def get_state(self) -> dict:
    """JSON-serialisable position after the last batch returned."""
    return dict(self._consumed, cursor=list(self._consumed["cursor"]), seed=self._seed,
                process_index=self._host, process_count=self._hosts)

  def set_state(self, state: dict):
    for key, mine in (("seed", self._seed), ("process_index", self._host), ("process_count", self._hosts)):
      if key in state and state[key] != mine:
        raise ValueError(f"data iterator state has {key}={state[key]}, this run has {mine}")
    self._halt()
    self._state = {k: state[k] for k in ("epoch", "window", "row", "batch_index")}
    self._state["cursor"] = list(state["cursor"])
    self._consumed = dict(self._state)
    self._win = None

  def close(self):
    self._halt()

  # -- producer side: everything below runs on the prefetch thread (or inline without prefetch)
  def _produce(self):
    s, parts, need = self._state, [], self._batch
    while need:
      if self._win is None:
        self._win = self._make_window()
      rows, n = self._win
      take = min(need, n - s["row"])
      parts.append(_take(rows, slice(s["row"], s["row"] + take)))
      s["row"] += take
      need -= take
      if s["row"] == n:
        self._advance()
    rng = np.random.default_rng([self._seed, self._host, s["batch_index"]])
    batch = self._transform(_concat(parts), rng)
    s["batch_index"] += 1
    return batch, dict(s, cursor=list(s["cursor"]))

  def _make_window(self):
    s, r = self._state, self._rows
    empty_epochs = 0
    while True:
      rows, end = r.window(s["epoch"], tuple(s["cursor"]), self._window_rows)
      n = len(next(iter(rows.values())))
      self._end = end
      if n:
        break
      empty_epochs += 1
      if empty_epochs > 1 or (s["cursor"] == [0, 0] and s["window"] == 0):
        raise ValueError(f"no usable documents in {r.corpus.path} for host {self._host}/{self._hosts} "
                         f"(skipped: {r.corpus.stats})")
      self._next_epoch()
    if self._shuffle:
      perm = np.random.default_rng([self._seed, self._host, s["epoch"], s["window"]]).permutation(n)
      rows = _take(rows, perm)
    return rows, n

  def _advance(self):
    s = self._state
    s["cursor"], s["window"], s["row"] = list(self._end), s["window"] + 1, 0
    self._win = None
    if self._end[0] >= self._rows.epoch_len:
      self._next_epoch()

  def _next_epoch(self):
    s = self._state
    stats = self.stats
    if stats != self._logged and any(v for k, v in stats.items() if k not in ("documents", "dropped_tokens")):
      logging.warning("data: epoch %d of %s done; skipped %s", s["epoch"], self._rows.corpus.path, stats)
      self._logged = stats
    s["epoch"], s["window"], s["cursor"], s["row"] = s["epoch"] + 1, 0, [0, 0], 0

  def _start(self):
    self._stop.clear()
    self._queue = queue.Queue(self._prefetch)
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      try:
        item = self._produce()
      except Exception as e:   # handed to the consumer, raised by next()
        item = e
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if isinstance(item, Exception):
        return

  def _halt(self):
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
    self._state = dict(self._consumed, cursor=list(self._consumed["cursor"]))
    self._win = None


class EvalBatches:
  """A finite, re-iterable list of local eval batches; .bytes_per_token for bits per byte."""

  def __init__(self, batches, bytes_per_token, stats):
    self._batches, self.bytes_per_token, self.stats = batches, bytes_per_token, stats

  def __len__(self):
    return len(self._batches)

  def __iter__(self):
    return iter(self._batches)


def _check_batch(config, process_count) -> int:
  if config.batch_size % process_count:
    raise ValueError(f"config.batch_size={config.batch_size} is not divisible by {process_count} processes")
  return config.batch_size // process_count


def shard_order(n_docs: int, *, seed: int, shuffle: bool, process_index: int, process_count: int):
  """This host's documents (every process_count-th): order[e * len(order) + i] is epoch e's i-th one.

  grain's shuffle draws a new permutation for every epoch (seed + e); without shuffle every epoch is the
  same order.
  """
  order = grain.MapDataset.range(n_docs)[process_index::process_count]
  return order.shuffle(seed=seed) if shuffle else order


def make_train_iterator(config, tokenizer, *, process_index: int = 0, process_count: int = 1,
                        window_rows: int = WINDOW_ROWS, prefetch: int = 2) -> TrainIterator:
  """Endless batches of this host's shard of config.data.train_split, reshuffled every epoch."""
  local = _check_batch(config, process_count)
  docs = sources.documents(config, config.data.train_split)
  if len(docs) < process_count:
    raise ValueError(f"{docs.path}: {len(docs)} documents cannot be shared by {process_count} processes")
  order = shard_order(len(docs), seed=config.seed, shuffle=config.data.shuffle, process_index=process_index,
                      process_count=process_count)
  corpus = Corpus(docs, tokenizer, as_sentences=config.objective == "mlm" and config.data.nsp)
  rows = Rows(config, tokenizer, corpus, order, seed=config.seed, process_index=process_index)
  return TrainIterator(rows, make_transform(config, tokenizer), batch_size=local, seed=config.seed,
                       process_index=process_index, process_count=process_count, shuffle=config.data.shuffle,
                       window_rows=window_rows, prefetch=prefetch)


def make_eval_iterator(config, tokenizer, *, process_index: int = 0, process_count: int = 1) -> EvalBatches:
  """config.data.eval_batches batches of config.data.eval_split, the same on every run (no shuffle).

  Every host builds the same global batches from the start of the split and keeps its block of rows,
  so all hosts agree on the number of batches.
  """
  local = _check_batch(config, process_count)
  docs = sources.documents(config, config.data.eval_split)
  corpus = Corpus(docs, tokenizer, as_sentences=config.objective == "mlm" and config.data.nsp)
  order = grain.MapDataset.range(len(docs))
  rows_source = Rows(config, tokenizer, corpus, order, seed=config.seed, process_index=0)
  want = config.data.eval_batches * config.batch_size
  rows, _ = rows_source.window(0, (0, 0), want)
  n_batches = min(config.data.eval_batches, len(next(iter(rows.values()))) // config.batch_size)
  if n_batches == 0:
    raise ValueError(f"{docs.path} is too small for one eval batch of {config.batch_size} rows")
  transform = make_transform(config, tokenizer)
  batches = []
  for b in range(n_batches):
    start = b * config.batch_size + process_index * local
    rng = np.random.default_rng([config.seed, process_index, b, 1])
    batches.append(transform(_take(rows, slice(start, start + local)), rng))
  return EvalBatches(batches, corpus.bytes / max(corpus.tokens_count, 1), corpus.stats)

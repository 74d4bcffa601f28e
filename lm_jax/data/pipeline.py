"""The input pipeline: documents -> tokens -> rows (the objective's layout) -> its transform -> batches.

One global stream, whatever the number of hosts. The training documents are cut into config.data.shards
shards (document i goes to shard i % shards); every global batch takes batch_size / shards rows from each
shard, in shard order, and shard k's rows for batch b are transformed (masking, span corruption) with
np.random.default_rng([seed, k, b]). The global batch at step s is therefore a function of the data config,
the seed and s only. Each host builds the shards that overlap its slice of the global batch (rows
[h * B / P, (h + 1) * B / P)) and keeps that slice, so 1 or N hosts train on the same batches, and a run
resumed on another number of hosts continues the same stream. More shards spread the host work: with
shards a multiple of the process count every host builds only its own shards.

Inside a shard the documents are visited in a new grain shuffle each epoch; rows are made in windows of
`window_rows` from a cursor and shuffled within the window. A shard's state (epoch, window, cursor at the
window start, rows used) is a small JSON dict; restoring rebuilds the window from its cursor and skips the
used rows, so a resumed run sees exactly the batches it would have seen.

With config.data.mixture (data/mixture.py) every shard is a MixedStream: the same shard of each source, its rows
drawn among them by weight; its state holds every source's shard state and the rows each source has given. Each
source's eval split is evaluated on its own too (EvalBatches.sources).
"""
import collections
import queue
import threading

import grain
import numpy as np
from absl import logging

from lm_jax.data import corpus as corpus_lib
from lm_jax.data import mixture as mixture_lib
from lm_jax.data import prepared
from lm_jax.data import rows as rows_lib
from lm_jax.data import sources, workers
from lm_jax.data import windows as windows_lib

WINDOW_ROWS = 1024            # rows shuffled together; a restore rebuilds at most this many
_WHOLE_SPLIT = 1 << 40       # rows to ask for when evaluating a whole split
_MOSTLY_PADDING = 0.5         # warn when less than this fraction of the row positions hold tokens
_BAD = ("malformed", "undecodable")   # the records.Bad reasons a train record counts (not empty or short documents)


def skipped(it) -> dict:
  """What a train record says of the bad records the training stream skipped so far in this process (so many
  since a resume): {'bad_records': n} once there are any (nanoGPT's windows read whole text and have none)."""
  n = getattr(it, "bad_records", 0)
  return {"bad_records": n} if n else {}


def _take(rows: dict, idx) -> dict:
  return {k: v[idx] for k, v in rows.items()}


def _concat(parts: list) -> dict:
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _num_rows(rows: dict) -> int:
  return len(next(iter(rows.values())))


def shard_order(n_docs: int, *, seed: int, shuffle: bool, shard: int, shards: int):
  """Shard `shard`'s documents (every shards-th): order[e * len(order) + i] is epoch e's i-th one.

  grain's shuffle draws a new permutation for every epoch; each shard has its own seed.
  """
  order = grain.MapDataset.range(n_docs)[shard::shards]
  seed = int(np.random.SeedSequence([seed, shard]).generate_state(1)[0])
  return order.shuffle(seed=seed) if shuffle else order


class ShardStream:
  """Consecutive rows of one shard across windows and epochs; `state` is JSON-serialisable."""

  def __init__(self, rows: rows_lib.ShardRows, *, seed: int, shard: int, shuffle: bool, window_rows: int):
    self.rows, self.shard = rows, shard
    self._seed, self._shuffle, self._window_rows = seed, shuffle, window_rows
    self.state = dict(epoch=0, window=0, cursor=[0, 0], row=0)
    self._win = self._end = self._logged = None

  def reset(self, state: dict):
    self.state = dict(epoch=state["epoch"], window=state["window"], cursor=list(state["cursor"]), row=state["row"])
    self._win = None

  def snapshot(self) -> dict:
    return dict(self.state, cursor=list(self.state["cursor"]))

  def take(self, n: int, batch_index: int = 0) -> dict:
    """The next n rows (batch_index: what a MixedStream draws its sources by; one source takes them in order)."""
    del batch_index
    parts, s = [], self.state
    while n:
      if self._win is None:
        self._win = self._make_window()
      rows, size = self._win
      k = min(n, size - s["row"])
      parts.append(_take(rows, slice(s["row"], s["row"] + k)))
      s["row"] += k
      n -= k
      if s["row"] == size:
        s["cursor"], s["window"], s["row"] = list(self._end), s["window"] + 1, 0
        self._win = None
        if self._end[0] >= self.rows.epoch_len:
          self._next_epoch()
    return _concat(parts)

  def _make_window(self):
    s, r = self.state, self.rows
    empty_epochs = 0
    while True:
      rows, self._end = r.window(s["epoch"], tuple(s["cursor"]), self._window_rows)
      n = _num_rows(rows)
      if n:
        break
      empty_epochs += 1
      if empty_epochs > 1 or (s["cursor"] == [0, 0] and s["window"] == 0):
        raise ValueError(f"no usable documents in {r.corpus.path} for data shard {self.shard} "
                         f"(skipped: {r.corpus.stats}); first: {'; '.join(r.corpus.tally.first)}")
      self._next_epoch()
    if self._shuffle:
      rows = _take(rows, np.random.default_rng([self._seed, self.shard, s["epoch"], s["window"]]).permutation(n))
    return rows, n

  def _next_epoch(self):
    s, r = self.state, self.rows
    stats, report = dict(r.corpus.stats, dropped_tokens=r.dropped_tokens), r.corpus.tally.report()
    if stats != self._logged and report:
      logging.warning("data: epoch %d (shard %d) done: %s; %d tokens dropped at epoch ends", s["epoch"], self.shard,
                      report, r.dropped_tokens)
      self._logged = stats
    s["epoch"], s["window"], s["cursor"], s["row"] = s["epoch"] + 1, 0, [0, 0], 0


class MixedStream:
  """One shard of a data mixture: the rows of each batch drawn among the sources' ShardStreams by weight
  (mixture.draw) and kept in the drawn order. `rows_taken` counts each source's rows so far."""

  def __init__(self, streams: dict, probabilities, *, seed: int, shard: int):
    self.streams, self.shard, self._p, self._seed = streams, shard, probabilities, seed
    self.rows_taken = dict.fromkeys(streams, 0)

  def snapshot(self) -> dict:
    return {"rows": dict(self.rows_taken), "sources": {name: s.snapshot() for name, s in self.streams.items()}}

  def reset(self, state: dict):
    missing = [name for name in self.streams if name not in state.get("sources", {})]
    if missing:
      raise ValueError(f"data iterator state has no position for mixture source(s) {', '.join(missing)} in data "
                       f"shard {self.shard}")
    for name, s in self.streams.items():
      s.reset(state["sources"][name])
    self.rows_taken = dict(state["rows"])

  def take(self, n: int, batch_index: int) -> dict:
    which = mixture_lib.draw(self._p, n, seed=self._seed, shard=self.shard, batch_index=batch_index)
    parts = []
    for j, (name, s) in enumerate(self.streams.items()):
      k = int((which == j).sum())
      if k:
        parts.append(s.take(k))
        self.rows_taken[name] += k
    grouped = _concat(parts)                 # the rows by source; put back in the drawn order
    return _take(grouped, np.argsort(np.argsort(which, kind="stable"), kind="stable"))


def _parts(stream) -> list:
  """The ShardStreams of a shard: itself, or a mixture's one per source."""
  return list(stream.streams.values()) if isinstance(stream, MixedStream) else [stream]


def _warn_if_thin(stream: ShardStream, rows_per_batch: int):
  """After the first epoch's first window: say so when rows are mostly padding or an epoch is smaller than a
  batch (the same rows then repeat inside every batch)."""
  r = stream.rows
  if r.row_tokens and r.real_tokens < _MOSTLY_PADDING * r.row_tokens:
    logging.warning("data: rows of %s are %.0f%% padding (%d tokens in %d row positions); the documents are short "
                    "for data.seq_len", r.corpus.path, 100 * (1 - r.real_tokens / r.row_tokens), r.real_tokens,
                    r.row_tokens)
  if stream.state["epoch"] > 0 and stream.state["window"] == 0:
    logging.warning("data: one epoch of %s (shard %d) gives fewer rows than the %d the batch takes from it: "
                    "batches repeat the same rows", r.corpus.path, stream.shard, rows_per_batch)


class TrainIterator:
  """Endless local batches (this host's slice of each global batch); get_state() / set_state() for
  checkpoints; a thread prepares batches ahead."""

  def __init__(self, streams: list, corpora: list, transform, *, seed: int, rows_per_shard: int, local: slice,
               prefetch: int = 2, held_out: str = ""):
    self._streams, self._corpora, self._transform, self._seed = streams, corpora, transform, seed
    self._held_out = held_out     # sources.held_out's rule, kept in the state
    self._rows_per_shard, self._local, self._prefetch = rows_per_shard, local, prefetch
    self._batch_index = 0
    self._consumed = self._snapshot()
    self._thread = self._queue = None
    self._stop = threading.Event()
    self._checked = False
    self.bad_records = 0          # malformed and undecodable records skipped until the last batch returned

  @property
  def stats(self) -> dict:
    """Bad records skipped so far (each counted once), tokens dropped at epoch ends, invalid UTF-8 replaced."""
    counts, decoded = collections.Counter(), collections.Counter()
    for corpus in self._corpora:         # a mixture's sources add up
      counts.update(corpus.stats)
      decoded.update(corpus.docs.decode_stats)
    dropped = sum(p.rows.dropped_tokens for s in self._streams for p in _parts(s))
    return {**counts, "dropped_tokens": dropped, **decoded}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if not self._prefetch:
      batch, self._consumed, self.bad_records = self._produce()
      return batch
    if self._thread is None:
      self._start()
    item = self._queue.get()
    if isinstance(item, BaseException):
      self._thread = None
      raise item
    batch, self._consumed, self.bad_records = item
    return batch

  def get_state(self) -> dict:
    """JSON-serialisable position after the last batch returned: the batch index and the state of the
    shards this host reads (checkpoint.data_state merges every host's shards); a mixture's shard state holds
    every source's."""
    return {"batch_index": self._consumed["batch_index"], "shards": dict(self._consumed["shards"]),
            **({"held_out": self._held_out} if self._held_out else {})}

  def set_state(self, state: dict):
    missing = [str(s.shard) for s in self._streams if str(s.shard) not in state.get("shards", {})]
    if missing:
      raise ValueError(f"data iterator state has no position for data shard(s) {', '.join(missing)}")
    sources.resumed_with(state.get("held_out", ""), self._held_out)
    self._halt()
    self._batch_index = state["batch_index"]
    for s in self._streams:
      s.reset(state["shards"][str(s.shard)])
    self._consumed = self._snapshot()

  def close(self):
    self._halt()

  # -- producer side: everything below runs on the prefetch thread (or inline without prefetch)
  def _snapshot(self) -> dict:
    return {"batch_index": self._batch_index,
            "shards": {str(s.shard): s.snapshot() for s in self._streams}}

  def _produce(self):
    parts = []
    for s in self._streams:
      rows = s.take(self._rows_per_shard, self._batch_index)
      parts.append(self._transform(rows, np.random.default_rng([self._seed, s.shard, self._batch_index])))
    if not self._checked:
      for s in self._streams:
        for p in _parts(s):
          _warn_if_thin(p, self._rows_per_shard)
      self._checked = True
    self._batch_index += 1
    bad = sum(c.stats.get(reason, 0) for c in self._corpora for reason in _BAD)
    return _take(_concat(parts), self._local), self._snapshot(), bad

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
    self._batch_index = self._consumed["batch_index"]
    for s in self._streams:
      s.reset(self._consumed["shards"][str(s.shard)])


class EvalBatches:
  """A finite, re-iterable list of local eval batches; .text_per_token {'bytes', 'chars'} of the eval text, for
  bits per byte and per character. A mixture's batches are those of every source in turn: .sources maps each
  source's name to (its slice of the batches, its text_per_token)."""

  def __init__(self, batches, text_per_token: dict, stats, sources: dict | None = None):
    self._batches, self.text_per_token, self.stats = batches, text_per_token, stats
    self.sources = sources or {}

  def __len__(self):
    return len(self._batches)

  def __iter__(self):
    return iter(self._batches)


def _layout(config, tokenizer, objective) -> tuple:
  """(rows layout, transform): the objective's, or with rows prepared ahead (data/prepared.py) finished rows
  that need no transform."""
  layout = objective.rows(config, tokenizer)
  if prepared.passes(config, layout):
    return prepared.rows_layout(layout.width, objective.features(config)), lambda rows, rng: rows
  return layout, objective.transform(config, tokenizer)


def _corpus(config, split: str, layout, tokenizer, source: mixture_lib.Source | None = None, role: str = "train"):
  """The tokenized split: the layout's own corpus (task examples) or config.data's documents (or a mixture
  source's); both count what they skip in a records.Tally (.tally, .stats). `role` ('train' or 'eval') picks a
  prepared split's rows."""
  if getattr(layout, "corpus", None):
    if source is not None:
      raise ValueError(f"config.data.mixture mixes pre-training text; objective {config.objective!r} reads its "
                       "examples from config.task: clear the mixture")
    return layout.corpus(split)
  if config.data.prepared:
    return prepared.open_split(config, split, tokenizer, layout.as_sentences, role, source)
  docs = sources.documents(config, split, source)
  n = workers.count(config.data.workers)
  pool = workers.Workers(tokenizer, n) if n > 1 else None
  return corpus_lib.Corpus(docs, tokenizer, as_sentences=layout.as_sentences, workers=pool)


def _local_rows(config, process_index: int, process_count: int) -> slice:
  """This host's rows of the global batch."""
  if config.batch_size % process_count:
    raise ValueError(f"config.batch_size={config.batch_size} is not divisible by {process_count} processes")
  local = config.batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


def _shard_stream(config, layout, corpus, k: int, seed: int, window_rows: int) -> ShardStream:
  order = shard_order(len(corpus), seed=seed, shuffle=config.data.shuffle, shard=k, shards=config.data.shards)
  rows = rows_lib.ShardRows(layout, corpus, order, seed=seed, shard=k)
  return ShardStream(rows, seed=seed, shard=k, shuffle=config.data.shuffle, window_rows=window_rows)


def make_train_iterator(config, tokenizer, objective, *, process_index: int = 0, process_count: int = 1,
                        window_rows: int = WINDOW_ROWS, prefetch: int = 2) -> TrainIterator:
  """Endless batches: this host's slice of the global stream of config.data.train_split (or of the mixture)."""
  d, shards = config.data, config.data.shards
  if shards < 1 or config.batch_size % shards:
    raise ValueError(f"config.data.shards={shards} must be >= 1 and divide config.batch_size={config.batch_size}")
  rows_per_shard = config.batch_size // shards
  local = _local_rows(config, process_index, process_count)
  if d.windows:     # nanoGPT's random windows (data/windows.py)
    return windows_lib.train_iterator(config, tokenizer, local)
  first, last = local.start // rows_per_shard, (local.stop - 1) // rows_per_shard
  layout, transform = _layout(config, tokenizer, objective)
  mixture = mixture_lib.sources(config)
  corpora = {s.name: _corpus(config, s.train_split, layout, tokenizer, s) for s in mixture} or {
      "": _corpus(config, d.train_split, layout, tokenizer)}
  for corpus in corpora.values():
    if len(corpus) < shards:
      raise ValueError(f"{corpus.path}: {len(corpus)} documents cannot fill config.data.shards={shards} shards")
  if mixture:
    probabilities = mixture_lib.weights(mixture)
    streams = [MixedStream({s.name: _shard_stream(config, layout, corpora[s.name], k,
                                                  mixture_lib.source_seed(config.seed, s), window_rows)
                            for s in mixture}, probabilities, seed=config.seed, shard=k)
               for k in range(first, last + 1)]
  else:
    streams = [_shard_stream(config, layout, corpora[""], k, config.seed, window_rows) for k in range(first, last + 1)]
  offset = first * rows_per_shard
  return TrainIterator(streams, list(corpora.values()), transform, seed=config.seed,
                       rows_per_shard=rows_per_shard, local=slice(local.start - offset, local.stop - offset),
                       prefetch=prefetch, held_out=sources.held_out(config))


def make_eval_iterator(config, tokenizer, objective, *, process_index: int = 0,
                       process_count: int = 1) -> EvalBatches:
  """config.data.eval_batches global batches of config.data.eval_split from its start (no shuffle; 0 = every
  complete batch of the split), the same on every run and for any number of hosts; each host keeps its slice.
  A layout with `padding` fills the last batch with rows that count in no metric, so every row is evaluated.
  A mixture evaluates that many batches of each source's eval_split, one source after the other."""
  local = _local_rows(config, process_index, process_count)
  if config.data.windows:   # the whole eval text in consecutive windows (data/windows.py)
    return EvalBatches(*windows_lib.eval_batches(config, tokenizer, local), stats={})
  layout, transform = _layout(config, tokenizer, objective)
  mixture = mixture_lib.sources(config)
  if not mixture:
    corpus = _corpus(config, config.data.eval_split, layout, tokenizer, role="eval")
    return EvalBatches(_eval_batches(config, corpus, layout, transform, local), _text_per_token([corpus]), corpus.stats)
  batches, parts, corpora = [], {}, []
  for s in mixture:
    corpus = _corpus(config, s.eval_split, layout, tokenizer, s, role="eval")
    found = _eval_batches(config, corpus, layout, transform, local)
    parts[s.name] = (slice(len(batches), len(batches) + len(found)), _text_per_token([corpus]))
    batches += found
    corpora.append(corpus)
  stats = collections.Counter()
  for corpus in corpora:
    stats.update(corpus.stats)
  return EvalBatches(batches, _text_per_token(corpora), dict(stats), parts)


def _text_per_token(corpora: list) -> dict:
  tokens = max(sum(c.tokens_count for c in corpora), 1)
  return {"bytes": sum(c.bytes for c in corpora) / tokens, "chars": sum(c.chars for c in corpora) / tokens}


def _eval_batches(config, corpus, layout, transform, local: slice) -> list:
  """This host's slices of the eval batches of one corpus."""
  source = rows_lib.ShardRows(layout, corpus, grain.MapDataset.range(len(corpus)), seed=config.seed, shard=0)
  rows, _ = source.window(0, (0, 0), config.data.eval_batches * config.batch_size or _WHOLE_SPLIT)
  left = _num_rows(rows) % config.batch_size
  if left and getattr(layout, "padding", None):
    rows = _concat([rows, layout.padding(config.batch_size - left)])
  n_batches = _num_rows(rows) // config.batch_size
  if config.data.eval_batches:
    n_batches = min(config.data.eval_batches, n_batches)
  elif _num_rows(rows) % config.batch_size:
    logging.warning("data: eval of the whole %s leaves out its last %d rows (less than one batch of %d)",
                    corpus.path, _num_rows(rows) % config.batch_size, config.batch_size)
  if n_batches == 0:
    raise ValueError(f"{corpus.path} is too small for one eval batch of {config.batch_size} rows "
                     f"({_num_rows(rows)} rows of data.seq_len={config.data.seq_len})"
                     + (f"; {corpus.tally.report()}" if corpus.tally.report() else ""))
  if corpus.tally.report():
    logging.warning("data: eval: %s", corpus.tally.report())
  batches = []
  for b in range(n_batches):
    global_rows = _take(rows, slice(b * config.batch_size, (b + 1) * config.batch_size))
    batches.append(_take(transform(global_rows, np.random.default_rng([config.seed, b, 1])), local))
  return batches

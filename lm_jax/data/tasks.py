"""Labelled task examples (GLUE-style): one text or a pair, and a label, per record; one model row each.

config.task picks the source (read by data/records.py): `files`, a glob of .tsv / .jsonl in which `{split}` becomes
the split name (e.g. /data/sst2/{split}.tsv with splits train / dev / test), or `tfds_name` (e.g. glue/sst2, through
the same array_record data source as data.tfds_name). `text_fields` names one field, or two for sentence pairs;
`label_field` the label. In a .tsv a header row naming the fields picks the columns; without a header the fields
are column numbers (text_fields=("0",), label_field="1"); a file whose header has no label column is read
unlabelled (a warning says so). Labels are class numbers 0..num_labels-1, or with `label_names` also those names as
written in the data (e.g. entailment / neutral / contradiction); with model.num_labels = 1 they are regression targets
(STS-B); with model.num_labels = 0 they are text, kept as written (the free-form targets of T5's text-to-text tasks).
Multiple choice: `choice_fields` names the K answers, text_fields the one context; the label is the index of the right
answer (Example.segments: context, answers). Splits take TFDS slice syntax (train[:10%]).

A record that cannot be used (empty text, a malformed line, an unknown label) is counted and skipped, like a bad
document, and reported with its file and line (data/records.py). A record without a label (a GLUE test split; TFDS
marks it -1) is kept with label None: it gets a prediction but counts in no metric. Every split is screened when it is
opened (records.screen): a split other than task.test_split with no labelled usable record (a .tsv without its label
column) stops the run in one line; one with some bad records is named in a warning at the start.
"""
import dataclasses
import math

import numpy as np

from lm_jax.data import corpus as corpus_lib
from lm_jax.data import records as records_lib


@dataclasses.dataclass(frozen=True)
class Record:
  texts: tuple            # one or two strings; multiple choice: the context and the K answers
  label: int | float | str | None


@dataclasses.dataclass(frozen=True)
class Example:
  """A tokenized record: segments (one int32 token array per text), label (None = unlabelled), its position in
  the split (for predictions)."""
  segments: tuple
  label: int | float | str | None
  index: int


def _classes(config) -> int:
  """Label values: the answers of a multiple-choice task, else model.num_labels (1 = regression)."""
  return len(config.task.get("choice_fields", ())) or config.model.get("num_labels", 0)


def _fields(config) -> tuple:
  return (*config.task.text_fields, *config.task.get("choice_fields", ()))


def check(config):
  """One-line ValueError naming the config.task field that cannot describe a task."""
  t, n = config.task, _classes(config)
  if bool(t.files) == bool(t.tfds_name):
    raise ValueError("config.task: set exactly one of files (e.g. '/data/sst2/{split}.tsv') and tfds_name "
                     f"(e.g. 'glue/sst2'), got files={t.files!r}, tfds_name={t.tfds_name!r}")
  if not 1 <= len(t.text_fields) <= 2 or not all(isinstance(f, str) and f for f in t.text_fields):
    raise ValueError(f"config.task.text_fields must name one or two fields, got {t.text_fields!r}")
  choices = t.get("choice_fields", ())
  if choices and (len(choices) < 2 or len(t.text_fields) != 1 or not all(isinstance(f, str) and f for f in choices)):
    raise ValueError(f"config.task.choice_fields must name two or more answer fields, with one context in "
                     f"text_fields, got choice_fields={choices!r}, text_fields={t.text_fields!r}")
  if t.label_names and (n == 1 or len(t.label_names) != n):
    raise ValueError(f"config.task.label_names has {len(t.label_names)} names but "
                     + (f"config.task.choice_fields has {n} answers" if choices else f"config.model.num_labels={n}")
                     + (" (regression)" if n == 1 else ""))


def records(config, split: str) -> records_lib.Records:
  """The records of `split` (Record, or records_lib.Bad for one that cannot be used), read by data/records.py."""
  t = config.task
  labels = _Labels(tuple(t.label_names), _classes(config), missing=-1 if t.tfds_name else None)  # TFDS: -1 = none
  fields = _fields(config)
  found = records_lib.read(split, fields, optional=(t.label_field,), files=t.files, tfds_name=t.tfds_name,
                           tfds_data_dir=config.data.tfds_data_dir,
                           origin="config.task.files" if t.files else "config.task.tfds_name",
                           named_by="config.task.text_fields / label_field")
  return found.map(lambda rec: _record(tuple(rec[f] for f in fields), rec.get(t.label_field), labels))


class _Labels:
  """Raw label -> class number, float target (num_labels == 1), text (num_labels == 0), None (missing) or
  records_lib.Bad."""

  def __init__(self, names: tuple, num_labels: int, missing=None):
    self.names, self.num_labels, self.missing = names, num_labels, missing

  def __call__(self, raw):
    raw = raw.strip() if isinstance(raw, str) else raw
    if raw is None or raw == "" or (self.missing is not None and not isinstance(raw, str) and raw == self.missing):
      return None
    if self.num_labels == 1:
      value = _number(raw, float)
      return value if value is not None and math.isfinite(value) else _bad_label(raw, "is not a finite number")
    if self.num_labels == 0:     # text targets (text_to_text): the label as written
      return raw if isinstance(raw, str) else str(raw)
    if isinstance(raw, str) and raw in self.names:
      return self.names.index(raw)
    value = _number(raw, int)
    if value is not None and 0 <= value < self.num_labels:
      return value
    words = "" if self.names or _number(raw, float) is not None else "; label words need config.task.label_names"
    return _bad_label(raw, f"not in 0..{self.num_labels - 1}" + (f" or {', '.join(self.names)}" if self.names else "")
                      + words)


def _bad_label(raw, why: str) -> records_lib.Bad:
  return records_lib.Bad("malformed", f"label {raw} {why}")


def _number(raw, kind):
  try:
    value = kind(raw)
  except (TypeError, ValueError):
    return None
  return value if kind is float or float(raw) == value else None


def _record(texts: tuple, raw_label, labels):
  label = labels(raw_label)
  return label if isinstance(label, records_lib.Bad) else Record(texts, label)


# ------------------------------------------------------------------------------------------------- examples
class TokenizedSplit:
  """The tokenized examples of one split, in the role of data.corpus.Corpus for a rows.PerDocument layout
  with a `corpus`: tokens(ids) gives per id an example, or None for an unusable record (counted in tally / stats).
  Subclasses tokenize a batch of record ids in _tokenize, filling _cache and the counters."""

  def __init__(self, records_, tokenizer, reasons: tuple):
    self.docs, self.path, self._tok = records_, records_.path, tokenizer
    self._cache = {}
    self.tally = records_lib.Tally(records_, ("empty", "malformed", *reasons))
    self.bytes = self.chars = self.tokens_count = 0

  @property
  def stats(self) -> dict:
    return self.tally.counts

  def __len__(self):
    return len(self.docs)

  def tokens(self, ids: list[int]) -> list:
    missing = [i for i in dict.fromkeys(ids) if i not in self._cache]
    for start in range(0, len(missing), corpus_lib.DOCS_PER_CALL):
      self._tokenize(missing[start:start + corpus_lib.DOCS_PER_CALL])
    return [self._cache[i] for i in ids]

  def _tokenize(self, ids):
    raise NotImplementedError

  def _usable(self, ids, problem) -> list:
    """(id, record) of those records that are not Bad and in which problem(record) (a Bad or None) finds nothing
    wrong; the others are skipped."""
    good = []
    for i in ids:
      rec = self.docs[i]
      bad = rec if isinstance(rec, records_lib.Bad) else problem(rec)
      if bad:
        self._skip(i, bad)
      else:
        good.append((i, rec))
    return good

  def _skip(self, i: int, bad: records_lib.Bad):
    self.tally.count(i, bad.reason, bad.detail)
    self._cache[i] = None

  def _measure(self, texts, pieces):
    self.bytes += sum(len(t.encode("utf-8")) for t in texts)
    self.chars += sum(map(len, texts))
    self.tokens_count += sum(map(len, pieces))


class Examples(TokenizedSplit):
  """Task examples (Example: segments, label, index). label_field: the label every record needs to be usable
  (records.screen); '' on a split that may be unlabelled."""

  def __init__(self, records_, tokenizer, label_field: str):
    super().__init__(records_, tokenizer, ("undecodable", "unlabelled"))
    records_lib.screen(records_, lambda rec: _problem(rec, label_field))

  def _tokenize(self, ids):
    good = self._usable(ids, lambda rec: _problem(rec, ""))   # unlabelled: kept, counted below
    flat = self._tok.encode_batch([t for _, rec in good for t in rec.texts]) if good else []
    k = 0
    for i, rec in good:
      segments = tuple(np.asarray(s, np.int32) for s in flat[k:k + len(rec.texts)])
      k += len(rec.texts)
      self._measure(rec.texts, segments)
      if not all(len(s) for s in segments):
        self._skip(i, records_lib.Bad("empty", "a text of no tokens"))
        continue
      self.tally.count(i, "unlabelled" if rec.label is None else None, "no label")
      self._cache[i] = Example(segments, rec.label, i)


def _problem(rec: Record, label_field: str) -> records_lib.Bad | None:
  if not all(t.strip() for t in rec.texts):
    return records_lib.Bad("empty", "a blank text")
  return records_lib.Bad("unlabelled", f"no label {label_field!r}") if label_field and rec.label is None else None


def examples(config, split: str, tokenizer, records_: records_lib.Records | None = None) -> Examples:
  """The tokenized examples of `split` (its records, or `records_` made from them); every split but task.test_split
  needs labels."""
  found = records(config, split) if records_ is None else records_
  return Examples(found, tokenizer, "" if split == config.task.test_split else config.task.label_field)


def truncate(lengths: tuple, budget: int) -> tuple:
  """Lengths after BERT's truncation to `budget` tokens (run_classifier.py _truncate_seq_pair): tokens come off
  the end of the longer text, the second one on ties."""
  if len(lengths) == 1:
    return (min(lengths[0], budget),)
  a, b = lengths
  excess = a + b - budget
  if excess <= 0:
    return a, b
  cut = min(excess, abs(a - b))
  a, b = (a - cut, b) if a > b else (a, b - cut)
  excess -= cut
  return a - excess // 2, b - (excess - excess // 2)

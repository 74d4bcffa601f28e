"""Labelled task examples (GLUE-style): one text or a pair, and a label, per record; one model row each.

config.task picks the source: `files`, a glob of .tsv / .jsonl in which `{split}` becomes the split name (e.g.
/data/sst2/{split}.tsv with splits train / dev / test), or `tfds_name` (e.g. glue/sst2, through the same
array_record data source as data.tfds_name). `text_fields` names one field, or two for sentence pairs;
`label_field` the label. In a .tsv a header row naming the fields picks the columns; without a header the fields
are column numbers (text_fields=("0",), label_field="1"). Labels are class numbers 0..num_labels-1, or with
`label_names` also those names as written in the data (e.g. entailment / neutral / contradiction); with
model.num_labels = 1 they are regression targets (STS-B); with model.num_labels = 0 they are text, kept as written
(the free-form targets of T5's text-to-text tasks). Multiple choice: `choice_fields` names the K answers,
text_fields the one context; the label is the index of the right answer (Example.segments: context, answers).
Splits take TFDS slice syntax (train[:10%]).

A record that cannot be used (empty text, a malformed line, an unknown label) is counted and skipped, like a bad
document. A record without a label (a GLUE test split; TFDS marks it -1) is kept with label None: it gets a
prediction but counts in no metric.
"""
import dataclasses
import glob
import json
import logging
import math
import os

import numpy as np

from lm_jax.data import corpus as corpus_lib
from lm_jax.data import sources


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


def records(config, split: str):
  """The records of `split` (a list, or lazy random access for a large TFDS split), with .path."""
  t = config.task
  convert = _Labels(tuple(t.label_names), _classes(config))
  if t.files:
    return _file_records(t.files, split, _fields(config), t.label_field, convert)
  return _tfds_records(t.tfds_name, config.data.tfds_data_dir, split, _fields(config), t.label_field, convert)


class _Labels:
  """Raw label -> class number, float target (num_labels == 1), text (num_labels == 0), None (missing) or
  sources.Bad."""

  def __init__(self, names: tuple, num_labels: int, missing=None):
    self.names, self.num_labels, self.missing = names, num_labels, missing

  def __call__(self, raw):
    raw = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    raw = raw.strip() if isinstance(raw, str) else raw
    if raw is None or raw == "" or (self.missing is not None and not isinstance(raw, str) and raw == self.missing):
      return None
    if self.num_labels == 1:
      value = _number(raw, float)
      return value if value is not None and math.isfinite(value) else sources.Bad("malformed")
    if self.num_labels == 0:     # text targets (text_to_text): the label as written
      return raw if isinstance(raw, str) else str(raw)
    if isinstance(raw, str) and raw in self.names:
      return self.names.index(raw)
    value = _number(raw, int)
    return value if value is not None and 0 <= value < self.num_labels else sources.Bad("malformed")


def _number(raw, kind):
  try:
    value = kind(raw)
  except (TypeError, ValueError):
    return None
  return value if kind is float or float(raw) == value else None


def _record(texts, raw_label, labels):
  label = labels(raw_label)
  if isinstance(label, sources.Bad) or not all(isinstance(x, str) for x in texts):
    return sources.Bad("malformed")
  return Record(tuple(texts), label)


class _InMemory(list):
  """Records in a list, with the attributes the pipeline reads (.path, .decode_stats)."""

  def __init__(self, items, path: str, replaced: int = 0):
    super().__init__(items)
    self.path, self._replaced = path, replaced

  @property
  def decode_stats(self) -> dict:
    return {"replaced_characters": self._replaced}


# ---------------------------------------------------------------------------------------------------- files
def _file_records(pattern, split, fields, label_field, labels) -> _InMemory:
  name, spec = sources.split_spec(split)
  pattern = os.path.expanduser(pattern.replace("{split}", name))
  paths = sorted(glob.glob(pattern, recursive=True))
  if not paths:
    raise FileNotFoundError(f"config.task.files: no files match {pattern}")
  out, replaced = [], 0
  for path in paths:
    if not path.endswith((".tsv", ".jsonl")):
      raise ValueError(f"config.task.files: {path}: unsupported type; use .tsv or .jsonl")
    with open(path, "rb") as f:
      data = f.read()
    text = data.decode("utf-8", "replace")
    replaced += text.count("\ufffd") - data.count("\ufffd".encode())
    lines = [l.rstrip("\r") for l in text.split("\n") if l.strip()]
    read = _tsv if path.endswith(".tsv") else _jsonl
    out += read(path, lines, fields, label_field, labels)
  if not out:
    raise ValueError(f"config.task.files: no records in {pattern}")
  return _InMemory(sources._apply_slice(out, spec), f"{pattern} ({split})", replaced)


def _tsv(path, lines, fields, label_field, labels) -> list:
  header = lines[0].split("\t") if lines else []
  if all(f.isdigit() for f in (*fields, label_field)):
    columns, label = [int(f) for f in fields], int(label_field)
  elif all(f in header for f in fields):
    columns, lines = [header.index(f) for f in fields], lines[1:]
    label = header.index(label_field) if label_field in header else None
    if label is None:
      logging.warning("data: %s has no column %r (its header: %s): its records are unlabelled, predicted but in no "
                      "metric", path, label_field, header)
  else:
    raise ValueError(f"config.task.text_fields={fields!r} / label_field={label_field!r}: {path} has no header row "
                     f"naming them (its first row: {header[:6]!r}); for a file without a header give column "
                     "numbers, e.g. text_fields=('0',), label_field='1'")
  out = []
  for line in lines:
    cells = line.split("\t")
    if max(columns) >= len(cells):
      out.append(sources.Bad("malformed"))
      continue
    raw = cells[label] if label is not None and label < len(cells) else None
    out.append(_record([cells[c] for c in columns], raw, labels))
  return out


def _jsonl(path, lines, fields, label_field, labels) -> list:
  del path
  out = []
  for line in lines:
    try:
      obj = json.loads(line)
      out.append(_record([obj[f] for f in fields], obj.get(label_field), labels))
    except (ValueError, KeyError, TypeError, AttributeError):
      out.append(sources.Bad("malformed"))
  return out


# ----------------------------------------------------------------------------------------------------- TFDS
class _TfdsRecords:
  """Random access to the records of a TFDS split, converted on access."""

  def __init__(self, source, fields, label_field, labels, path):
    self._source, self._fields, self._label_field, self._labels = source, fields, label_field, labels
    self.path, self.decode_stats = path, {}

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    item = self._source[i]
    texts = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in (item[f] for f in self._fields)]
    return _record(texts, item.get(self._label_field), self._labels)


def _tfds_records(name, data_dir, split, fields, label_field, labels) -> _TfdsRecords:
  builder = sources.prepare_tfds(name, data_dir)
  where = f"TFDS {name} in {builder.data_dir}"
  base, _ = sources.split_spec(split)
  if base not in builder.info.splits:
    raise ValueError(f"config.data: {where} has no split {base!r}; it has {', '.join(builder.info.splits)}")
  features = builder.info.features
  missing = [f for f in fields if f not in features]
  if missing:
    raise ValueError(f"config.task.text_fields: {', '.join(map(repr, missing))} not a feature of {where}; it has "
                     f"{', '.join(features)}")
  if not {f.value for f in builder.info.available_file_formats()} & {"array_record", "parquet"}:
    raise ValueError(f"{where} is prepared as tfrecord; rebuild it with file_format='array_record'")
  labels = _Labels(labels.names, labels.num_labels, missing=-1)   # TFDS GLUE test splits: label -1
  return _TfdsRecords(builder.as_data_source(split=split), fields, label_field, labels, f"{where} ({split})")


# ------------------------------------------------------------------------------------------------- examples
class TokenizedSplit:
  """The tokenized examples of one split, in the role of data.corpus.Corpus for a rows.PerDocument layout
  with a `corpus`: tokens(ids) gives per id an example, or None for an unusable record (counted in stats).
  Subclasses tokenize a batch of record ids in _tokenize, filling _cache and the counters."""

  def __init__(self, records_, tokenizer, stats: tuple):
    self.docs, self.path, self._tok = records_, records_.path, tokenizer
    self._cache = {}
    self.stats = dict.fromkeys(("documents", "empty", "malformed", *stats), 0)
    self.bytes = self.chars = self.tokens_count = 0

  def __len__(self):
    return len(self.docs)

  def tokens(self, ids: list[int]) -> list:
    missing = [i for i in dict.fromkeys(ids) if i not in self._cache]
    for start in range(0, len(missing), corpus_lib.DOCS_PER_CALL):
      self._tokenize(missing[start:start + corpus_lib.DOCS_PER_CALL])
    return [self._cache[i] for i in ids]

  def _tokenize(self, ids):
    raise NotImplementedError


class Examples(TokenizedSplit):
  """Task examples (Example: segments, label, index)."""

  def __init__(self, records_, tokenizer):
    super().__init__(records_, tokenizer, ("undecodable", "unlabelled"))

  def _tokenize(self, ids):
    good = []
    for i in ids:
      rec = self.docs[i]
      self.stats["documents"] += 1
      reason = rec.reason if isinstance(rec, sources.Bad) else (None if all(t.strip() for t in rec.texts) else "empty")
      if reason:
        self.stats[reason] += 1
        self._cache[i] = None
      else:
        good.append((i, rec))
    flat = self._tok.encode_batch([t for _, rec in good for t in rec.texts]) if good else []
    k = 0
    for i, rec in good:
      segments = tuple(np.asarray(s, np.int32) for s in flat[k:k + len(rec.texts)])
      k += len(rec.texts)
      self.bytes += sum(len(t.encode("utf-8")) for t in rec.texts)
      self.chars += sum(map(len, rec.texts))
      self.tokens_count += sum(map(len, segments))
      usable = all(len(s) for s in segments)
      self.stats["empty"] += not usable
      self.stats["unlabelled"] += usable and rec.label is None
      self._cache[i] = Example(segments, rec.label, i) if usable else None


def examples(config, split: str, tokenizer) -> Examples:
  return Examples(records(config, split), tokenizer)


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

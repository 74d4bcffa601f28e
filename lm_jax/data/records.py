"""One reader for every kind of record (pre-training text, task examples, instructions, preferences, PPO prompts), so
that a bad record is counted and reported the same way whatever reads it.

`read(split, fields, ...)` gives the records of one split by index, from files or a TFDS dataset:
- files: a glob (local, or a gs:// URL read through lm_jax/storage.py) in which `{split}` becomes the split name (e.g. wiki.{split}.raw with splits train / valid; without
  it every split reads all files).
    .txt / .raw / .text  documents separated by a blank (or whitespace-only) line, or with documents=False one
                         record per non-empty line; the text is the one field read
    .jsonl               one JSON object per line
    .tsv                 a header row naming the fields picks their columns; fields named by number ('0', '1') are
                         the columns of a file without header; one field alone is the first column unless a header
                         names it
    .jsonl.gz / .json.gz / .jsonl.zst, .parquet, a `datasets` folder (data/formats.py): streamed once into a cached
                         array_record spill (data/spill.py) and read from it by index, as are .txt / .jsonl / .tsv
                         files over SPILL_BYTES, so memory stays flat on a corpus of any size
- TFDS: prepared in the array_record format (on first use: data/tfds_prepare.py) and read with `as_data_source`
  (random access, no TensorFlow, decoded lazily). Datasets prepared as tfrecord are read through tf.data into
  memory, which needs TensorFlow. With documents=True, splits of fewer than _FEW_RECORDS records (tiny_shakespeare
  has one record per split) are read whole and cut into documents at blank lines, like .txt files, so they can be
  shuffled and sharded.
TFDS slice syntax selects records of a split: `train[:95%]`, `train[95%:]`, `train[100:200]`.

A record is the text of `fields` when that is one name, else a dict of the fields (the `optional` ones may be
missing; the others must be text). A record that cannot be used is `Bad(reason, detail)`, counted as its reason:
'malformed' (not JSON, a field missing or not text, too few columns) or 'undecodable' (mostly not UTF-8); a reader
on top adds its own (an unknown label, an empty text). `where(i)` names record i (file:line, or the TFDS record), so
whoever skips records counts them in a `Tally`, whose `report()` is the one line every split's problems are told in:
the counts by reason and where the first few bad records are. `screen` looks at a split's records once before any is
used, so that a split nothing can be learnt from stops the run before it compiles, and a partly bad one is reported
at the start rather than at the end of an epoch.

Invalid UTF-8 inside a record is replaced by U+FFFD byte by byte and the record kept (a warning names the file;
`.decode_stats` counts them); a file with NUL bytes, or mostly not UTF-8, in its first block is refused as binary.
"""
import bisect
import dataclasses
import itertools
import json
import os
import re

from absl import logging

from lm_jax import storage
from lm_jax.data import formats, spill, tfds_prepare

_FEW_RECORDS = 1000
_FIRST = 3                                     # bad records a report names
_SCREENED = 10_000                             # records screen() reads of a split read lazily (TFDS)
_BLANK_LINE = re.compile(rb"\r?\n[ \t\r]*\n")
_SLICE = re.compile(r"^([^\[\]]+)(?:\[(-?\d*%?):(-?\d*%?)\])?$")
_TEXT_SUFFIXES = (".txt", ".raw", ".text")
_ESCAPED = re.compile("[\udc80-\udcff]")      # what surrogateescape makes of a byte that is not UTF-8
_SNIFF_BYTES = 8192                            # a file's first block, checked for binary content
SPILL_BYTES = 1 << 28                          # a plain text file bigger than this is read through a spill


@dataclasses.dataclass(frozen=True)
class Bad:
  """A record that cannot be used: `reason` is what it counts as, `detail` what is wrong with this one."""
  reason: str
  detail: str = dataclasses.field(default="", compare=False)


class Records:
  """The records of one split by index (a slice gives a list); .path names the split, where(i) record i; lazy: each
  record is read (and decoded) when asked for, rather than held in memory."""
  path = ""
  lazy = False

  def __len__(self):
    raise NotImplementedError

  def _get(self, i: int):
    raise NotImplementedError

  def where(self, i: int) -> str:
    raise NotImplementedError

  def __getitem__(self, i):
    if isinstance(i, slice):
      return [self._get(j) for j in range(*i.indices(len(self)))]
    return self._get(i)

  def __iter__(self):
    return (self._get(i) for i in range(len(self)))

  def map(self, fn) -> "Records":
    """These records with fn applied to each usable one (fn may return a Bad)."""
    return _Mapped(self, fn)


class Listed(Records):
  """Records held in memory; places[i] = (file, line) of record i, replaced[i] = its bytes that were not UTF-8."""

  def __init__(self, items: list, places: list, replaced: list, path: str):
    self._items, self._places, self._replaced, self.path = items, places, replaced, path

  def __len__(self):
    return len(self._items)

  def _get(self, i):
    return self._items[i]

  def where(self, i):
    return "%s:%d" % self._places[i]

  @property
  def decode_stats(self) -> dict:
    """Records kept with invalid UTF-8 replaced by U+FFFD, and the bytes replaced."""
    return _replaced_stats(self._replaced)

  def sliced(self, spec) -> "Listed":
    return Listed(*(_apply_slice(x, spec) for x in (self._items, self._places, self._replaced)), self.path)


class TfdsRecords(Records):
  """Random access to a TFDS array_record split, each record decoded and checked when it is read.

  decode_stats counts the records read so far; the first one with invalid UTF-8 logs a warning.
  """

  lazy = True

  def __init__(self, source, fields, path: str, optional: tuple = ()):
    self._source, self._fields, self._optional, self.path = source, fields, optional, path
    self._replaced = {}

  def __len__(self):
    return len(self._source)

  def _get(self, i):
    record, n = _tfds_record(self._source[i], _names(self._fields), self._optional)
    if n:
      if not self._replaced:
        logging.warning("data: %s: record %d has invalid UTF-8, kept with %d bytes replaced by U+FFFD "
                        "(warned once per split)", self.path, i, n)
      self._replaced[i] = n
    return _shape(record, self._fields)

  def where(self, i):
    return f"{self.path} record {i}"

  @property
  def decode_stats(self) -> dict:
    return _replaced_stats(self._replaced.values())


class _Mapped(Records):
  def __init__(self, records: Records, fn):
    self._records, self._fn, self.path, self.lazy = records, fn, records.path, records.lazy

  def __len__(self):
    return len(self._records)

  def _get(self, i):
    record = self._records[i]
    return record if isinstance(record, Bad) else self._fn(record)

  def where(self, i):
    return self._records.where(i)

  @property
  def decode_stats(self) -> dict:
    return self._records.decode_stats


class Tally:
  """What a reader made of a split's records: every record looked at ('documents') and, by reason, those skipped
  (or kept with a problem, like a missing label), with where the first few of them are."""

  def __init__(self, records: Records, reasons: tuple = ()):
    self._records = records
    self.counts = dict.fromkeys(("documents", *reasons), 0)
    self.first = []

  def count(self, i: int, reason: str | None = None, detail: str = ""):
    """Record i was looked at; reason (a key of counts) says what was wrong with it, if anything."""
    self.counts["documents"] += 1
    if reason:
      self.counts[reason] = self.counts.get(reason, 0) + 1
      where = f"{self._records.where(i)}: {detail or reason}"
      if len(self.first) < _FIRST and where not in self.first:
        self.first.append(where)

  def report(self) -> str:
    """One line, '' when all was well: e.g. "dev.tsv (dev): 2 malformed of 40 records; first: dev.tsv:3: not JSON"."""
    bad = ", ".join(f"{n} {reason}" for reason, n in self.counts.items() if reason != "documents" and n)
    return bad and f"{self._records.path}: {bad} of {self.counts['documents']} records; first: {'; '.join(self.first)}"


def screen(records: Records, problem) -> Tally:
  """Looks at every record of a split once (the first _SCREENED of a lazy one) before any is used: problem(record)
  gives the Bad of a record the reader on top cannot use, or None. No usable record is a ValueError naming the
  reasons and the first bad records; some unusable ones are a warning that names them. Returns the tally."""
  n = min(len(records), _SCREENED) if records.lazy else len(records)
  tally = Tally(records)
  usable = 0
  for i in range(n):
    record = records[i]
    bad = record if isinstance(record, Bad) else problem(record)
    tally.count(i, bad and bad.reason, bad and bad.detail)
    usable += not bad
  if not usable:
    raise ValueError(f"no usable record in {tally.report()}")
  if tally.report():
    logging.warning("data: %s", tally.report())
  return tally


def read(split: str, fields, *, files: str = "", tfds_name: str = "", tfds_data_dir: str = "", optional: tuple = (),
         documents: bool = False, origin: str, named_by: str) -> Records:
  """The records of `split` from the glob `files` or the TFDS dataset `tfds_name`. fields: one name (records are its
  text) or several (records are dicts, with the `optional` fields where present). origin names the config field of
  the source, named_by that of the fields, in errors."""
  if files:
    return _read_files(files, split, fields, tuple(optional), documents, origin, named_by)
  if tfds_name:
    return _read_tfds(tfds_name, tfds_data_dir, split, fields, tuple(optional), documents, origin, named_by)
  raise ValueError(f"{origin}: no files or TFDS dataset to read {_names(fields)} from")


def split_spec(split: str):
  """'train[:95%]' -> ('train', slice-in-percent-or-count strings), 'train' -> ('train', None)."""
  m = _SLICE.match(split.strip())
  if not m:
    raise ValueError(f"bad split {split!r}; use e.g. train, train[:95%], train[100:200]")
  name, lo, hi = m.groups()
  return name, (None if lo is None else (lo, hi))


def _apply_slice(items: list, spec):
  if spec is None:
    return items
  n = len(items)

  def bound(s, default):
    if not s:
      return default
    v = round(n * int(s[:-1]) / 100) if s.endswith("%") else int(s)
    return v + n if v < 0 else v
  return items[bound(spec[0], 0):bound(spec[1], n)]


def _names(fields) -> tuple:
  return (fields,) if isinstance(fields, str) else tuple(fields)


def _shape(record, fields):
  """A checked record as read() gives it: the text of a single field, else the dict."""
  return record[fields] if isinstance(fields, str) and isinstance(record, dict) else record


def _pick(found: dict, required: tuple, optional: tuple):
  """The wanted fields of a parsed record, or Bad when a required one is missing or not text."""
  for name in required:
    if name not in found:
      return Bad("malformed", f"no field {name!r}")
    if not isinstance(found[name], str):
      return Bad("malformed", f"field {name!r} is {type(found[name]).__name__}, not text")
  return {name: found[name] for name in required + optional if name in found}


def _replaced_stats(counts) -> dict:
  return dict(replaced_documents=sum(1 for n in counts if n), replaced_bytes=sum(counts))


def _decode(raw):
  """(text, bytes replaced): invalid UTF-8 becomes U+FFFD, one per byte; Bad if most bytes are invalid."""
  if isinstance(raw, str):
    return raw, 0
  raw = bytes(raw)
  try:
    return raw.decode("utf-8"), 0
  except UnicodeDecodeError:
    text, n = _ESCAPED.subn("\ufffd", raw.decode("utf-8", "surrogateescape"))
  return (Bad("undecodable", f"{n} of {len(raw)} bytes not UTF-8"), 0) if 2 * n > len(raw) else (text, n)


# ---------------------------------------------------------------------------------------------------------- files
def _read_files(pattern, split, fields, optional, documents, origin, named_by) -> Records:
  name, spec = split_spec(split)
  pattern = os.path.expanduser(pattern.replace("{split}", name))
  paths = storage.glob(pattern)
  if not paths:
    raise FileNotFoundError(f"{origin}: no files match {pattern}")
  read = lambda path: _read_file(path, _names(fields), optional, documents, origin, named_by)  # noqa: E731
  if any(_spilled(path) for path in paths):
    files = [spill.cached(path, [fields, optional, documents], lambda path=path: _spill_items(read(path)))
             for path in paths]
    if not sum(f.count for f in files):
      raise ValueError(f"{origin}: no records in {pattern}")
    return Spilled(files, f"{pattern} ({split})", fields).sliced(spec)
  items, places, replaced = [], [], []
  for path in paths:
    for line, record, n in read(path):
      items.append(_shape(record, fields))
      places.append((path, line))
      replaced.append(n)
  if not items:
    raise ValueError(f"{origin}: no records in {pattern}")
  return Listed(items, places, replaced, f"{pattern} ({split})").sliced(spec)


def _spilled(path: str) -> bool:
  """Compressed and columnar files, and big text files, are read through a spill (records streamed to disk once,
  then read by index), never into memory."""
  return (path.endswith(formats.COMPRESSED) or formats.is_columnar(path)
          or (storage.isfile(path) and storage.getsize(path) > SPILL_BYTES))


def _spill_items(records):
  """What a spill holds of each record: JSON [line, bytes replaced, record] or [line, 0, None, reason, detail]."""
  for line, record, n in records:
    item = [line, 0, None, record.reason, record.detail] if isinstance(record, Bad) else [line, n, record]
    yield json.dumps(item).encode(), n


class Spilled(Records):
  """The records of files streamed once into array_record spills (data/spill.py), read by index."""

  lazy = True

  def __init__(self, files: list, path: str, fields, span: range | None = None):
    self._files, self.path, self._fields = files, path, fields
    self._starts = list(itertools.accumulate([0] + [f.count for f in files]))
    self._span = span if span is not None else range(self._starts[-1])
    self._sources = [None] * len(files)

  def __len__(self):
    return len(self._span)

  def _locate(self, i):
    j = self._span[i]
    k = bisect.bisect_right(self._starts, j) - 1
    return k, j - self._starts[k]

  def _item(self, i):
    k, j = self._locate(i)
    if self._sources[k] is None:
      self._sources[k] = self._files[k].reader()
    return k, json.loads(self._sources[k][j])

  def _get(self, i):
    _, item = self._item(i)
    return Bad(*item[3:]) if item[2] is None else _shape(item[2], self._fields)

  def where(self, i):
    k, item = self._item(i)
    return f"{self._files[k].source}:{item[0]}"

  @property
  def decode_stats(self) -> dict:
    return {key: sum(f.decode_stats[key] for f in self._files) for key in ("replaced_documents", "replaced_bytes")}

  def sliced(self, spec) -> "Spilled":
    return Spilled(self._files, self.path, self._fields, _apply_slice(self._span, spec))

  def __getstate__(self):                # readers are opened again in another process
    return dict(self.__dict__, _sources=[None] * len(self._files))


def _read_file(path, required, optional, documents, origin, named_by):
  """(line, record or Bad, bytes replaced) per record of one file, streamed."""
  if formats.is_columnar(path):
    yield from _column_records(path, required, optional, origin, named_by)
    return
  plain = path.removesuffix(".gz").removesuffix(".zst")
  if not (plain.endswith(_TEXT_SUFFIXES + (".jsonl", ".tsv")) or path.endswith(formats.COMPRESSED)):
    raise ValueError(f"{origin}: {path}: unsupported type; use .txt, .raw, .jsonl, .tsv, .jsonl.gz, .json.gz, "
                     ".jsonl.zst, .parquet or a datasets folder")
  _check_text(path, next(formats.blocks(path), b"")[:_SNIFF_BYTES], origin)
  if plain.endswith(_TEXT_SUFFIXES):
    if len(required + optional) > 1:     # e.g. a label would be missing from every record
      raise ValueError(f"{origin}: {path}: a text file holds one text per record, not the fields "
                       f"{', '.join(required + optional)}; use .jsonl or .tsv")
    out = ((line, *_text_record(raw, required[0]))
           for line, raw in (formats.documents(path) if documents else formats.lines(path)))
  elif plain.endswith(".tsv"):
    out = _tsv_records(path, formats.lines(path), required, optional, origin, named_by)
  else:
    out = ((line, *_json_record(raw, required, optional)) for line, raw in formats.lines(path))
  yield from _warn_replaced(path, out)


def _column_records(path, required, optional, origin, named_by):
  missing = [name for name in required if name not in formats.columns(path)]
  if missing:
    raise ValueError(f"{named_by}={missing[0]!r}: {path} has no such column (its columns: "
                     f"{', '.join(formats.columns(path)[:12])}) ({origin})")
  out = ((number, *_tfds_record(row, required, optional)) for number, row in formats.rows(path, required + optional))
  yield from _warn_replaced(path, out)


def _documents(data: bytes) -> list:
  """(line number of its first line, bytes) of each document of text held in memory (a TFDS record); formats.documents
  cuts a file the same way as it streams it."""
  out, start, line = [], 0, 1
  for m in [*_BLANK_LINE.finditer(data), None]:
    end = m.start() if m else len(data)
    chunk = data[start:end]
    if chunk.strip():
      out.append((line + chunk.count(b"\n", 0, len(chunk) - len(chunk.lstrip())), chunk))
    if m:
      line += data.count(b"\n", start, m.end())
      start = m.end()
  return out


def _text_record(raw: bytes, field: str):
  text, n = _decode(raw)
  return (text, 0) if isinstance(text, Bad) else ({field: text}, n)


def _json_record(raw: bytes, required, optional):
  text, n = _decode(raw)
  if isinstance(text, Bad):
    return text, 0
  try:
    found = json.loads(text)
  except ValueError:
    return Bad("malformed", "not JSON"), 0
  if not isinstance(found, dict):
    return Bad("malformed", f"not a JSON object but {type(found).__name__}"), 0
  record = _pick(found, required, optional)
  return record, (0 if isinstance(record, Bad) else n)


def _tsv_records(path, lines, required, optional, origin, named_by):
  names, lines = required + optional, iter(lines)
  head = next(lines, None)
  first = _decode(head[1])[0] if head else ""
  header = first.split("\t") if isinstance(first, str) else []
  if head and not all(name.isdigit() for name in names) and all(name in header for name in required):
    head = None                          # the header row is no record
  if all(name.isdigit() for name in names):
    columns = {name: int(name) for name in names}
  elif all(name in header for name in required):
    columns = {name: header.index(name) for name in names if name in header}
    for name in optional:
      if name not in header:
        logging.warning("data: %s has no column %r (its header: %s): its records are read without it", path, name,
                        header)
  elif len(names) == 1:
    columns = {names[0]: 0}
  else:
    raise ValueError(f"{named_by}={names!r}: {path} has no header row naming them (its first row: {header[:6]!r}); "
                     f"without a header give the fields as column numbers ('0', '1', ...) ({origin})")
  return _tsv_rows(itertools.chain([head] if head else [], lines), columns, required)


def _tsv_rows(lines, columns, required):
  for line, raw in lines:
    text, n = _decode(raw)
    if isinstance(text, Bad):
      yield line, text, 0
      continue
    cells = text.split("\t")
    short = [name for name in required if columns[name] >= len(cells)]
    if short:
      yield line, Bad("malformed", f"{len(cells)} columns, no {short[0]!r} (column {columns[short[0]]})"), 0
      continue
    yield line, {name: cells[c] for name, c in columns.items() if c < len(cells)}, n


def _check_text(path: str, head: bytes, origin: str):
  """Refuse a binary file by name before its bytes turn into undecodable records."""
  nul = head.find(b"\0")
  bad = len(_ESCAPED.findall(head.decode("utf-8", "surrogateescape")))
  if nul >= 0 or 2 * bad > len(head):
    why = f"NUL bytes at offset {nul}" if nul >= 0 else f"{bad} of its first {len(head)} bytes are not UTF-8"
    raise ValueError(f"{origin}: {path} looks binary ({why}); {origin.removeprefix('config.')} expects UTF-8 "
                     ".txt/.raw/.jsonl/.tsv text")


def _warn_replaced(path: str, decoded):
  """Passes the (line, record, bytes replaced) of one file through, then warns of its invalid UTF-8."""
  counts, undecodable = dict(replaced_documents=0, replaced_bytes=0), 0
  for item in decoded:
    counts["replaced_documents"] += bool(item[2])
    counts["replaced_bytes"] += item[2]
    undecodable += item[1] == Bad("undecodable")
    yield item
  if counts["replaced_documents"] or undecodable:
    logging.warning("data: %s: invalid UTF-8 in %d documents, kept with %d bytes replaced by U+FFFD; %d records "
                    "mostly not UTF-8 skipped as undecodable", path, counts["replaced_documents"],
                    counts["replaced_bytes"], undecodable)


# ----------------------------------------------------------------------------------------------------------- TFDS
def _tfds_record(row: dict, required: tuple, optional: tuple):
  """(record or Bad, bytes replaced) of a TFDS row: the wanted features, text ones decoded."""
  found, replaced = {}, 0
  for name in required + optional:
    if name in row:
      value = row[name]
      if isinstance(value, bytes):
        value, n = _decode(value)
        if isinstance(value, Bad):
          return value, 0
        replaced += n
      found[name] = value
  record = _pick(found, required, optional)
  return record, (0 if isinstance(record, Bad) else replaced)


def _read_tfds(name, data_dir, split, fields, optional, documents, origin, named_by) -> Records:
  builder = tfds_prepare.prepare_tfds(name, data_dir)
  where = f"TFDS {name} in {builder.data_dir}"
  base, spec = split_spec(split)
  if base not in builder.info.splits:
    raise ValueError(f"{origin}: {where} has no split {base!r}; it has {', '.join(builder.info.splits)}")
  features, required = builder.info.features, _names(fields)
  missing = [f for f in required if f not in features]
  if missing:
    raise ValueError(f"{named_by}={', '.join(map(repr, missing))} is not a feature of {where}; it has "
                     f"{', '.join(features)}")
  path = f"{where} ({split})"
  random_access = {f.value for f in builder.info.available_file_formats()} & {"array_record", "parquet"}
  if random_access and not (documents and builder.info.splits[base].num_examples < _FEW_RECORDS):
    return TfdsRecords(builder.as_data_source(split=split), fields, path, optional)
  if random_access:
    source = builder.as_data_source(split=base)
    rows = (source[i] for i in range(len(source)))
  else:
    rows = tfds_prepare.tfdata_records(builder, base, name)
  decoded = []
  for r, row in enumerate(rows):
    place = f"{where} ({base}) record {r}"
    if documents:    # a few big records: cut into documents at blank lines
      raw = row[required[0]]
      decoded += [((place, line), *_text_record(doc, required[0]))
                  for line, doc in _documents(raw.encode("utf-8") if isinstance(raw, str) else bytes(raw))]
    else:
      decoded.append(((place, 1), *_tfds_record(row, required, optional)))
  if not decoded:
    raise ValueError(f"{origin}: no records in {path}")
  decoded = list(_warn_replaced(where, decoded))
  items = [_shape(record, fields) for _, record, _ in decoded]
  return Listed(items, [p for p, _, _ in decoded], [n for _, _, n in decoded], path).sliced(spec)

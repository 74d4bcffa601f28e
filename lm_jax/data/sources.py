"""Where documents come from: TFDS datasets by name, or the user's own files (config.data.files).

`documents(config, split)` returns a random-access sequence; item i is the text of document i, or a
`Bad` marker for a record that is not usable text (counted and skipped by the pipeline, never fatal).
Invalid UTF-8 inside a document is replaced by U+FFFD byte by byte and the document kept (a warning names
the file; `.decode_stats` counts them); a record mostly of such bytes is `Bad('undecodable')`. A file with
NUL bytes, or mostly not UTF-8, in its first block is refused as binary.

- Files: `.txt`/`.raw`/`.text` (a blank or whitespace-only line ends a document), `.jsonl` (one JSON object
  per line with config.data.text_field), `.tsv` (a text column and a label column; a header row naming
  config.data.text_field picks the column, else the first column is the text). A `{split}` in the glob is
  replaced by the split name (e.g. `wiki.{split}.raw` with splits train / valid); without it every split
  reads all files. TFDS slice syntax selects documents: `train[:95%]`, `train[95%:]`, `train[100:200]`.
- TFDS: prepared in the array_record format and read with `as_data_source` (random access, no TensorFlow).
  A missing dataset is built on first use; catalog text builders that only use `tf.io.gfile` (e.g.
  tiny_shakespeare) build without TensorFlow. Datasets already prepared as tfrecord are read through tf.data
  into memory, which needs TensorFlow. Splits of fewer than _FEW_RECORDS records (tiny_shakespeare has one
  record per split) are read whole and cut into documents at blank lines, like .txt files, so they can be
  shuffled and sharded.
"""
import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
import re
import sys
import types

from absl import logging

_FEW_RECORDS = 1000
_BLANK_LINE = re.compile(rb"\r?\n[ \t\r]*\n")
_SLICE = re.compile(r"^([^\[\]]+)(?:\[(-?\d*%?):(-?\d*%?)\])?$")
_TEXT_SUFFIXES = (".txt", ".raw", ".text")
_ESCAPED = re.compile("[\udc80-\udcff]")      # what surrogateescape makes of a byte that is not UTF-8
_SNIFF_BYTES = 8192                            # a file's first block, checked for binary content


@dataclasses.dataclass(frozen=True)
class Bad:
  """A record that is not usable text; `reason` says why ('undecodable', 'malformed')."""
  reason: str


def _replaced_stats(counts) -> dict:
  return dict(replaced_documents=sum(1 for n in counts if n), replaced_bytes=sum(counts))


class InMemory:
  """Documents held in a list (files and small TFDS splits); replaced[i] = bytes of document i not UTF-8."""

  def __init__(self, docs, path, replaced):
    self._docs, self.path, self._replaced = docs, path, replaced

  def __len__(self):
    return len(self._docs)

  def __getitem__(self, i):
    return self._docs[i]

  @property
  def decode_stats(self) -> dict:
    """Documents kept with invalid UTF-8 replaced by U+FFFD, and the bytes replaced."""
    return _replaced_stats(self._replaced)


class TfdsRecords:
  """Random access to the text field of a TFDS array_record split, decoded lazily.

  decode_stats counts the documents read so far; the first one with invalid UTF-8 logs a warning.
  """

  def __init__(self, source, field, path):
    self._source, self._field, self.path = source, field, path
    self._replaced = {}

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    text, n = _decode(self._source[i][self._field])
    if n:
      if not self._replaced:
        logging.warning("data: %s: record %d has invalid UTF-8, kept with %d bytes replaced by U+FFFD "
                        "(warned once per split)", self.path, i, n)
      self._replaced[i] = n
    return text

  @property
  def decode_stats(self) -> dict:
    return _replaced_stats(self._replaced.values())


def documents(config, split: str):
  """The documents of `split` (e.g. config.data.train_split) from config.data.files or TFDS."""
  if config.data.files:
    return _file_documents(config.data.files, split, config.data.text_field)
  if config.data.tfds_name:
    return _tfds_documents(config.data.tfds_name, config.data.tfds_data_dir, split, config.data.text_field)
  raise ValueError("config.data: set files (a glob of your text) or tfds_name (a TFDS dataset)")


def training_text(config, max_chars: int) -> list[str]:
  """Lines of an evenly spaced sample of the training documents, max_chars in all (the same on every host).

  Lines are whole however long (tokenizer.train cuts them to SentencePiece's sentence limit).
  """
  docs = documents(config, config.data.train_split)
  step = max(1, len(docs) // 20_000)
  lines, total = [], 0
  for i in range(0, len(docs), step):
    text = docs[i]
    if isinstance(text, Bad):
      continue
    for line in text.splitlines():
      if line.strip() and total < max_chars:
        lines.append(line[:max_chars - total])
        total += len(lines[-1])
    if total >= max_chars:
      break
  if not lines:
    raise ValueError(f"no text to train a tokenizer on in {docs.path}")
  return lines


def split_spec(split: str):
  """'train[:95%]' -> ('train', slice-in-percent-or-count strings), 'train' -> ('train', None)."""
  m = _SLICE.match(split.strip())
  if not m:
    raise ValueError(f"bad split {split!r}; use e.g. train, train[:95%], train[100:200]")
  name, lo, hi = m.groups()
  return name, (None if lo is None else (lo, hi))


def _apply_slice(docs: list, spec):
  if spec is None:
    return docs
  n = len(docs)

  def bound(s, default):
    if not s:
      return default
    v = round(n * int(s[:-1]) / 100) if s.endswith("%") else int(s)
    return v + n if v < 0 else v
  return docs[bound(spec[0], 0):bound(spec[1], n)]


# ---------------------------------------------------------------------------------------------- files

def _file_documents(pattern: str, split: str, field: str) -> InMemory:
  name, spec = split_spec(split)
  pattern = os.path.expanduser(pattern.replace("{split}", name))
  paths = sorted(glob.glob(pattern, recursive=True))
  if not paths:
    raise FileNotFoundError(f"config.data.files: no files match {pattern}")
  docs, replaced = [], []
  for path in paths:
    decoded = _read_file(path, field)
    docs += [d for d, _ in decoded]
    replaced += [n for _, n in decoded]
  if not docs:
    raise ValueError(f"config.data.files: no documents in {pattern}")
  return InMemory(_apply_slice(docs, spec), f"{pattern} ({split})", _apply_slice(replaced, spec))


def _read_file(path: str, field: str) -> list:
  """(text or Bad, bytes replaced) per document of one file."""
  if not path.endswith(_TEXT_SUFFIXES + (".jsonl", ".tsv")):
    raise ValueError(f"config.data.files: {path}: unsupported type; use .txt, .raw, .jsonl or .tsv")
  with open(path, "rb") as f:
    data = f.read()
  _check_text(path, data[:_SNIFF_BYTES])
  if path.endswith(_TEXT_SUFFIXES):
    decoded = [_decode(d) for d in _BLANK_LINE.split(data) if d.strip()]
  elif path.endswith(".jsonl"):
    decoded = [_json_text(line, field) for line in data.splitlines() if line.strip()]
  else:
    decoded = _tsv_texts(data.splitlines(), field)
  _warn_replaced(path, decoded)
  return decoded


def _check_text(path: str, head: bytes):
  """Refuse a binary file by name before its bytes turn into undecodable documents."""
  nul = head.find(b"\0")
  bad = len(_ESCAPED.findall(head.decode("utf-8", "surrogateescape")))
  if nul >= 0 or 2 * bad > len(head):
    why = f"NUL bytes at offset {nul}" if nul >= 0 else f"{bad} of its first {len(head)} bytes are not UTF-8"
    raise ValueError(f"config.data.files: {path} looks binary ({why}); data.files expects UTF-8 "
                     ".txt/.raw/.jsonl/.tsv text")


def _warn_replaced(path: str, decoded: list):
  counts = _replaced_stats([n for _, n in decoded])
  undecodable = sum(1 for d, _ in decoded if d == Bad("undecodable"))
  if counts["replaced_documents"] or undecodable:
    logging.warning("data: %s: invalid UTF-8 in %d documents, kept with %d bytes replaced by U+FFFD; %d records "
                    "mostly not UTF-8 skipped as undecodable", path, counts["replaced_documents"],
                    counts["replaced_bytes"], undecodable)


def _json_text(line: bytes, field: str):
  text, n = _decode(line)
  if isinstance(text, Bad):
    return text, 0
  try:
    text = json.loads(text)[field]
  except (ValueError, KeyError, TypeError):
    return Bad("malformed"), 0
  return (text, n) if isinstance(text, str) else (Bad("malformed"), 0)


def _tsv_texts(lines: list, field: str) -> list:
  lines = [l.rstrip(b"\r") for l in lines if l.strip()]
  header = lines[0].split(b"\t") if lines else []
  column = 0
  if field.encode() in header:
    column, lines = header.index(field.encode()), lines[1:]
  out = []
  for line in lines:
    cells = line.split(b"\t")
    out.append(_decode(cells[column]) if len(cells) > column else (Bad("malformed"), 0))
  return out


def _decode(raw):
  """(text, bytes replaced): invalid UTF-8 becomes U+FFFD, one per byte; Bad if most bytes are invalid."""
  if isinstance(raw, str):
    return raw, 0
  raw = bytes(raw)
  try:
    return raw.decode("utf-8"), 0
  except UnicodeDecodeError:
    text, n = _ESCAPED.subn("\ufffd", raw.decode("utf-8", "surrogateescape"))
  return (Bad("undecodable"), 0) if 2 * n > len(raw) else (text, n)


# ----------------------------------------------------------------------------------------------- TFDS

def _tfds_documents(name: str, data_dir: str, split: str, field: str):
  builder = prepare_tfds(name, data_dir)
  where = f"TFDS {name} in {builder.data_dir}"
  base, spec = split_spec(split)
  if base not in builder.info.splits:
    raise ValueError(f"config.data: {where} has no split {base!r}; it has {', '.join(builder.info.splits)}")
  features = builder.info.features
  if field not in features:
    raise ValueError(f"config.data.text_field={field!r} is not a feature of {where}; it has "
                     f"{', '.join(features)}")
  path = f"{where} ({split})"
  random_access = {"array_record", "parquet"}
  formats = {f.value for f in builder.info.available_file_formats()}
  if formats & random_access and builder.info.splits[base].num_examples >= _FEW_RECORDS:
    return TfdsRecords(builder.as_data_source(split=split), field, path)
  if formats & random_access:
    source = builder.as_data_source(split=base)
    records = [source[i][field] for i in range(len(source))]
  else:
    records = [r[field] for r in _tfdata_records(builder, base, name)]
  decoded = [_decode(d) for r in records for d in _BLANK_LINE.split(_as_bytes(r)) if d.strip()]
  if not decoded:
    raise ValueError(f"config.data: no documents in {path}")
  _warn_replaced(where, decoded)
  docs, replaced = [d for d, _ in decoded], [n for _, n in decoded]
  return InMemory(_apply_slice(docs, spec), path, _apply_slice(replaced, spec))


def _as_bytes(raw):
  return raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)


def _tfdata_records(builder, split, name):
  if not _have_tensorflow():
    raise ImportError(f"TFDS {name} in {builder.data_dir} is prepared as tfrecord, which needs TensorFlow "
                      "(pip install tensorflow-cpu); or rebuild it with file_format='array_record'")
  import tensorflow_datasets as tfds
  return tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))


def prepare_tfds(name: str, data_dir: str = "", manual_dir: str = ""):
  """The TFDS builder of `name`, downloaded and prepared as array_record first if it is not yet.

  Offline, put the files the builder downloads (e.g. tiny_shakespeare's input.txt) in `manual_dir`
  (default <data_dir>/downloads/manual).
  """
  import tensorflow_datasets as tfds
  try:
    builder = tfds.builder(name, data_dir=data_dir or None)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f"config.data.tfds_name: unknown TFDS dataset {name!r}") from e
  if builder.is_prepared():
    return builder
  config = tfds.download.DownloadConfig(manual_dir=manual_dir or None)
  try:
    with _gfile_without_tensorflow(builder):
      builder.download_and_prepare(file_format="array_record", download_config=config)
  except (ImportError, AttributeError) as e:
    if _have_tensorflow():
      raise
    raise ImportError(f"building TFDS {name} needs TensorFlow ({e}); pip install tensorflow-cpu, or prepare "
                      f"it elsewhere with file_format='array_record' into {builder.data_dir}") from e
  return tfds.builder(name, data_dir=data_dir or None)


def _have_tensorflow() -> bool:
  return importlib.util.find_spec("tensorflow") is not None


@contextlib.contextmanager
def _gfile_without_tensorflow(builder):
  """Serve `tf.io.gfile` with etils.epath while the builder's module builds, when TF is not installed.

  Catalog text builders such as tiny_shakespeare read their download with tf.io.gfile and use nothing
  else of TensorFlow; this lets them build on a TF-free install. Anything else of tf raises AttributeError.
  """
  module = sys.modules[type(builder).__module__]
  if _have_tensorflow() or not hasattr(module, "tf"):
    yield
    return
  from etils import epath
  gfile = types.SimpleNamespace(
      GFile=lambda path, mode="r": epath.Path(path).open(mode),
      exists=lambda path: epath.Path(path).exists(),
      isdir=lambda path: epath.Path(path).is_dir(),
      listdir=lambda path: [p.name for p in epath.Path(path).iterdir()])
  saved = module.tf
  module.tf = types.SimpleNamespace(io=types.SimpleNamespace(gfile=gfile))
  try:
    yield
  finally:
    module.tf = saved

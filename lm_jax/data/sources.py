"""Where documents come from: TFDS datasets by name, or the user's own files (config.data.files).

`documents(config, split)` returns a random-access sequence; item i is the text of document i, or a
`Bad` marker for a record that is not usable text (counted and skipped by the pipeline, never fatal).

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

_FEW_RECORDS = 1000
_BLANK_LINE = re.compile(rb"\r?\n[ \t\r]*\n")
_SLICE = re.compile(r"^([^\[\]]+)(?:\[(-?\d*%?):(-?\d*%?)\])?$")
_TEXT_SUFFIXES = (".txt", ".raw", ".text")


@dataclasses.dataclass(frozen=True)
class Bad:
  """A record that is not usable text; `reason` says why ('undecodable', 'malformed')."""
  reason: str


class InMemory:
  """Documents held in a list (files and small TFDS splits)."""

  def __init__(self, docs, path):
    self._docs, self.path = docs, path

  def __len__(self):
    return len(self._docs)

  def __getitem__(self, i):
    return self._docs[i]


class TfdsRecords:
  """Random access to the text field of a TFDS array_record split, decoded lazily."""

  def __init__(self, source, field, path):
    self._source, self._field, self.path = source, field, path

  def __len__(self):
    return len(self._source)

  def __getitem__(self, i):
    return _decode(self._source[i][self._field])


def documents(config, split: str):
  """The documents of `split` (e.g. config.data.train_split) from config.data.files or TFDS."""
  if config.data.files:
    return _file_documents(config.data.files, split, config.data.text_field)
  if config.data.tfds_name:
    return _tfds_documents(config.data.tfds_name, config.data.tfds_data_dir, split, config.data.text_field)
  raise ValueError("config.data: set files (a glob of your text) or tfds_name (a TFDS dataset)")


def training_text(config, max_chars: int) -> list[str]:
  """Lines of an evenly spaced sample of the training documents (the same on every host)."""
  docs = documents(config, config.data.train_split)
  step = max(1, len(docs) // 20_000)
  lines, total = [], 0
  for i in range(0, len(docs), step):
    text = docs[i]
    if isinstance(text, Bad):
      continue
    for line in text.splitlines():
      if line.strip() and total < max_chars:
        lines.append(line[:4000])     # SentencePiece skips lines over 4192 bytes
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


def _apply_slice(docs: list, spec, path):
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
  docs = []
  for path in paths:
    docs += _read_file(path, field)
  if not docs:
    raise ValueError(f"config.data.files: no documents in {pattern}")
  return InMemory(_apply_slice(docs, spec, pattern), f"{pattern} ({split})")


def _read_file(path: str, field: str) -> list:
  with open(path, "rb") as f:
    data = f.read()
  if path.endswith(_TEXT_SUFFIXES):
    return [_decode(d) for d in _BLANK_LINE.split(data) if d.strip()]
  if path.endswith(".jsonl"):
    return [_json_text(line, field) for line in data.splitlines() if line.strip()]
  if path.endswith(".tsv"):
    return _tsv_texts(data.splitlines(), field)
  raise ValueError(f"config.data.files: {path}: unsupported type; use .txt, .raw, .jsonl or .tsv")


def _json_text(line: bytes, field: str):
  try:
    text = json.loads(line)[field]
  except UnicodeDecodeError:
    return Bad("undecodable")
  except (ValueError, KeyError, TypeError):
    return Bad("malformed")
  return text if isinstance(text, str) else Bad("malformed")


def _tsv_texts(lines: list, field: str) -> list:
  lines = [l.rstrip(b"\r") for l in lines if l.strip()]
  header = lines[0].split(b"\t") if lines else []
  column = 0
  if field.encode() in header:
    column, lines = header.index(field.encode()), lines[1:]
  out = []
  for line in lines:
    cells = line.split(b"\t")
    out.append(_decode(cells[column]) if len(cells) > column else Bad("malformed"))
  return out


def _decode(raw):
  if isinstance(raw, str):
    return raw
  try:
    return bytes(raw).decode("utf-8")
  except UnicodeDecodeError:
    return Bad("undecodable")


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
  docs = [_decode(d) for r in records for d in _BLANK_LINE.split(_as_bytes(r)) if d.strip()]
  if not docs:
    raise ValueError(f"config.data: no documents in {path}")
  return InMemory(_apply_slice(docs, spec, path), path)


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

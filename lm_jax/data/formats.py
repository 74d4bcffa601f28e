"""The file formats real corpora come in, read as streams so that memory stays flat however big the file:

  .jsonl.gz / .json.gz   gzip (C4): one JSON object per line, several gzip members allowed
  .jsonl.zst             zstandard (the Pile, SlimPajama): one JSON object per line, several frames allowed
  .parquet               (Hugging Face datasets, FineWeb, Wikipedia) read one row group at a time
  a `datasets` folder    what datasets.save_to_disk writes: dataset_info.json / state.json beside *.arrow files,
                         each an Arrow IPC stream read one record batch at a time
  .jsonl / .txt / ...    plain text, read in blocks

lines(path) gives (line number, bytes) of the non-blank lines of a line format; rows(path, names) gives (row number,
{name: value}) of a columnar one. A truncated or corrupt .gz or .zst file, a damaged .arrow or .parquet file and a
damaged state.json are each a one-line ValueError naming the file (the decoders' own errors name none); records.py
turns both kinds into records and counts the bad ones.
"""
import contextlib
import json
import os
import zlib

from lm_jax import storage

_BLOCK = 1 << 20                     # bytes read at a time
_GZIP = (".jsonl.gz", ".json.gz")
_ZSTD = (".jsonl.zst", ".json.zst")
_ARROW_DIR_FILES = ("dataset_info.json", "state.json")
COMPRESSED = _GZIP + _ZSTD
COLUMNAR = (".parquet",)
_ARROW_ERRORS = (OSError, ValueError)   # what pyarrow raises on a damaged file (ArrowInvalid, ArrowIOError)


def is_arrow_dir(path: str) -> bool:
  """A folder written by datasets' save_to_disk (it holds state.json or dataset_info.json and *.arrow files)."""
  return storage.isdir(path) and any(storage.exists(_join(path, f)) for f in _ARROW_DIR_FILES)


def is_columnar(path: str) -> bool:
  return path.endswith(COLUMNAR) or is_arrow_dir(path)


def blocks(path: str):
  """The decompressed bytes of a file, block by block."""
  if path.endswith(_GZIP):
    yield from _gzip_blocks(path)
  elif path.endswith(_ZSTD):
    yield from _zstd_blocks(path)
  else:
    with storage.open(path, "rb") as f:
      while block := f.read(_BLOCK):
        yield block


def lines(path: str):
  """(line number, bytes without the newline) of each non-blank line, streamed."""
  for number, line, _ in all_lines(path):
    if line.strip():
      yield number, line.rstrip(b"\r")


def all_lines(path: str):
  """(line number, bytes, ended by a newline) of every line, blank ones too; the last is what follows the last
  newline (maybe b'')."""
  rest, number = b"", 0
  for block in blocks(path):
    parts = (rest + block).split(b"\n")
    rest = parts.pop()
    for line in parts:
      number += 1
      yield number, line, True
  yield number + 1, rest, False


def documents(path: str):
  """(line number of its first text, bytes) of each document of a text file, cut exactly as records.py cuts a file
  read whole: a whitespace-only line after a document's last line separates it from the next."""
  chunk = []
  for number, line, ended in all_lines(path):
    if chunk and ended and not line.strip(b" \t\r"):
      yield from _document(chunk, b"\n".join(line for _, line in chunk).removesuffix(b"\r"))
      chunk = []
    else:
      chunk.append((number, line))
  if chunk:
    yield from _document(chunk, b"\n".join(line for _, line in chunk))


def _document(chunk, text):
  if text.strip():
    yield chunk[0][0] + text.count(b"\n", 0, len(text) - len(text.lstrip())), text


def _gzip_blocks(path):
  yield from _members(path, lambda: zlib.decompressobj(wbits=31), "gzip file", "member", zlib.error)


def _zstd_blocks(path):
  import zstandard
  yield from _members(path, lambda: zstandard.ZstdDecompressor().decompressobj(), "zstandard file", "frame",
                      zstandard.ZstdError)


def _members(path, new, kind, part, error):
  """Decompressed blocks of concatenated members (gzip) or frames (zstd); a last one cut short, or bytes that do not
  decompress, are an error naming the file."""
  with storage.open(path, "rb") as raw:
    d, pending, inside = new(), b"", False
    while chunk := pending or raw.read(_BLOCK):
      inside, pending = True, b""
      with _damaged(path, f"a {kind}", error):
        block = d.decompress(chunk)
      yield block
      if d.eof:
        d, pending, inside = new(), d.unused_data, False
    if inside:
      raise ValueError(f"{path}: truncated {kind} (it ends inside a {part})")


@contextlib.contextmanager
def _damaged(path: str, kind: str, errors):
  """The decoders' errors (zlib, zstandard, Arrow, JSON) as one ValueError naming the file."""
  try:
    yield
  except errors as e:
    raise ValueError(f"{path}: damaged, it does not read as {kind} ({e}); replace the file") from None


def columns(path: str) -> list[str]:
  """The column names of a .parquet file or a datasets folder."""
  if path.endswith(COLUMNAR):
    return list(_parquet(path).schema_arrow.names)
  return list(_arrow_schema(path).names)


def rows(path: str, names: tuple):
  """(row number, {name: value}) of the columns `names` present in the file, streamed by row group / batch."""
  present = [n for n in names if n in columns(path)]
  number = 0
  for batch in _batches(path, present):
    for row in batch.to_pylist():
      number += 1
      yield number, row


def _batches(path, present):
  """Record batches, each checked whole (offsets, UTF-8) before use: a damaged file is an error naming it."""
  import pyarrow as pa
  if path.endswith(COLUMNAR):
    with _damaged(path, "Parquet", _ARROW_ERRORS):
      for batch in _parquet(path).iter_batches(batch_size=1024, columns=present):
        batch.validate(full=True)
        yield batch
    return
  for file in arrow_files(path):
    with _damaged(file, "an Arrow stream", _ARROW_ERRORS), _arrow_source(file) as source:
      for batch in pa.ipc.open_stream(source):
        batch = batch.select(present)
        batch.validate(full=True)
        yield batch


def arrow_files(path: str) -> list[str]:
  """A datasets folder's *.arrow files in order (state.json's _data_files when it lists them)."""
  state = _join(path, "state.json")
  if storage.exists(state):
    with storage.open(state, "r") as f, _damaged(state, "a datasets state.json", (ValueError, KeyError, TypeError,
                                                                                   AttributeError)):
      listed = [_join(path, d["filename"]) for d in json.load(f).get("_data_files", [])]
    if listed:
      return listed
  found = storage.glob(_join(path, "*.arrow"))
  if not found:
    raise ValueError(f"{path}: a datasets folder without *.arrow files")
  return found


def _arrow_schema(path):
  import pyarrow as pa
  file = arrow_files(path)[0]
  with _damaged(file, "an Arrow stream", _ARROW_ERRORS), _arrow_source(file) as source:
    return pa.ipc.open_stream(source).schema


def _parquet(path: str):
  import pyarrow.parquet as pq
  return pq.ParquetFile(storage.open(path) if storage.is_remote(path) else path)


def _arrow_source(file: str):
  """A local .arrow file memory-mapped; a remote one streamed."""
  import pyarrow as pa
  return storage.open(file) if storage.is_remote(file) else pa.memory_map(file)


def _join(folder: str, name: str) -> str:
  return f"{folder.rstrip('/')}/{name}" if storage.is_remote(folder) else os.path.join(folder, name)

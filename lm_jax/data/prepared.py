"""Prepared input (data.prepared=DIR, written by `python -m lm_jax.prepare`): the tokenized documents of each
split in indexed array_record shards, read by document index instead of tokenizing on the fly, as BERT's
create_pretraining_data.py, MaxText and Levanter tokenize once into a cache that training reads by index.

Document i of a split is record i of its shards (shard k holds documents [k * per_shard, (k + 1) * per_shard)). A
record is what corpus.tokenize makes of the document: its tokens (or sentences), or the reason it is skipped and
where it was read, with its bytes, characters and tokens. Without rows prepared ahead (below) the pipeline builds
rows, masks and batches from them exactly as from a Corpus, so prepared and on-the-fly training see the same
batches (same seed), resume the same way and give the same stream on any number of hosts.

Rows prepared ahead (manifest "passes" > 0; layouts whose rows are drawn per document, i.e. MLM + NSP): for each
of `passes` epochs, every training document's NSP pairs, masked, as BERT's create_pretraining_data.py writes
dupe_factor maskings once. Record p * documents + d holds document d's rows of pass p; epoch e reads pass e % passes
(BERT also repeats its dupe_factor maskings over the ~40 epochs it trains). The eval split has one pass. The pairs
are those the on-the-fly pipeline draws in epoch p (same seed, data.shards, data.shuffle); the masks cannot be:
on the fly a batch is masked at once with a generator of (seed, shard, batch index), so a row's mask depends on the
batch size and on which rows share its batch, which preparation cannot know. Prepared masks are drawn per document
and pass instead (np.random.default_rng([seed, pass, document])), so they do not depend on the batch size or the
number of hosts, and the rows are read back by the same windows, shuffles and cursors: the stream keeps its
determinism, exact resume and host-count independence.

A mixture (data.mixture) is prepared source by source, each in DIR/<name> as above (its rows with the source's
own seed, as on the fly); DIR/manifest.json then lists them.

DIR/manifest.json records what the shards were prepared for (tokenizer, seq_len, objective, masking, the source; for
rows also the seed, data.shards and data.shuffle the pairs depend on); a config that differs is a one-line
ConfigError. It also records each shard's size, checked at start: a missing, truncated or corrupt shard, or a torn
manifest, is a one-line error naming the file (exit 1), also when a record fails to read later in the run.
"""
import hashlib
import json
import os
import struct

import numpy as np

from lm_jax import config_lib, storage
from lm_jax.data import records, spill
from lm_jax.data import rows as rows_lib

VERSION = 1
MANIFEST = "manifest.json"
_HEAD = struct.Struct("<QQQ")          # bytes, characters, tokens
_MASKING = ("mlm_probability", "max_predictions_per_seq", "whole_word_mask", "nsp", "noise_density",
            "mean_noise_span_length", "target_len")


def tokenizer_hash(tok) -> str:
  data = tok.serialized if tok.serialized is not None else open(tok.path, "rb").read()
  return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def expected(config, tok, as_sentences: bool, with_rows: bool, source=None) -> dict:
  """What shards for this config (or for `source` of its mixture) are prepared for; the manifest must hold the
  same. Rows also depend on the seed and on the shards and shuffle that decide which other document a NotNext pair
  draws from."""
  d = config.data
  where = source or d
  out = dict(version=VERSION, tokenizer=tokenizer_hash(tok), objective=config.objective, seq_len=d.seq_len,
             as_sentences=as_sentences, masking={k: d[k] for k in _MASKING},
             source=dict(files=where.files, tfds_name=where.tfds_name, text_field=where.text_field))
  if with_rows:
    out["rows"] = dict(seed=config.seed, shards=d.shards, shuffle=d.shuffle)
  return out


def split_dir(split: str) -> str:
  """A split's folder name: 'train[:95%]' -> 'train_95pct_'."""
  return "".join(c if c.isalnum() or c in "-_" else "pct" if c == "%" else "_" for c in split)


def encode(entry, where: str) -> bytes:
  """One document's record: corpus.tokenize's (value, bad, bytes, chars, tokens) and where it was read."""
  value, bad, n_bytes, n_chars, n_tokens = entry
  head = _HEAD.pack(n_bytes, n_chars, n_tokens)
  if bad:
    return b"B" + head + json.dumps([bad.reason, bad.detail, where]).encode()
  if isinstance(value, list):
    lengths = np.array([len(s) for s in value], "<u4")
    tokens = np.concatenate(value).astype("<i4") if value else np.zeros(0, "<i4")
    return b"S" + head + struct.pack("<I", len(value)) + lengths.tobytes() + tokens.tobytes()
  return b"T" + head + np.asarray(value, "<i4").tobytes()


def encode_rows(rows: dict) -> bytes:
  """One document's rows (a dict of arrays, one entry per row along axis 0); integer arrays that fit are stored as
  uint16 (token ids of a vocabulary under 65536, positions), and read back in their own dtype."""
  head, body = [], []
  for key in sorted(rows):
    a = np.ascontiguousarray(rows[key])
    store = a.dtype.str
    if a.dtype.kind in "iu" and (not a.size or (a.min() >= 0 and a.max() < 1 << 16)):
      store = "<u2"
    head.append([key, a.dtype.str, store, list(a.shape)])
    body.append(a.astype(store).tobytes())
  meta = json.dumps(head).encode()
  return struct.pack("<I", len(meta)) + meta + b"".join(body)


def decode_rows(raw: bytes) -> dict:
  (n,) = struct.unpack_from("<I", raw)
  out, at = {}, 4 + n
  for key, dtype, store, shape in json.loads(raw[4:at]):
    size = int(np.prod(shape))
    out[key] = np.frombuffer(raw, store, size, at).reshape(shape).astype(dtype)
    at += size * np.dtype(store).itemsize
  return out


def decode(raw: bytes):
  """(value, Bad or None, bytes, chars, tokens, where of a bad one)."""
  kind, (n_bytes, n_chars, n_tokens), body = raw[:1], _HEAD.unpack_from(raw, 1), raw[1 + _HEAD.size:]
  if kind == b"B":
    reason, detail, where = json.loads(body)
    return None, records.Bad(reason, detail), n_bytes, n_chars, n_tokens, where
  if kind == b"S":
    (n,) = struct.unpack_from("<I", body)
    lengths = np.frombuffer(body, "<u4", n, 4)
    tokens = np.frombuffer(body, "<i4", offset=4 + 4 * n).astype(np.int32)
    return np.split(tokens, np.cumsum(lengths)[:-1]) if n else [], None, n_bytes, n_chars, n_tokens, ""
  return np.frombuffer(body, "<i4").astype(np.int32), None, n_bytes, n_chars, n_tokens, ""


def _counts(meta: dict) -> list[int]:
  """The records of each of a split's shards (shard k: documents [k * per_shard, (k + 1) * per_shard))."""
  n, per = meta["documents"], meta["docs_per_shard"]
  return [min(per, n - k * per) for k in range(len(meta["shards"]))]


_AGAIN = "prepare the folder again with python -m lm_jax.prepare"


def _damaged(path: str, why: str) -> ValueError:
  return ValueError(f"prepared shard {path} is damaged ({why}); {_AGAIN}")


def _shards(folder: str, names: list[str], counts: list[int], sizes: list[int] | None) -> "_Shards":
  """The shard files, checked at start against the sizes the manifest records (a manifest written before they
  were recorded: only that they exist)."""
  files = [os.path.join(folder, name) for name in names]
  for k, path in enumerate(files):
    if not os.path.isfile(path):
      raise ValueError(f"prepared shard {path} is missing; {_AGAIN}")
    size = os.path.getsize(path)
    if sizes is not None and size != sizes[k]:
      raise _damaged(path, f"{size} bytes, its manifest.json says {sizes[k]}")
  return _Shards(files, counts)


class _Shards(spill.Shards):
  """Shards whose read errors name the shard: a shard holding other than the manifest's record count when first
  opened, or a record that does not read (corrupt bytes of the right size)."""

  def __init__(self, files: list[str], counts: list[int]):
    super().__init__(files, counts)
    self._counts = counts

  def _reader(self, k: int):
    first = self._readers[k] is None
    try:
      reader = super()._reader(k)
      found = reader.num_records() if first else self._counts[k]
    except (RuntimeError, OSError) as e:
      raise _damaged(self._files[k], str(e).splitlines()[0][:200]) from None
    if found != self._counts[k]:
      self._readers[k] = None
      raise _damaged(self._files[k], f"{found} records, its manifest.json says {self._counts[k]}")
    return reader

  def __getitem__(self, i: int) -> bytes:
    try:
      return super().__getitem__(i)
    except RuntimeError as e:
      k = int(np.searchsorted(self._starts, i, side="right")) - 1
      raise _damaged(self._files[k], str(e).splitlines()[0][:200]) from None


class _Docs(records.Records):
  """A prepared split as records (for the Tally): where(i) is where a skipped document was read."""

  lazy = True

  def __init__(self, source, path, decode_stats):
    self._source, self.path, self._decode_stats = source, path, decode_stats

  def __len__(self):
    return len(self._source)

  def _get(self, i):
    return self._source[i]

  def where(self, i):
    return decode(self._source[i])[5] or f"{self.path} document {i}"

  @property
  def decode_stats(self) -> dict:
    return self._decode_stats


class PreparedCorpus:
  """A Corpus (data/corpus.py) read from prepared shards: tokens(ids) per id, the same tally and text counts."""

  def __init__(self, directory: str, split: str, meta: dict, as_sentences: bool):
    shards = _shards(os.path.join(directory, split_dir(split)), meta["shards"], _counts(meta), meta.get("shard_bytes"))
    self.docs = _Docs(shards, meta["path"], meta["decode_stats"])
    self.path = self.docs.path
    self._empty = [] if as_sentences else np.zeros(0, np.int32)
    self._seen = np.zeros(len(self.docs), bool)
    self.tally = records.Tally(self.docs, ("empty", "undecodable", "malformed", "too_short"))
    self.bytes = self.chars = self.tokens_count = 0

  @property
  def stats(self) -> dict:
    return self.tally.counts

  def __len__(self):
    return len(self.docs)

  def tokens(self, ids: list[int]) -> list:
    out = []
    for i in ids:     # one record at a time: the source's batched read starts a thread pool per call
      value, bad, n_bytes, n_chars, n_tokens, _ = decode(self.docs[i])
      if not self._seen[i]:              # counted once, as a Corpus counts a document it keeps
        self._seen[i] = True
        self.tally.count(i, bad and bad.reason, bad and bad.detail)
        self.bytes, self.chars, self.tokens_count = (self.bytes + n_bytes, self.chars + n_chars,
                                                     self.tokens_count + n_tokens)
      out.append(self._empty if bad else value)
    return out


class PreparedRows(PreparedCorpus):
  """A prepared split with its rows made ahead: instances(epoch, doc) -> the document's masked rows of pass
  epoch % passes, one dict per row (what the layout of rows_layout assembles)."""

  def __init__(self, directory: str, split: str, meta: dict, role: str):
    super().__init__(directory, split, meta, as_sentences=True)
    made = meta["rows"][role]
    self.passes = made["passes"]
    self._rows = _shards(os.path.join(directory, split_dir(split)), made["shards"], _counts(meta) * self.passes,
                         made.get("shard_bytes"))

  def instances(self, epoch: int, doc: int) -> list:
    if not self._seen[doc]:
      self.tokens([doc])                 # counted in the tally once, as on the fly
    rows = decode_rows(self._rows[(epoch % self.passes) * len(self) + doc])
    n = len(rows["input_ids"]) if rows else 0
    return [{k: v[r] for k, v in rows.items()} for r in range(n)]


def rows_layout(width: int, features: dict):
  """The layout of prepared rows: each instance already is a finished row of the objective's `features`
  ({name: (shape, dtype)}), so assembling stacks them."""
  def stack(found: list) -> dict:
    if not found:
      return {k: np.zeros((0, *shape), dtype) for k, (shape, dtype) in features.items()}
    return {k: np.stack([r[k] for r in found]) for k in features}
  return rows_lib.PerDocument(width=width, instances=None, assemble=stack,
                              real_tokens=lambda row: int(row["attention_mask"].sum()))


def local_folder(path: str, what: str) -> str:
  """`path` expanded; a remote one is a one-line error. The shards are array_record files, read by index through a
  local file system: a bucket is mounted (gcsfuse, as MaxText's ArrayRecord input does) or copied to each host."""
  config_lib.require(not storage.is_remote(path), f"{what}={path}: prepared shards are read by index from a local "
                     "path; mount the bucket (gcsfuse) or copy the folder to each host, and name that path")
  return os.path.expanduser(path)


def manifest(config, source=None) -> dict:
  """config.data.prepared's manifest.json (a mixture's: the one of `source`, in its folder <name>)."""
  name = f"{source.name}/{MANIFEST}" if source else MANIFEST
  path = os.path.join(local_folder(config.data.prepared, "config.data.prepared"), name)
  config_lib.require(os.path.exists(path), f"config.data.prepared={config.data.prepared}: no {name} there; "
                     "write it with python -m lm_jax.prepare")
  with open(path) as f:
    try:
      found = json.load(f)
    except ValueError as e:
      raise ValueError(f"{path} is not a complete manifest ({e}); {_AGAIN}") from None
  if not isinstance(found, dict):
    raise ValueError(f"{path} is not a prepared folder's manifest (JSON {type(found).__name__}); {_AGAIN}")
  return found


def passes(config, layout) -> int:
  """The passes of rows config.data.prepared holds for this layout; 0 when the rows are built on the fly."""
  if not config.data.prepared or not layout.as_sentences or getattr(layout, "corpus", None):
    return 0
  return manifest(config).get("passes", 0)


def open_split(config, split: str, tok, as_sentences: bool, role: str = "train", source=None) -> PreparedCorpus:
  """config.data.prepared's split of config.data (or of mixture `source`), its rows for `role` ('train' or
  'eval') if rows were prepared, after checking that it was prepared for this config."""
  top = manifest(config)
  held = ", ".join(top.get("sources", {}))
  config_lib.require(bool(source) == bool(held), f"config.data.prepared={config.data.prepared} holds " + (
      f"the sources of a mixture ({held}); this config has no config.data.mixture" if held else
      "one source, this config has a config.data.mixture: prepare it again for this config"))
  manifest_ = manifest(config, source)
  with_rows = manifest_.get("passes", 0) > 0
  want = expected(config, tok, as_sentences, with_rows, source)
  name = f"{config.data.prepared}" + (f" (source {source.name})" if source else "")
  for key, value in want.items():
    config_lib.require(manifest_.get(key) == value, f"config.data.prepared={name} was prepared for "
                       f"{key}={manifest_.get(key)!r}, this config has {value!r}: prepare it again for this config")
  config_lib.require(split in manifest_["splits"], f"config.data.prepared={name} has no split "
                     f"{split!r} (it has {', '.join(manifest_['splits'])})")
  meta = manifest_["splits"][split]
  directory = os.path.join(os.path.expanduser(config.data.prepared), source.name if source else "")
  if with_rows:
    return PreparedRows(directory, split, meta, role)
  return PreparedCorpus(directory, split, meta, as_sentences)

"""Prepared input (data.prepared=DIR, written by `python -m lm_jax.prepare`): the tokenized documents of each
split in indexed array_record shards, read by document index instead of tokenizing on the fly, as BERT's
create_pretraining_data.py, MaxText and Levanter tokenize once into a cache that training reads by index.

Document i of a split is record i of its shards (shard k holds documents [k * per_shard, (k + 1) * per_shard)). A
record is what corpus.tokenize makes of the document: its tokens (or sentences), or the reason it is skipped and
where it was read, with its bytes, characters and tokens. The pipeline builds rows, masks and batches from them
exactly as from a Corpus, so prepared and on-the-fly training see the same batches (same seed), resume the same
way and give the same stream on any number of hosts.

DIR/manifest.json records what the shards were prepared for (tokenizer, seq_len, objective, masking, the source);
a config that differs is a one-line ConfigError.
"""
import hashlib
import json
import os
import struct

import numpy as np

from lm_jax import config_lib
from lm_jax.data import records

VERSION = 1
MANIFEST = "manifest.json"
_HEAD = struct.Struct("<QQQ")          # bytes, characters, tokens
_MASKING = ("mlm_probability", "max_predictions_per_seq", "whole_word_mask", "nsp", "noise_density",
            "mean_noise_span_length", "target_len")


def tokenizer_hash(tok) -> str:
  data = tok.serialized if tok.serialized is not None else open(tok.path, "rb").read()
  return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()[:16]


def expected(config, tok, as_sentences: bool) -> dict:
  """What shards for this config are prepared for; the manifest must hold the same."""
  d = config.data
  return dict(version=VERSION, tokenizer=tokenizer_hash(tok), objective=config.objective, seq_len=d.seq_len,
              as_sentences=as_sentences, masking={k: d[k] for k in _MASKING},
              source=dict(files=d.files, tfds_name=d.tfds_name, text_field=d.text_field))


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
    from array_record.python import array_record_data_source
    files = [os.path.join(directory, split_dir(split), name) for name in meta["shards"]]
    self.docs = _Docs(array_record_data_source.ArrayRecordDataSource(files) if files else [],
                      meta["path"], meta["decode_stats"])
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


def open_split(config, split: str, tok, as_sentences: bool) -> PreparedCorpus:
  """config.data.prepared's split, after checking that it was prepared for this config."""
  directory = os.path.expanduser(config.data.prepared)
  path = os.path.join(directory, MANIFEST)
  config_lib.require(os.path.exists(path), f"config.data.prepared={config.data.prepared}: no {MANIFEST} there; "
                     "write it with python -m lm_jax.prepare")
  with open(path) as f:
    manifest = json.load(f)
  want = expected(config, tok, as_sentences)
  for key, value in want.items():
    config_lib.require(manifest.get(key) == value, f"config.data.prepared={config.data.prepared} was prepared for "
                       f"{key}={manifest.get(key)!r}, this config has {value!r}: prepare it again for this config")
  config_lib.require(split in manifest["splits"], f"config.data.prepared={config.data.prepared} has no split "
                     f"{split!r} (it has {', '.join(manifest['splits'])})")
  return PreparedCorpus(directory, split, manifest["splits"][split], as_sentences)

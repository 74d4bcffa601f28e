"""nanoGPT's data for a causal LM (karpathy/nanoGPT: data/shakespeare_char/prepare.py, train.py get_batch).

config.data.split_fraction > 0 reads data.files as one text and cuts it at int(len(text) * fraction) characters:
the first part trains, the rest evaluates (prepare.py's 90% / 10%; Tiny Shakespeare's 1,115,394 characters give
1,003,854 / 111,540). Otherwise a split is its documents (lm_jax/data/sources.py) joined by blank lines.

config.data.windows trains on seq_len + 1 tokens at uniformly random starts of the tokenized train text, the same
draw as get_batch, each batch from np.random.default_rng([seed, batch index]) so a resumed run continues the same
batches; and evaluates every token of the eval text once, in consecutive windows (each target sees the tokens
before it in its window), the last window and batch padded with rows that count in no metric. That is the exact
loss over the split; nanoGPT's own figure is the mean of eval_iters random batches.
"""
import os

import numpy as np

from lm_jax import storage
from lm_jax.data import records, sources


def split_texts(config) -> tuple[str, str]:
  """(train text, eval text) of config.data."""
  d = config.data
  if not d.split_fraction:
    return tuple(_joined(sources.documents(config, split)) for split in (d.train_split, d.eval_split))
  if not 0 < d.split_fraction < 1:
    raise ValueError(f"config.data.split_fraction={d.split_fraction} must be in (0, 1) (0 = off)")
  if not d.files or "{split}" in d.files:
    raise ValueError(f"config.data.split_fraction cuts one text: set config.data.files to its file(s) without "
                     f"{{split}}, got {d.files!r}")
  paths = storage.glob(os.path.expanduser(d.files))
  if not paths:
    raise FileNotFoundError(f"config.data.files={d.files!r} matches no file")
  text = "".join(_read(p) for p in paths)
  cut = int(len(text) * d.split_fraction)
  return text[:cut], text[cut:]


def _read(path: str) -> str:
  with storage.open(path, "r", encoding="utf-8") as f:   # universal newlines, as nanoGPT's open()
    return f.read()


def _joined(docs: records.Records) -> str:
  return "\n\n".join(doc for doc in docs if not isinstance(doc, records.Bad))


def _tokens(config, tokenizer, which: int, what: str) -> tuple[np.ndarray, str]:
  text = split_texts(config)[which]
  ids = np.asarray(tokenizer.encode(text), np.int32)
  if len(ids) <= config.data.seq_len:
    raise ValueError(f"config.data.windows: the {what} text has {len(ids)} tokens, not more than "
                     f"data.seq_len={config.data.seq_len}")
  return ids, text


def _rows(windows: np.ndarray, real: np.ndarray) -> dict:
  """clm's batch (objectives/clm.py features) of token windows (N, seq_len + 1); real (N, seq_len) marks targets
  that count."""
  n, width = windows.shape[0], windows.shape[1] - 1
  return {"input_ids": windows[:, :-1], "targets": windows[:, 1:], "segment_ids": real.astype(np.int32),
          "positions": np.broadcast_to(np.arange(width, dtype=np.int32), (n, width)).copy(),
          "weights": real.astype(np.float32)}


class TrainWindows:
  """Endless local batches of random windows; get_state / set_state hold the batch index (pipeline's layout of an
  iterator state, so checkpoints store it like any other)."""

  def __init__(self, ids: np.ndarray, *, seq_len: int, batch_size: int, seed: int, local: slice):
    self._ids, self._len, self._batch, self._seed, self._local = ids, seq_len, batch_size, seed, local
    self._index = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    rng = np.random.default_rng([self._seed, self._index])
    starts = rng.integers(0, len(self._ids) - self._len, self._batch)[self._local]
    self._index += 1
    windows = self._ids[starts[:, None] + np.arange(self._len + 1)]
    return _rows(windows, np.ones((len(starts), self._len), bool))

  def get_state(self) -> dict:
    return {"batch_index": self._index, "shards": {"windows": self._index}}

  def set_state(self, state: dict):
    self._index = int(state["batch_index"])

  def close(self):
    pass


def train_iterator(config, tokenizer, local: slice) -> TrainWindows:
  ids, _ = _tokens(config, tokenizer, 0, "train")
  return TrainWindows(ids, seq_len=config.data.seq_len, batch_size=config.batch_size, seed=config.seed, local=local)


def eval_batches(config, tokenizer, local: slice) -> tuple[list, dict]:
  """(this host's slices of the eval batches, text per token {'bytes', 'chars'}): every target of the eval text
  once; data.eval_batches > 0 keeps only that many batches from the start."""
  ids, text = _tokens(config, tokenizer, 1, "eval")
  width, batch = config.data.seq_len, config.batch_size
  targets = len(ids) - 1
  rows = -(-targets // width)
  rows += -rows % batch
  padded = np.zeros(rows * width + 1, np.int32)
  padded[:len(ids)] = ids
  index = np.arange(rows)[:, None] * width + np.arange(width + 1)
  real = index[:, :-1] < targets
  batches = [_rows(padded[index[b:b + batch]], real[b:b + batch]) for b in range(0, rows, batch)]
  if config.data.eval_batches:
    batches = batches[:config.data.eval_batches]
  local_batches = [{k: v[local] for k, v in b.items()} for b in batches]
  return local_batches, {"bytes": len(text.encode("utf-8")) / len(ids), "chars": len(text) / len(ids)}

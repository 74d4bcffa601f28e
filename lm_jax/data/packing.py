"""Cutting a stream of concatenated documents into fixed-length rows (vectorised numpy).

The stream is a 1-D token array with a parallel array of document numbers. Rows are consecutive slices of
it, so a document longer than a row continues in the next row, and a row holds the ends and starts of
several documents; segment ids and positions keep them apart.
"""
import numpy as np


def causal_rows(tokens: np.ndarray, doc: np.ndarray, length: int, pad_id: int) -> dict:
  """Rows of next-token prediction: the stream's tokens[:-1] as inputs, tokens[1:] as targets.

  A target counts (weight 1) only inside the same document; padding has segment id 0 and weight 0.
  Positions restart at 0 at each document start and at each row start (a piece of a long document is
  modelled on its own, as if it were a document), so every row is self-contained.
  """
  n = max(len(tokens) - 1, 0)
  rows = -(-n // length)
  pad = rows * length - n

  def shape(x, fill):
    return np.pad(x, (0, pad), constant_values=fill).reshape(rows, length)
  inputs, targets = shape(tokens[:n], pad_id), shape(tokens[1:n + 1], pad_id)
  weights = shape((doc[:n] == doc[1:n + 1]).astype(np.float32), 0)
  d = shape(doc[:n], -1)
  real = d >= 0
  new = np.concatenate([np.ones((rows, 1), bool), d[:, 1:] != d[:, :-1]], 1)
  segment_ids = np.where(real, np.cumsum(new, 1), 0)
  idx = np.broadcast_to(np.arange(length), (rows, length))
  positions = np.where(real, idx - np.maximum.accumulate(np.where(new, idx, 0), 1), 0)
  return dict(input_ids=inputs.astype(np.int32), targets=targets.astype(np.int32),
              weights=weights, segment_ids=segment_ids.astype(np.int32),
              positions=positions.astype(np.int32))


def chunk_rows(tokens: np.ndarray, length: int, *, pad_id: int | None) -> np.ndarray:
  """(rows, length) consecutive chunks; the last partial chunk is padded, or dropped when pad_id is None."""
  rows = len(tokens) // length if pad_id is None else -(-len(tokens) // length)
  tokens = tokens[:rows * length]
  return np.pad(tokens, (0, rows * length - len(tokens)), constant_values=pad_id or 0).reshape(rows, length)


def bert_rows(chunks: np.ndarray, *, cls_id: int, sep_id: int, pad_id: int) -> dict:
  """[CLS] chunk [SEP] rows for MLM without NSP (trailing padding of the chunk moved after [SEP])."""
  rows, width = chunks.shape
  n = (chunks != pad_id).sum(1)
  ids = np.full((rows, width + 2), pad_id, np.int32)
  ids[:, 0] = cls_id
  ids[:, 1:-1] = chunks
  ids[np.arange(rows), n + 1] = sep_id
  mask = (np.arange(width + 2)[None] <= (n + 1)[:, None]).astype(np.int32)
  return dict(input_ids=ids, token_type_ids=np.zeros_like(ids), attention_mask=mask)

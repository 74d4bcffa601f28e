"""BERT next-sentence-prediction pairs from real document structure (create_pretraining_data.py).

A document is a list of segments (sentences as token arrays). Segments are gathered into a chunk of about
the target length; the chunk's first a_end segments are A; B is the rest of the chunk (IsNext) or, half the
time, segments from a random other document (NotNext; the unused segments of the chunk are put back).
One change from BERT: a one-segment chunk with IsNext drawn is cut inside the segment instead of being
forced to NotNext, so the label split stays 50/50 on corpora of short documents.
"""
import re

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
  """Lines of the document, cut further after . ! ? (BERT's data has one sentence per line)."""
  return [s for line in text.splitlines() for s in _SENTENCE_END.split(line.strip()) if s]


def truncate_seq_pair(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.Generator):
  """BERT's rule: trim the longer of the two, one token at a time, from the front or back at random."""
  while len(a) + len(b) > max_tokens:
    if len(a) > len(b):
      a = a[1:] if rng.random() < 0.5 else a[:-1]
    else:
      b = b[1:] if rng.random() < 0.5 else b[:-1]
  return a, b


def instances(doc: list[np.ndarray], *, rng: np.random.Generator, seq_len: int, other_doc,
              short_seq_prob: float = 0.1) -> list[tuple[np.ndarray, np.ndarray, int]]:
  """(tokens_a, tokens_b, is_random_next) pairs of one document; other_doc(rng) -> segments of another one."""
  max_tokens = seq_len - 3                  # [CLS] A [SEP] B [SEP]
  target = max_tokens
  if rng.random() < short_seq_prob:
    target = int(rng.integers(2, max_tokens + 1))
  out, chunk, length, i = [], [], 0, 0
  while i < len(doc):
    chunk.append(doc[i])
    length += len(doc[i])
    if i == len(doc) - 1 or length >= target:
      a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
      a = np.concatenate(chunk[:a_end])
      is_random = rng.random() < 0.5
      if not is_random and len(chunk) == 1:
        if len(a) >= 2:
          cut = int(rng.integers(1, len(a)))
          a, b = a[:cut], a[cut:]
        else:
          is_random = True
      elif not is_random:
        b = np.concatenate(chunk[a_end:])
      if is_random:
        other = other_doc(rng)
        parts, need = [], max(1, target - len(a))
        for seg in other[int(rng.integers(0, len(other))):]:
          parts.append(seg)
          if sum(map(len, parts)) >= need:
            break
        b = np.concatenate(parts)
        i -= len(chunk) - a_end             # put the unused segments back
      a, b = truncate_seq_pair(a, b, max_tokens, rng)
      if len(a) and len(b):
        out.append((a, b, int(is_random)))
      chunk, length = [], 0
    i += 1
  return out


def assemble(pairs, *, seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> dict:
  """[CLS] A [SEP] B [SEP] rows, padded: input_ids, token_type_ids, attention_mask, nsp_labels (1 = random)."""
  n = len(pairs)
  ids = np.full((n, seq_len), pad_id, np.int32)
  types = np.zeros((n, seq_len), np.int32)
  mask = np.zeros((n, seq_len), np.int32)
  labels = np.zeros((n,), np.int32)
  for r, (a, b, is_random) in enumerate(pairs):
    la, lb = len(a), len(b)
    ids[r, :la + lb + 3] = np.concatenate([[cls_id], a, [sep_id], b, [sep_id]])
    types[r, la + 2:la + lb + 3] = 1
    mask[r, :la + lb + 3] = 1
    labels[r] = is_random
  return dict(input_ids=ids, token_type_ids=types, attention_mask=mask, nsp_labels=labels)

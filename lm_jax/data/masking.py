"""BERT's masked-LM corruption (google-research/bert create_pretraining_data.py), vectorised over a batch.

Per row, num_to_predict = min(max_predictions, max(1, round(n_candidates * rate))) non-special positions are
selected; of those 80% become [MASK], 10% a random non-special token and 10% stay unchanged. With
`word_starts`, whole words are selected (all pieces together, each piece still predicted on its own).
"""
import numpy as np


def mask_tokens(input_ids, *, rng, vocab_size, mask_id, special_ids, rate=0.15, max_predictions, word_starts=None):
  """Returns dict(input_ids (B,L) masked, mlm_positions (B,P) sorted and 0-padded, mlm_ids (B,P) original tokens,
  mlm_weights (B,P) float32 1 on real predictions, 0 on padding); P = max_predictions.

  Words are visited in random order and taken while they fit the budget; a word that would overflow it is skipped
  and later, shorter words are still tried (BERT's loop). Each pass below takes the prefix of the remaining
  words that fits, so a few vectorised passes reproduce that loop exactly. Without `word_starts` every
  candidate is a one-piece word and one pass suffices.
  """
  ids = np.asarray(input_ids)
  b, length = ids.shape
  special = np.unique(np.append(np.asarray(special_ids, np.int64), mask_id))
  cand = ~np.isin(ids, special)
  n_cand = cand.sum(1)
  budget = np.minimum(np.minimum(max_predictions, np.maximum(1, np.rint(n_cand * rate))), n_cand).astype(np.int64)

  # A word starts at a candidate marked as a word start or following a non-candidate.
  starts = cand
  if word_starts is not None:
    after_special = np.pad(~cand, ((0, 0), (1, 0)), constant_values=True)[:, :-1]
    starts = cand & (np.asarray(word_starts, bool) | after_special)
  word = np.maximum(np.cumsum(starts, 1) - 1, 0)  # word index of each candidate token
  rows = np.arange(b)[:, None]
  word_len = np.bincount((rows * length + word)[cand], minlength=b * length).reshape(b, length)

  order = np.argsort(rng.random((b, length)), 1)  # random visiting order of word slots (empty slots have len 0)
  lens = np.take_along_axis(word_len, order, 1)
  taken = np.zeros((b, length), bool)
  left = budget.copy()
  while True:
    fits = ~taken & (lens > 0) & (lens <= left[:, None])
    take = fits & (np.cumsum(np.where(fits, lens, 0), 1) <= left[:, None])
    if not take.any():
      break
    taken |= take
    left -= np.where(take, lens, 0).sum(1)
  word_taken = np.zeros((b, length), bool)
  np.put_along_axis(word_taken, order, taken, 1)
  selected = cand & np.take_along_axis(word_taken, word, 1)

  # 80% [MASK], 10% random non-special token, 10% unchanged; decided per piece.
  u = rng.random((b, length))
  out = np.where(selected & (u < 0.8), mask_id, ids)
  randomize = selected & (u >= 0.9)
  inside = special[special < vocab_size]
  out[randomize] = _non_special(rng.integers(0, vocab_size - len(inside), int(randomize.sum())), inside)

  positions = np.argsort(~selected, 1, kind="stable")[:, :max_predictions]
  positions = np.pad(positions, ((0, 0), (0, max_predictions - positions.shape[1])))
  weights = np.arange(max_predictions)[None] < selected.sum(1)[:, None]
  positions = np.where(weights, positions, 0)
  return dict(
      input_ids=out.astype(np.int32),
      mlm_positions=positions.astype(np.int32),
      mlm_ids=np.where(weights, np.take_along_axis(ids, positions, 1), 0).astype(np.int32),
      mlm_weights=weights.astype(np.float32))


def _non_special(j, special):
  """The j-th non-special token id (special: sorted, unique, below the vocabulary size), without building the
  vocabulary-sized list of them (np.setdiff1d took ~8 ms a call, most of a per-document masking)."""
  return j + np.searchsorted(special - np.arange(len(special)), j, side="right")

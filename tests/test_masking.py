"""BERT masked-LM corruption: rates, the 80/10/10 split, special tokens, whole words, output layout."""
import numpy as np
import pytest

from lm_jax.data.masking import mask_tokens

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = [PAD, UNK, CLS, SEP]
VOCAB = 1000


def _batch(rng, rows=512, length=512):
  """BERT-like rows: [CLS] A [SEP] B [SEP] then padding of random length; some [UNK]s inside."""
  ids = rng.integers(5, VOCAB, (rows, length))
  ids[rng.random((rows, length)) < 0.01] = UNK
  ids[:, 0] = CLS
  ids[:, length // 3] = SEP
  ends = rng.integers(length // 2, length + 1, rows)
  ids[np.arange(rows), ends - 1] = SEP
  ids[np.arange(length)[None] >= ends[:, None]] = PAD
  return ids


def _mask(ids, rng, **kw):
  kw = dict(rng=rng, vocab_size=VOCAB, mask_id=MASK, special_ids=SPECIAL, max_predictions=ids.shape[1]) | kw
  return mask_tokens(ids, **kw)


def _selected(out, shape):
  sel = np.zeros(shape, bool)
  rows = np.repeat(np.arange(shape[0]), out["mlm_positions"].shape[1])
  sel[rows[out["mlm_weights"].ravel() > 0], out["mlm_positions"].ravel()[out["mlm_weights"].ravel() > 0]] = True
  return sel


def test_rates_split_and_specials():
  rng = np.random.default_rng(0)
  ids = _batch(rng)
  out = _mask(ids, rng)
  cand = ~np.isin(ids, SPECIAL)
  assert cand.sum() >= 100_000
  sel = _selected(out, ids.shape)
  assert not (sel & ~cand).any(), "a special token was selected"
  assert abs(sel.sum() / cand.sum() - 0.15) < 0.003
  # BERT's per-row count: min(max_predictions, max(1, round(n * 0.15))).
  np.testing.assert_array_equal(sel.sum(1), np.maximum(1, np.rint(cand.sum(1) * 0.15)))

  new, old = out["input_ids"][sel], ids[sel]
  masked, kept = new == MASK, new == old
  randomized = ~masked & ~kept
  assert abs(masked.mean() - 0.8) < 0.01
  assert abs(kept.mean() - 0.1) < 0.01
  assert abs(randomized.mean() - 0.1) < 0.01
  assert not np.isin(new[randomized], SPECIAL + [MASK]).any()
  assert len(np.unique(new[randomized])) > 0.9 * (VOCAB - 5)  # uniform over the vocabulary
  np.testing.assert_array_equal(out["input_ids"][~sel], ids[~sel])


def test_layout_and_max_predictions():
  rng = np.random.default_rng(1)
  ids = _batch(rng, rows=64, length=128)
  out = _mask(ids, rng, max_predictions=20)
  assert {k: (v.shape, v.dtype) for k, v in out.items()} == {
      "input_ids": ((64, 128), np.int32), "mlm_positions": ((64, 20), np.int32),
      "mlm_ids": ((64, 20), np.int32), "mlm_weights": ((64, 20), np.float32)}
  w = out["mlm_weights"] > 0
  n = np.minimum(20, np.maximum(1, np.rint((~np.isin(ids, SPECIAL)).sum(1) * 0.15)))
  np.testing.assert_array_equal(w.sum(1), n)
  assert (w[:, :-1] >= w[:, 1:]).all(), "real predictions first, padding after"
  assert (np.diff(out["mlm_positions"], axis=1)[w[:, 1:]] > 0).all(), "positions sorted and distinct"
  assert (out["mlm_positions"][~w] == 0).all() and (out["mlm_ids"][~w] == 0).all()
  np.testing.assert_array_equal(out["mlm_ids"][w], np.take_along_axis(ids, out["mlm_positions"], 1)[w])


def test_deterministic_for_a_seed():
  ids = _batch(np.random.default_rng(2), rows=8, length=64)
  a, b = (_mask(ids, np.random.default_rng([3, 0, 7])) for _ in range(2))
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("max_predictions", [512, 20])
def test_whole_word_masking(max_predictions):
  rng = np.random.default_rng(4)
  ids = _batch(rng, rows=256, length=512)
  word_starts = rng.random(ids.shape) < 0.6   # words of 1.67 pieces on average
  out = _mask(ids, rng, word_starts=word_starts, max_predictions=max_predictions)
  sel = _selected(out, ids.shape)
  cand = ~np.isin(ids, SPECIAL)
  assert not (sel & ~cand).any()

  # Words: a candidate starting a word or following a special token opens a new word; ids unique across rows.
  prev_special = np.pad(~cand, ((0, 0), (1, 0)), constant_values=True)[:, :-1]
  start = cand & (word_starts | prev_special)
  stride = ids.shape[1] + 1
  word = (np.cumsum(start, 1) + np.arange(len(ids))[:, None] * stride)[cand]
  words, word_len = np.unique(word, return_counts=True)
  word_sel = np.bincount(word, sel[cand], minlength=word.max() + 1)[words]
  picked = word_sel > 0
  np.testing.assert_array_equal(word_sel[picked], word_len[picked])  # whole words only

  budget = np.minimum(max_predictions, np.maximum(1, np.rint(cand.sum(1) * 0.15)))
  count = sel.sum(1)
  assert (count <= budget).all()
  # BERT's loop skips a word that overflows and keeps trying, so every word left out is longer than what is left.
  left = (budget - count)[words // stride]
  assert (word_len[~picked] > left[~picked]).all()
  if max_predictions == 512:
    assert abs(sel.sum() / cand.sum() - 0.15) < 0.003
    assert (word_len[picked] > 1).mean() > 0.3, "multi-piece words are selected"

"""T5 span corruption: static lengths, noise statistics, exact reconstruction."""
import numpy as np
import pytest

from lm_jax.data.corruption import corrupt_spans, span_lengths

VOCAB, EOS = 32100, 1
FIRST_SENTINEL = VOCAB - 100


@pytest.mark.parametrize("inputs_length,expected", [(512, (568, 114)), (128, (141, 29)), (256, (284, 58)),
                                                    (1024, (1137, 229))])
def test_span_lengths_match_t5(inputs_length, expected):
  assert span_lengths(inputs_length, 0.15, 3.0) == expected


def _corrupt(inputs_length, rows, seed=0):
  raw, targets = span_lengths(inputs_length)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, FIRST_SENTINEL, (rows, raw)).astype(np.int32)
  out = corrupt_spans(tokens, rng=rng, vocab_size=VOCAB, eos_id=EOS, noise_density=0.15, mean_span=3.0,
                      inputs_length=inputs_length, targets_length=targets)
  return tokens, out


def _reconstruct(inputs, targets):
  """Each sentinel in the inputs -> the tokens after the same sentinel in the targets."""
  spans, current = {}, None
  for t in targets[:list(targets).index(EOS)]:
    if t >= FIRST_SENTINEL:
      current = spans.setdefault(t, [])
    else:
      current.append(t)
  out = []
  for t in inputs[:list(inputs).index(EOS)]:
    out.extend(spans.pop(t) if t >= FIRST_SENTINEL else [t])
  assert not spans, "every target span is used once"
  return out


@pytest.mark.parametrize("inputs_length", [512, 128])
def test_exact_lengths_and_reconstruction(inputs_length):
  tokens, out = _corrupt(inputs_length, rows=64)
  _, targets = span_lengths(inputs_length)
  assert out["input_ids"].shape == (64, inputs_length) and out["input_ids"].dtype == np.int32
  assert out["decoder_target_ids"].shape == (64, targets) and out["decoder_target_ids"].dtype == np.int32
  # Exactly full: eos last, no padding.
  assert (out["input_ids"][:, -1] == EOS).all() and (out["decoder_target_ids"][:, -1] == EOS).all()
  assert (out["input_ids"] != 0).all() and (out["decoder_target_ids"] != 0).all()
  for row in range(len(tokens)):
    inputs, target = out["input_ids"][row], out["decoder_target_ids"][row]
    sentinels = inputs[inputs >= FIRST_SENTINEL]
    np.testing.assert_array_equal(sentinels, VOCAB - 1 - np.arange(len(sentinels)))  # counted down from the top
    np.testing.assert_array_equal(target[target >= FIRST_SENTINEL], sentinels)
    assert target[0] == VOCAB - 1 and inputs[0] < FIRST_SENTINEL  # non-noise span first
    assert _reconstruct(inputs, target) == list(tokens[row])


def test_noise_statistics():
  """Over 2000 rows of 568: density and mean span length as configured, span lengths random (not all 3), and
  noise spread evenly along the row."""
  tokens, out = _corrupt(512, rows=2000, seed=1)
  tgt = out["decoder_target_ids"][:, :-1]
  is_sentinel = tgt >= FIRST_SENTINEL
  noise = (~is_sentinel).sum()
  assert abs(noise / tokens.size - 0.15) < 0.002
  assert abs(noise / is_sentinel.sum() - 3.0) < 0.1
  # Span lengths: distances between consecutive sentinels in the targets.
  idx = np.flatnonzero(np.concatenate([is_sentinel, np.ones((len(tgt), 1), bool)], 1).ravel())
  lengths = np.diff(idx) - 1
  lengths = lengths[lengths > 0]  # 0 = the gap between one row's end and the next row's first sentinel
  assert len(lengths) == is_sentinel.sum()
  assert lengths.min() == 1 and lengths.max() >= 10 and 0.25 < (lengths == 1).mean() < 0.45

  # Where the noise falls: rebuild the noise mask from the inputs (sentinel k covers span k's length).
  rng = np.random.default_rng(2)
  rows = rng.choice(len(tokens), 200, replace=False)
  mask = np.zeros((len(rows), tokens.shape[1]))
  for i, r in enumerate(rows):
    span_len = np.diff(np.flatnonzero(np.append(tgt[r] >= FIRST_SENTINEL, True))) - 1
    pos, k = 0, 0
    for t in out["input_ids"][r][:-1]:
      if t >= FIRST_SENTINEL:
        mask[i, pos:pos + span_len[k]] = 1
        pos, k = pos + span_len[k], k + 1
      else:
        pos += 1
  for third in np.array_split(mask[:, 10:-10], 3, axis=1):
    assert abs(third.mean() - 0.15) < 0.02


def test_too_short_targets_is_a_clear_error():
  raw, _ = span_lengths(128)
  with pytest.raises(ValueError, match="targets_length=20"):
    corrupt_spans(np.full((2, raw), 5), rng=np.random.default_rng(0), vocab_size=VOCAB, eos_id=EOS,
                  noise_density=0.15, mean_span=3.0, inputs_length=128, targets_length=20)

"""T5 span corruption (t5.data.preprocessors.span_corruption / HF run_t5_mlm_flax.py), vectorised over a batch.

A raw row is split at random into alternating non-noise / noise spans (non-noise first); each noise span becomes
one sentinel in the inputs, and the targets are the noise spans, each preceded by its sentinel. Sentinel k is
vocab_size - 1 - k. The raw length is chosen (span_lengths) so the inputs are exactly the configured length.
"""
import numpy as np


def _noise_counts(raw_length, noise_density, mean_noise_span_length):
  """(num_noise_tokens, num_noise_spans) as T5's random_spans_noise_mask computes them."""
  noise = min(max(int(round(raw_length * noise_density)), 1), raw_length - 1)
  return noise, max(int(round(noise / mean_noise_span_length)), 1)


def span_lengths(inputs_length, noise_density=0.15, mean_noise_span_length=3.0):
  """(raw_tokens_length, targets_length) for inputs of exactly inputs_length (T5's random_spans_helper rule,
  with the eos counted in both): 512 -> (568, 114), 128 -> (141, 29)."""
  def lengths(raw):
    noise, spans = _noise_counts(raw, noise_density, mean_noise_span_length)
    return raw - noise + spans + 1, noise + spans + 1

  raw = inputs_length
  while lengths(raw + 1)[0] <= inputs_length:
    raw += 1
  _, targets = lengths(raw)
  if noise_density == 0.5 and targets > inputs_length:
    raw, targets = raw - 1, targets - 1
  return raw, targets


def _segment(rng, rows, n, segments):
  """(rows, segments) random positive lengths summing to n: segments - 1 distinct cut points in 1..n-1."""
  cuts = np.sort(np.argsort(rng.random((rows, n - 1)), 1)[:, :segments - 1] + 1, 1)
  edges = np.concatenate([np.zeros((rows, 1), int), cuts, np.full((rows, 1), n)], 1)
  return np.diff(edges, axis=1)


def _compact(values, keep, eos_id, length, field):
  """Row-wise values[keep] (every row keeps the same count) + eos, right-padded with 0 to `length`."""
  out = np.concatenate([values[keep].reshape(len(values), -1), np.full((len(values), 1), eos_id)], 1)
  if out.shape[1] > length:
    raise ValueError(f"corrupt_spans: {field} need {out.shape[1]} tokens > {field}_length={length}")
  return np.pad(out, ((0, 0), (0, length - out.shape[1]))).astype(np.int32)


def corrupt_spans(tokens, *, rng, vocab_size, eos_id, noise_density, mean_span, inputs_length, targets_length):
  """tokens (B, raw) -> dict(input_ids (B, inputs_length), decoder_target_ids (B, targets_length)).

  inputs = non-noise tokens with each noise span replaced by its sentinel, then eos; targets = for each noise
  span its sentinel and tokens, then eos (0-padded). With raw = span_lengths(inputs_length)[0] both are
  exactly full for density 0.15 / span 3.
  """
  tokens = np.asarray(tokens)
  b, raw = tokens.shape
  noise, spans = _noise_counts(raw, noise_density, mean_span)
  lens = np.stack([_segment(rng, b, raw - noise, spans), _segment(rng, b, noise, spans)], 2).reshape(b, 2 * spans)
  span_start = np.zeros((b, raw), int)
  np.put_along_axis(span_start, np.cumsum(lens, 1)[:, :-1], 1, 1)
  span = np.cumsum(span_start, 1)  # 0..2*spans-1: even = non-noise, odd = noise
  is_noise = span % 2 == 1
  first = np.concatenate([np.ones((b, 1), bool), span_start[:, 1:] == 1], 1)
  sentinel = vocab_size - 1 - span // 2  # noise span k and the non-noise span before it share sentinel k
  return dict(
      input_ids=_compact(np.where(is_noise, sentinel, tokens), ~is_noise | first, eos_id, inputs_length, "inputs"),
      decoder_target_ids=_compact(np.where(is_noise, tokens, sentinel), is_noise | first, eos_id, targets_length,
                                  "targets"))

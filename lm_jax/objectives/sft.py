"""Supervised fine-tuning on (prompt, response) pairs (InstructGPT's first step, Ouyang et al. 2022 §3.5): the
token loss on the response only, for decoder (GPT) and encoder-decoder (T5) models.

Data: lm_jax/data/instructions.py ('instruction' records of config.rlhf.files). A decoder: each example is prompt +
response + eos read as next-token prediction; only targets inside the response (and its eos) have weight 1, the
prompt's have 0. Examples are packed into rows in order (a new row when the next one does not fit) with segment ids
and positions restarting per example, so no token attends across examples. An encoder-decoder: the prompt is the
encoder input, the response (+ eos) the decoder target (data.target_len tokens; 0 = seq_len), one example per row.
The loss is the weighted token cross-entropy divided by the number of response tokens in the global batch, exactly
as the causal LM (clm) and span corruption losses with these weights. Metrics: loss, accuracy (per response token),
token_loss.
"""
import numpy as np

from lm_jax import models
from lm_jax.data import instructions
from lm_jax.objectives import clm, span_corruption
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def target_len(config) -> int:
  """An encoder-decoder's decoder length: config.data.target_len, or (0) seq_len."""
  return config.data.target_len or config.data.seq_len


def _encoder_decoder(config) -> bool:
  return models.family(config.model).layout == "encoder_decoder"


def check(config):
  instructions.check(config)
  if config.data.seq_len < 2:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} leaves no room for a prompt and a response token")


def lengths(config):
  if _encoder_decoder(config):
    return Lengths(inputs=config.data.seq_len, targets=target_len(config), scored=target_len(config))
  return Lengths(inputs=config.data.seq_len, targets=0, scored=config.data.seq_len)


def pack_causal(examples, width: int, pad_id: int) -> dict:
  """Decoder rows of width `width` (clm's features) holding the examples (instructions.Example) in order, several per
  row; weights 1 exactly on the targets that are response tokens."""
  placed, row, col = [], 0, 0
  for ex in examples:
    tokens, p = instructions.sequence(ex.prompt, ex.responses[0], width + 1)
    n = len(tokens) - 1
    if col + n > width:
      row, col = row + 1, 0
    placed.append((row, col, tokens, p))
    col += n
  n_rows = row + 1 if placed else 0
  ids, targets = np.full((n_rows, width), pad_id, np.int32), np.full((n_rows, width), pad_id, np.int32)
  segments, positions = np.zeros((n_rows, width), np.int32), np.zeros((n_rows, width), np.int32)
  weights = np.zeros((n_rows, width), np.float32)
  for k, (r, c, tokens, p) in enumerate(placed):
    n = len(tokens) - 1
    ids[r, c:c + n], targets[r, c:c + n] = tokens[:-1], tokens[1:]
    segments[r, c:c + n] = 1 if c == 0 else segments[r, c - 1] + 1
    positions[r, c:c + n] = np.arange(n)
    weights[r, c + p - 1:c + n] = 1.0
  return dict(input_ids=ids, targets=targets, weights=weights, segment_ids=segments, positions=positions)


def encoder_decoder(examples, seq_len: int, target_length: int, pad_id: int, start_id: int) -> dict:
  """Encoder-decoder rows (span corruption's features), one example each: the prompt's last seq_len tokens in, the
  response's first target_length tokens out."""
  n = len(examples)
  ids, dec_targets = np.full((n, seq_len), pad_id, np.int32), np.full((n, target_length), pad_id, np.int32)
  mask, real = np.zeros_like(ids), np.zeros_like(dec_targets)
  for i, ex in enumerate(examples):
    prompt, response = ex.prompt[-seq_len:], ex.responses[0][:target_length]
    ids[i, :len(prompt)], dec_targets[i, :len(response)] = prompt, response
    mask[i, :len(prompt)], real[i, :len(response)] = 1, 1
  dec_inputs = np.concatenate([np.full((n, 1), start_id, np.int32), dec_targets[:, :-1]], 1)
  return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec_inputs, decoder_target_ids=dec_targets,
              decoder_attention_mask=real, weights=real.astype(np.float32))


def row_layout(config, tokenizer):
  seq_len, pad = config.data.seq_len, tokenizer.pad_id
  if _encoder_decoder(config):
    t = target_len(config)
    start = config.model.get("decoder_start_token_id", 0)
    build = lambda examples: encoder_decoder(examples, seq_len, t, pad, start)
    real = lambda ex: min(len(ex.prompt), seq_len) + min(len(ex.responses[0]), t)
  else:
    build = lambda examples: pack_causal(examples, seq_len, pad)
    real = lambda ex: len(instructions.sequence(ex.prompt, ex.responses[0], seq_len + 1)[0]) - 1
  return instructions.layout(config, tokenizer, "instruction", build, real)


def _per_layout(config):
  """The objective whose features and loss this layout's rows share."""
  return span_corruption if _encoder_decoder(config) else clm


def features(config):
  if _encoder_decoder(config):
    length, t = config.data.seq_len, target_len(config)
    feats = {k: ((length,), np.int32) for k in ("input_ids", "attention_mask")}
    feats.update({k: ((t,), np.int32) for k in ("decoder_input_ids", "decoder_target_ids", "decoder_attention_mask")})
    feats["weights"] = ((t,), np.float32)
    return feats
  return clm.features(config)


def denominators(batch):
  """{'tokens': response tokens of the full batch} (both layouts mark them with weights)."""
  return (clm if "segment_ids" in batch else span_corruption).denominators(batch)


def loss(config, params, batch, den, *, rng=None, train=False):
  return _per_layout(config).loss(config, params, batch, den, rng=rng, train=train)


OBJECTIVE = Objective(name="sft", layouts=("decoder", "encoder_decoder"), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss)

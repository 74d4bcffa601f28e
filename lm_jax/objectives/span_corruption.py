"""T5 span corruption for the t5 family: teacher-forced decoder, loss on decoder_target_ids where weights > 0.

Rows are raw chunks of the document stream, of the length T5's rule gives for seq_len (512 -> 568 tokens);
data.corruption.corrupt_spans turns them into encoder inputs (seq_len) and targets (target_len, 512 -> 114),
and decoder_input_ids are the targets shifted right after decoder_start.
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.config_lib import require
from lm_jax.data import corruption, rows
from lm_jax.data.tokenizer import NUM_SENTINELS
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective


def _span_lengths(config):
  """(raw tokens per row, targets) of T5's random_spans_helper rule for config.data.seq_len."""
  d = config.data
  return corruption.span_lengths(d.seq_len, d.noise_density, d.mean_noise_span_length)


def target_len(config) -> int:
  """config.data.target_len, or (0) the length T5's rule gives for seq_len: 512 -> 114."""
  return config.data.target_len or _span_lengths(config)[1]


def check(config):
  m, d = config.model, config.data
  require(0 < d.noise_density < 1, f"config.data.noise_density must be in (0, 1), got {d.noise_density}")
  require(d.mean_noise_span_length >= 1,
           f"config.data.mean_noise_span_length must be >= 1, got {d.mean_noise_span_length}")
  specials = len({m.pad_token_id, m.eos_token_id, m.decoder_start_token_id}) + 1  # + unk
  require(m.vocab_size > NUM_SENTINELS + specials, f"config.model.vocab_size={m.vocab_size} leaves no room for "
           f"{NUM_SENTINELS} sentinels and {specials} special tokens")
  raw, targets = _span_lengths(config)
  require(d.target_len == 0 or d.target_len >= targets, f"config.data.target_len={d.target_len} is "
           f"shorter than the {targets} targets of seq_len={d.seq_len} (raw {raw}); use 0 for auto")


def lengths(config):
  targets = target_len(config)
  return Lengths(inputs=config.data.seq_len, targets=targets, scored=targets)


def row_layout(config, tokenizer):
  del tokenizer
  width = _span_lengths(config)[0]
  return rows.Stream(width=width, drop_remainder=True, build=lambda tokens, docs: {"tokens": tokens.reshape(-1, width)})


def transform(config, tokenizer):
  d, t = config.data, tokenizer
  targets_length = target_len(config)
  start = config.model.get("decoder_start_token_id", 0)

  def apply(batch_rows, rng):
    out = corruption.corrupt_spans(batch_rows["tokens"], rng=rng, vocab_size=t.sentinel_id(0) + 1,
                                   eos_id=t.eos_id, noise_density=d.noise_density,
                                   mean_span=d.mean_noise_span_length, inputs_length=d.seq_len,
                                   targets_length=targets_length)
    targets = out["decoder_target_ids"]
    real = (targets != t.pad_id).astype(np.int32)
    shifted = np.concatenate([np.full((len(targets), 1), start, np.int32), targets[:, :-1]], 1)
    return dict(input_ids=out["input_ids"], attention_mask=(out["input_ids"] != t.pad_id).astype(np.int32),
                decoder_input_ids=shifted.astype(np.int32), decoder_target_ids=targets,
                decoder_attention_mask=real, weights=real.astype(np.float32))
  return apply


def features(config):
  length, targets = config.data.seq_len, target_len(config)
  feats = {k: ((length,), np.int32) for k in ("input_ids", "attention_mask")}
  feats.update({k: ((targets,), np.int32) for k in ("decoder_input_ids", "decoder_target_ids",
                                                    "decoder_attention_mask")})
  feats["weights"] = ((targets,), np.float32)
  return feats


def _weights(batch):
  return jnp.asarray(batch["weights"], jnp.float32) * (jnp.asarray(batch["decoder_attention_mask"]) > 0)


def denominators(batch):
  return {"tokens": jnp.maximum(jnp.sum(_weights(batch)), 1.0)}


def loss(config, params, batch, den, *, rng=None, train=False):
  inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")}
  out = models.apply(config.model, params, inputs, rng=rng, train=train)
  ce = losses.cross_entropy(out["logits"], batch["decoder_target_ids"], _weights(batch), **losses.options(config))
  total = ce["loss"] / den["tokens"]
  return total, dict(loss=total, accuracy=ce["correct"] / den["tokens"], token_loss=ce["nll"] / den["tokens"])


OBJECTIVE = Objective(name="span_corruption", layouts=("encoder_decoder",), check=check, lengths=lengths,
                      rows=row_layout, transform=transform, features=features, denominators=denominators, loss=loss)

"""T5 span corruption for the t5 family: teacher-forced decoder, loss on decoder_target_ids where weights > 0.

The pipeline builds decoder_input_ids = targets shifted right after decoder_start (0); inputs/targets come from
lm_jax.data.corruption.corrupt_spans.
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.data import corruption
from lm_jax.objectives import losses


def target_len(config):
  """config.data.target_len, or (0) the length T5's rule gives for seq_len: 512 -> 114."""
  d = config.data
  return d.target_len or corruption.span_lengths(d.seq_len, d.noise_density, d.mean_noise_span_length)[1]


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


def loss(model_cfg, params, batch, den, *, rng=None, train=False, z_loss=0.0, label_smoothing=0.0):
  inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")}
  out = models.apply(model_cfg, params, inputs, rng=rng, train=train)
  ce = losses.cross_entropy(out["logits"], batch["decoder_target_ids"], _weights(batch), z_loss=z_loss,
                            label_smoothing=label_smoothing)
  total = ce["loss"] / den["tokens"]
  return total, dict(loss=total, accuracy=ce["correct"] / den["tokens"], token_loss=ce["nll"] / den["tokens"])

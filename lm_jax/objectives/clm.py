"""Causal LM for the GPT family: next-token loss over packed rows.

segment_ids (0 = padding) and positions go to the model so no token attends across a document boundary and
each document restarts its positions; weights are zeroed on padding here too, so padding is never counted.
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.objectives import losses


def features(config):
  length = config.data.seq_len
  feats = {k: ((length,), np.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
  feats["weights"] = ((length,), np.float32)
  return feats


def _weights(batch):
  return jnp.asarray(batch["weights"], jnp.float32) * (jnp.asarray(batch["segment_ids"]) > 0)


def denominators(batch):
  return {"tokens": jnp.maximum(jnp.sum(_weights(batch)), 1.0)}


def loss(model_cfg, params, batch, den, *, rng=None, train=False, z_loss=0.0, label_smoothing=0.0):
  inputs = dict(input_ids=batch["input_ids"], attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32),
                segment_ids=batch["segment_ids"], positions=batch["positions"])
  out = models.apply(model_cfg, params, inputs, rng=rng, train=train)
  ce = losses.cross_entropy(out["logits"], batch["targets"], _weights(batch), z_loss=z_loss,
                            label_smoothing=label_smoothing)
  total = ce["loss"] / den["tokens"]
  return total, dict(loss=total, accuracy=ce["correct"] / den["tokens"], token_loss=ce["nll"] / den["tokens"])

"""Masked LM (+ optional next-sentence prediction) for the BERT family.

The model's sparse head scores only the selected positions (mlm_positions), never the whole sequence.
loss = mean MLM NLL over predicted tokens + mean NSP NLL over examples (BERT App. A.2).
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.objectives import losses


def features(config):
  length, preds = config.data.seq_len, config.data.max_predictions_per_seq
  feats = {k: ((length,), np.int32) for k in ("input_ids", "token_type_ids", "attention_mask")}
  feats.update(mlm_positions=((preds,), np.int32), mlm_ids=((preds,), np.int32), mlm_weights=((preds,), np.float32))
  if config.data.nsp:
    feats["nsp_labels"] = ((), np.int32)
  return feats


def denominators(batch):
  den = {"mlm": jnp.maximum(jnp.sum(jnp.asarray(batch["mlm_weights"], jnp.float32)), 1.0)}
  if "nsp_labels" in batch:
    den["nsp"] = jnp.float32(np.shape(batch["nsp_labels"])[0])
  return den


def loss(model_cfg, params, batch, den, *, rng=None, train=False, z_loss=0.0, label_smoothing=0.0):
  inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "mlm_positions")}
  out = models.apply(model_cfg, params, inputs, rng=rng, train=train)
  mlm = losses.cross_entropy(out["logits"], batch["mlm_ids"], batch["mlm_weights"], z_loss=z_loss,
                             label_smoothing=label_smoothing)
  total = mlm["loss"] / den["mlm"]
  metrics = dict(mlm_loss=total, mlm_accuracy=mlm["correct"] / den["mlm"], token_loss=mlm["nll"] / den["mlm"])
  if "nsp_labels" in batch:
    labels = batch["nsp_labels"]
    nsp = losses.cross_entropy(out["nsp_logits"], labels, jnp.ones(labels.shape, jnp.float32))
    metrics.update(nsp_loss=nsp["loss"] / den["nsp"], nsp_accuracy=nsp["correct"] / den["nsp"])
    total = total + metrics["nsp_loss"]
  metrics["loss"] = total
  return total, metrics

"""Causal LM for the GPT family: next-token loss over packed rows.

segment_ids (0 = padding) and positions go to the model so no token attends across a document boundary and
each document restarts its positions; weights are zeroed on padding here too, so padding is never counted.
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.data import packing, rows
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def lengths(config):
  return Lengths(inputs=config.data.seq_len, targets=0, scored=config.data.seq_len)


def row_layout(config, tokenizer):
  """Documents each followed by eos, packed; one token of lookahead gives the last target of a row."""
  seq_len, pad = config.data.seq_len, tokenizer.pad_id
  return rows.Stream(width=seq_len, separator=tokenizer.eos_id, lookahead=1,
                     build=lambda tokens, docs: packing.causal_rows(tokens, docs, seq_len, pad))


def features(config):
  length = config.data.seq_len
  feats = {k: ((length,), np.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
  feats["weights"] = ((length,), np.float32)
  return feats


def _weights(batch):
  return jnp.asarray(batch["weights"], jnp.float32) * (jnp.asarray(batch["segment_ids"]) > 0)


def denominators(batch):
  return {"tokens": jnp.maximum(jnp.sum(_weights(batch)), 1.0)}


def loss(config, params, batch, den, *, rng=None, train=False):
  inputs = dict(input_ids=batch["input_ids"], attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32),
                segment_ids=batch["segment_ids"], positions=batch["positions"])
  out = models.apply(config.model, params, inputs, rng=rng, train=train)
  ce = losses.cross_entropy(out["logits"], batch["targets"], _weights(batch), **losses.options(config))
  total = ce["loss"] / den["tokens"]
  return total, dict(loss=total, accuracy=ce["correct"] / den["tokens"], token_loss=ce["nll"] / den["tokens"])


OBJECTIVE = Objective(name="clm", layouts=("decoder",), check=lambda config: None, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss)

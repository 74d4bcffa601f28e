"""Masked LM (+ optional next-sentence prediction) for the BERT family.

Rows: with data.nsp, [CLS] A [SEP] B [SEP] pairs from document structure (BERT's create_pretraining_data);
without, [CLS] chunk [SEP] rows of the document stream (documents separated by [SEP]). Masking happens on the
host per batch (data.masking). The model's sparse head scores only the selected positions (mlm_positions).
loss = mean MLM NLL over predicted tokens + mean NSP NLL over examples (BERT App. A.2).
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.config_lib import require
from lm_jax.data import masking, nsp, packing, rows
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective


def check(config):
  m, d = config.model, config.data
  require(0 < d.mlm_probability < 1, f"config.data.mlm_probability must be in (0, 1), got {d.mlm_probability}")
  require(1 <= d.max_predictions_per_seq <= d.seq_len, f"config.data.max_predictions_per_seq must be in "
           f"[1, seq_len={d.seq_len}], got {d.max_predictions_per_seq}")
  types = m.get("type_vocab_size", 0)   # a field of the families with token types (BERT's)
  require(not d.nsp or types >= 2, f"config.data.nsp needs config.model.type_vocab_size >= 2, got {types}")


def lengths(config):
  return Lengths(inputs=config.data.seq_len, targets=0, scored=config.data.max_predictions_per_seq)


def row_layout(config, tokenizer):
  t, seq_len = tokenizer, config.data.seq_len
  if config.data.nsp:
    return rows.PerDocument(
        width=seq_len,
        instances=lambda segments, rng, other_doc: nsp.instances(segments, rng=rng, seq_len=seq_len,
                                                                 other_doc=other_doc),
        assemble=lambda pairs: nsp.assemble(pairs, seq_len=seq_len, cls_id=t.cls_id, sep_id=t.sep_id,
                                            pad_id=t.pad_id),
        real_tokens=lambda pair: len(pair[0]) + len(pair[1]) + 3)

  def build(tokens, docs):
    del docs
    chunks = packing.chunk_rows(tokens, seq_len - 2, pad_id=t.pad_id)
    return packing.bert_rows(chunks, cls_id=t.cls_id, sep_id=t.sep_id, pad_id=t.pad_id)
  return rows.Stream(width=seq_len - 2, separator=t.sep_id, build=build)


def transform(config, tokenizer):
  """Selects and masks positions of each row (80% [MASK] / 10% random / 10% kept)."""
  d, t = config.data, tokenizer

  def apply(batch_rows, rng):
    ids = batch_rows["input_ids"]
    starts = t.word_starts(ids) if d.whole_word_mask else None
    masked = masking.mask_tokens(ids, rng=rng, vocab_size=t.vocab_size, mask_id=t.mask_id,
                                 special_ids=t.special_ids, rate=d.mlm_probability,
                                 max_predictions=d.max_predictions_per_seq, word_starts=starts)
    return {**batch_rows, **masked}
  return apply


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


def loss(config, params, batch, den, *, rng=None, train=False):
  inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask", "mlm_positions")}
  out = models.apply(config.model, params, inputs, rng=rng, train=train)
  mlm = losses.cross_entropy(out["logits"], batch["mlm_ids"], batch["mlm_weights"], **losses.options(config))
  total = mlm["loss"] / den["mlm"]
  metrics = dict(mlm_loss=total, mlm_accuracy=mlm["correct"] / den["mlm"], token_loss=mlm["nll"] / den["mlm"])
  if "nsp_labels" in batch:
    labels = batch["nsp_labels"]
    nsp_ce = losses.cross_entropy(out["nsp_logits"], labels, jnp.ones(labels.shape, jnp.float32))
    metrics.update(nsp_loss=nsp_ce["loss"] / den["nsp"], nsp_accuracy=nsp_ce["correct"] / den["nsp"])
    total = total + metrics["nsp_loss"]
  metrics["loss"] = total
  return total, metrics


OBJECTIVE = Objective(name="mlm", layouts=("encoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=transform, features=features, denominators=denominators, loss=loss,
                      metric_denominators={"nsp_loss": "nsp", "nsp_accuracy": "nsp"})

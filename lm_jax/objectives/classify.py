"""Sequence classification or regression for the BERT family (paper §4.1, google-research/bert run_classifier.py).

Rows: one labelled task example each (lm_jax/data/tasks.py), never packed: [CLS] a [SEP] or [CLS] a [SEP] b [SEP]
with token types 0 / 1, the longer text truncated first. The model (model.num_labels > 0) classifies the pooled
[CLS] state. loss = mean cross-entropy over the labelled examples of the batch, or with num_labels = 1 the mean
squared error (STS-B). Eval metrics: accuracy (or mse), and from the per-example predictions of the whole eval set
F1 / Matthews correlation (or Pearson / Spearman), see lm_jax.evals.evaluate.prediction_metrics.
"""
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.data import rows, tasks
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def _num_labels(config) -> int:
  return config.model.get("num_labels", 0)


def _specials(config) -> int:
  """[CLS] plus one [SEP] per text."""
  return 1 + len(config.task.text_fields)


def check(config):
  n = _num_labels(config)
  if n < 1:
    raise ValueError(f"config.objective='classify' needs config.model.num_labels >= 1 (classes; 1 = regression), "
                     f"got {n}")
  tasks.check(config)
  need = 2 * len(config.task.text_fields) + 1
  if config.data.seq_len < need:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} leaves no room for the text: [CLS] and [SEP]s "
                     f"need at least {need}")


def lengths(config):
  return Lengths(inputs=config.data.seq_len, targets=0, scored=0)


def assemble_rows(examples, n, *, seq_len, specials, tokenizer, regression) -> dict:
  """n rows, the first len(examples) of them the examples (data.tasks.Example); the rest padding (weight 0,
  index -1). specials: [CLS] plus one [SEP] per text."""
  t = tokenizer
  ids = np.full((n, seq_len), t.pad_id, np.int32)
  types, mask = np.zeros_like(ids), np.zeros_like(ids)
  labels = np.zeros(n, np.float32 if regression else np.int32)
  weights, index = np.zeros(n, np.float32), np.full(n, -1, np.int32)
  for r, ex in enumerate(examples):
    ids[r, 0] = t.cls_id
    pos = 1
    for k, (segment, m) in enumerate(zip(ex.segments, tasks.truncate(tuple(map(len, ex.segments)),
                                                                       seq_len - specials))):
      ids[r, pos:pos + m], ids[r, pos + m] = segment[:m], t.sep_id
      types[r, pos:pos + m + 1] = k
      pos += m + 1
    mask[r, :pos] = 1
    index[r] = ex.index
    if ex.label is not None:
      labels[r], weights[r] = ex.label, 1.0
  return dict(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels, weights=weights, index=index)


def row_layout(config, tokenizer):
  seq_len, specials = config.data.seq_len, _specials(config)
  build = lambda examples, n: assemble_rows(examples, n, seq_len=seq_len, specials=specials, tokenizer=tokenizer,
                                    regression=_num_labels(config) == 1)
  return rows.PerDocument(
      width=seq_len, instances=lambda example, rng, other_doc: [example],
      assemble=lambda examples: build(examples, len(examples)),
      real_tokens=lambda ex: sum(tasks.truncate(tuple(map(len, ex.segments)), seq_len - specials)) + specials,
      corpus=lambda split: tasks.examples(config, split, tokenizer), padding=lambda n: build([], n))


def features(config):
  length = config.data.seq_len
  feats = {k: ((length,), np.int32) for k in ("input_ids", "token_type_ids", "attention_mask")}
  feats.update(labels=((), np.float32 if _num_labels(config) == 1 else np.int32), weights=((), np.float32),
               index=((), np.int32))
  return feats


def denominators(batch):
  return {"examples": jnp.maximum(jnp.sum(jnp.asarray(batch["weights"], jnp.float32)), 1.0)}


def _logits(config, params, batch, rng, train):
  inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
  return models.apply(config.model, params, inputs, rng=rng, train=train)["logits"]


def loss(config, params, batch, den, *, rng=None, train=False):
  logits, weights = _logits(config, params, batch, rng, train), jnp.asarray(batch["weights"], jnp.float32)
  if _num_labels(config) == 1:
    error = jnp.where(weights != 0, jnp.square(logits[:, 0] - batch["labels"]) * weights, 0.0)
    total = jnp.sum(error) / den["examples"]
    return total, dict(loss=total, mse=total)
  ce = losses.cross_entropy(logits, batch["labels"], weights, **losses.options(config))
  total = ce["loss"] / den["examples"]
  return total, dict(loss=total, accuracy=ce["correct"] / den["examples"])


def predict(config, params, batch):
  logits = _logits(config, params, batch, None, False)
  prediction = logits[:, 0] if _num_labels(config) == 1 else jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return dict(prediction=prediction, label=batch["labels"], weight=batch["weights"], index=batch["index"])


OBJECTIVE = Objective(name="classify", layouts=("encoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss, predict=predict)

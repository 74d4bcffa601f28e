"""Fine-tuning GPT-1 on a task (Radford et al. 2018 §3.2-3.3, openai/finetune-transformer-lm train.py).

Input transformations (config.task.format), with s / $ / e the start, delimiter and extract tokens, appended to the
pre-trained vocabulary as its last three ids (added_tokens: init_from.resolve enlarges model.vocab_size, the new
embedding rows keep the seeded init; the tokenizer never produces them):
  classify         [s; text; e]
  entailment       [s; premise; $; hypothesis; e]
  similarity       [s; a; $; b; e] and [s; b; $; a; e]: the two extract-token states are summed
  multiple_choice  [s; context; $; answer_k; e] for each of the K answers (task.choice_fields), one score each
                   (model.num_labels = 1), a softmax over the answers
Each row is truncated to data.seq_len (the longer text first), padding masked. The model's 'classifier' (a linear
layer, model.num_labels outputs) reads the final hidden state at the extract token after dropout (model.dropout_rate,
the paper's 0.1 for both). loss = CE(classifier) + task.lm_coef * LM loss, averaged over the labelled examples; the
LM loss is the mean next-token loss over the real tokens of each row (the start token is no target, the extract
token is), averaged over the example's rows, as in the paper's code; lm_coef 0.5 in the paper. Eval metrics:
accuracy, clf_loss, lm_loss, and F1 / Matthews over the whole eval set (predict). Walk-through: docs/finetune.md.
"""
import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.data import rows, tasks
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective, no_transform

ADDED_TOKENS = 3        # start, delimiter, extract
TEXTS = {"classify": 1, "entailment": 2, "similarity": 2, "multiple_choice": 1}   # task.text_fields per format


def _format(config) -> str:
  return config.task.format


def rows_per_example(config) -> int:
  """Model rows per example: 2 for similarity (both orders), K for multiple choice, else 1."""
  fmt = _format(config)
  return len(config.task.choice_fields) if fmt == "multiple_choice" else 2 if fmt == "similarity" else 1


def special_ids(config) -> tuple:
  """(start, delimiter, extract): the last three ids of the (enlarged) vocabulary."""
  v = config.model.vocab_size
  return v - 3, v - 2, v - 1


def check(config):
  t, m, fmt = config.task, config.model, _format(config)
  if fmt not in TEXTS:
    raise ValueError(f"config.task.format={fmt!r} unknown; use one of {', '.join(TEXTS)}")
  n, want = m.get("num_labels", 0), "== 1 (one score per answer)" if fmt == "multiple_choice" else ">= 2 (classes)"
  if not (n == 1 if fmt == "multiple_choice" else n >= 2):
    raise ValueError(f"config.objective='gpt_classify' with task.format={fmt!r} needs config.model.num_labels {want}, "
                     f"got {n}")
  tasks.check(config)
  if len(t.text_fields) != TEXTS[fmt]:
    raise ValueError(f"config.task.text_fields={tuple(t.text_fields)!r}: task.format={fmt!r} needs {TEXTS[fmt]} "
                     f"field(s)")
  if bool(t.choice_fields) != (fmt == "multiple_choice"):
    raise ValueError(f"config.task.choice_fields={tuple(t.choice_fields)!r}: the answer fields are needed with, and "
                     f"only with, task.format='multiple_choice' (got {fmt!r})")
  if not t.lm_coef >= 0:
    raise ValueError(f"config.task.lm_coef must be >= 0 (0 = no auxiliary LM loss), got {t.lm_coef}")
  if m.get("added_tokens", 0) != ADDED_TOKENS:
    raise ValueError("config.objective='gpt_classify' appends its start / delimiter / extract tokens to a "
                     "pre-trained vocabulary: set config.init_from (an lm_jax GPT workdir or a Hugging Face directory)")
  need = 2 * (2 if fmt == "multiple_choice" else TEXTS[fmt]) + 1
  if config.data.seq_len < need:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} leaves no room for the text: the special tokens "
                     f"need at least {need}")


def lengths(config):
  # The rows of one example are counted as one sequence (attention FLOPs slightly overcounted for R > 1).
  width = rows_per_example(config) * config.data.seq_len
  return Lengths(inputs=width, targets=0, scored=width)


# ------------------------------------------------------------------------------------------------------- rows
def _fit(texts, seq_len: int) -> list:
  """texts truncated (the longer first) so that they fit seq_len with their len(texts) + 1 special tokens."""
  kept = tasks.truncate(tuple(map(len, texts)), seq_len - len(texts) - 1)
  return [t[:k] for t, k in zip(texts, kept)]


def _row(texts, specials) -> np.ndarray:
  start, delimiter, extract = specials
  pieces = [[start]]
  for k, text in enumerate(texts):
    pieces += [[delimiter]] * (k > 0) + [text]
  return np.concatenate(pieces + [[extract]]).astype(np.int32)


def input_transformation(segments, fmt: str, seq_len: int, specials) -> list:
  """The unpadded model rows (int32 token arrays) of one example's segments under input transformation `fmt`."""
  if fmt == "multiple_choice":
    context, *answers = segments
    return [_row(_fit((context, answer), seq_len), specials) for answer in answers]
  texts = _fit(segments, seq_len)
  return [_row(order, specials) for order in ([texts, texts[::-1]] if fmt == "similarity" else [texts])]


def assemble_rows(examples, n, *, fmt, seq_len, rows, specials, pad_id) -> dict:
  """n examples' rows, the first len(examples) of them the examples (data.tasks.Example); the rest padding
  (weight 0, index -1). input_ids / attention_mask (n, rows, seq_len), extract (n, rows): the extract positions."""
  ids = np.full((n, rows, seq_len), pad_id, np.int32)
  mask, extract = np.zeros_like(ids), np.zeros((n, rows), np.int32)
  labels, weights, index = np.zeros(n, np.int32), np.zeros(n, np.float32), np.full(n, -1, np.int32)
  for r, ex in enumerate(examples):
    for k, row in enumerate(input_transformation(ex.segments, fmt, seq_len, specials)):
      ids[r, k, :len(row)], mask[r, k, :len(row)], extract[r, k] = row, 1, len(row) - 1
    index[r] = ex.index
    if ex.label is not None:
      labels[r], weights[r] = ex.label, 1.0
  return dict(input_ids=ids, attention_mask=mask, extract=extract, labels=labels, weights=weights, index=index)


def row_layout(config, tokenizer):
  fmt, seq_len, n_rows, specials = _format(config), config.data.seq_len, rows_per_example(config), special_ids(config)
  if tokenizer.vocab_size > specials[0]:
    raise ValueError(f"config.model.vocab_size={config.model.vocab_size} has no room for the start / delimiter / "
                     f"extract tokens after the tokenizer's {tokenizer.vocab_size} ids")
  build = lambda examples, n: assemble_rows(examples, n, fmt=fmt, seq_len=seq_len, rows=n_rows, specials=specials,
                                            pad_id=tokenizer.pad_id)
  return rows.PerDocument(
      width=n_rows * seq_len, instances=lambda example, rng, other_doc: [example],
      assemble=lambda examples: build(examples, len(examples)),
      real_tokens=lambda ex: sum(map(len, input_transformation(ex.segments, fmt, seq_len, specials))),
      corpus=lambda split: tasks.examples(config, split, tokenizer), padding=lambda n: build([], n))


def features(config):
  r, length = rows_per_example(config), config.data.seq_len
  return dict(input_ids=((r, length), np.int32), attention_mask=((r, length), np.int32), extract=((r,), np.int32),
              labels=((), np.int32), weights=((), np.float32), index=((), np.int32))


def denominators(batch):
  return {"examples": jnp.maximum(jnp.sum(jnp.asarray(batch["weights"], jnp.float32)), 1.0)}


# ------------------------------------------------------------------------------------------------------- loss
def _forward(config, params, batch, rng, train):
  """(task logits (B, classes or answers), LM logits (B * rows, T, V)): the classifier on the extract states."""
  ids = batch["input_ids"]
  b, r, t = ids.shape
  model_rng, head_rng = jax.random.split(rng) if train else (None, None)
  inputs = dict(input_ids=ids.reshape(b * r, t), attention_mask=batch["attention_mask"].reshape(b * r, t))
  out = models.apply(config.model, params, inputs, rng=model_rng, train=train)
  at = batch["extract"].reshape(b * r, 1, 1)
  h = jnp.take_along_axis(out["hidden"], at, axis=1).reshape(b, r, -1).astype(jnp.float32)
  if _format(config) == "similarity":
    h = h.sum(axis=1, keepdims=True)
  rate = config.model.dropout_rate
  if train and rate:
    h = jnp.where(jax.random.bernoulli(head_rng, 1.0 - rate, h.shape), h / (1.0 - rate), 0.0)
  head = params["classifier"]
  scores = h @ head["kernel"].astype(jnp.float32) + head["bias"].astype(jnp.float32)   # (B, rows or 1, num_labels)
  logits = scores[..., 0] if _format(config) == "multiple_choice" else scores[:, 0]
  return logits, out["logits"]


def loss(config, params, batch, den, *, rng=None, train=False):
  logits, lm_logits = _forward(config, params, batch, rng, train)
  weights = jnp.asarray(batch["weights"], jnp.float32)
  clf = losses.cross_entropy(logits, batch["labels"], weights, **losses.options(config))
  ids, mask = batch["input_ids"], jnp.asarray(batch["attention_mask"], jnp.float32)
  b, r, t = ids.shape
  targets, real = ids.reshape(b * r, t)[:, 1:], mask.reshape(b * r, t)[:, 1:]
  per_row = real / jnp.maximum(real.sum(-1, keepdims=True), 1.0) * jnp.repeat(weights, r)[:, None] / r
  lm = losses.cross_entropy(lm_logits[:, :-1], targets, per_row, **losses.options(config))
  total = (clf["loss"] + config.task.lm_coef * lm["loss"]) / den["examples"]
  return total, dict(loss=total, accuracy=clf["correct"] / den["examples"], clf_loss=clf["loss"] / den["examples"],
                     lm_loss=lm["loss"] / den["examples"])


def probabilities(config, params, batch):
  """(B, classes or answers) softmax of the task logits, no dropout: over the K answers for multiple choice."""
  return jax.nn.softmax(_forward(config, params, batch, None, False)[0], axis=-1)


def predict(config, params, batch):
  logits = _forward(config, params, batch, None, False)[0]
  return dict(prediction=jnp.argmax(logits, axis=-1).astype(jnp.int32), label=batch["labels"],
              weight=batch["weights"], index=batch["index"])


OBJECTIVE = Objective(name="gpt_classify", layouts=("decoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss,
                      predict=predict, added_tokens=ADDED_TOKENS)

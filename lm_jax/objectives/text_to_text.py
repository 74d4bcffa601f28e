"""T5 text-to-text fine-tuning for the t5 family (Raffel et al. 2020 §2.4 and Appendix D; the official code's
t5/data/preprocessors.py glue and stsb): every task is text in, text out.

Rows: one task example each (lm_jax/data/tasks.py), never packed. The encoder reads "<prefix> <name1>: <text1>"
or "<prefix> <name1>: <text1> <name2>: <text2>" (task.prefix; task.field_names, or text_fields; T5 writes a GLUE
pair's fields in sorted order: "mnli hypothesis: ... premise: ...") truncated to data.seq_len - 1 tokens + EOS. The
decoder target is the label as text + EOS, at most data.target_len tokens: its word (task.label_names, e.g.
negative / positive); for regression (model.num_labels = 1, STS-B) the number rounded to a multiple of 0.2 ("3.8");
with model.num_labels = 0 the label text as written (free-form). loss = token cross-entropy of the teacher-forced
target, as span_corruption.

Metrics: loss, token_loss, token_accuracy, and exact_match: the share of examples whose every target token is the
argmax, i.e. greedy decoding writes exactly the target. With label words (for regression: the 26 values 0.0 .. 5.0
of STS-B's scale) the eval also predicts the candidate of the highest log-probability (T5's rank classification):
accuracy, and over the eval set F1 / Matthews (Pearson / Spearman) via lm_jax.evals.evaluate.prediction_metrics;
--mode=predict writes the label words. Free-form targets get no prediction in the eval step: generate_texts decodes
them greedily (lm_jax.decoding.generate) and scores exact string match; --mode=predict writes those texts.
"""
import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.config_lib import require
from lm_jax.data import records, rows, tasks
from lm_jax.models import layers
from lm_jax.objectives import losses
from lm_jax.objectives.registry import Lengths, Objective, no_transform

STSB_VALUES = tuple(f"{v / 5:.1f}" for v in range(26))   # T5's STS-B targets: 0.0, 0.2, ..., 5.0
_DECODER_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def _num_labels(config) -> int:
  return config.model.get("num_labels", 0)


def candidates(config) -> tuple:
  """The target texts a prediction chooses among: the label words, STSB_VALUES for regression, () for free-form."""
  return STSB_VALUES if _num_labels(config) == 1 else tuple(config.task.label_names)


def input_text(config, texts) -> str:
  """The encoder's text of one record: 'sst2 sentence: ...', 'mnli hypothesis: ... premise: ...'."""
  t = config.task
  names = tuple(t.field_names) or tuple(t.text_fields)
  return " ".join(([t.prefix] if t.prefix else []) + [f"{name}: {text}" for name, text in zip(names, texts)])


def target_text(config, label) -> str:
  """The decoder's text of a label: its word, the regression target rounded to 0.2 as T5 writes it, or the text."""
  n = _num_labels(config)
  if n == 1:   # round() halves to even, as tf.round in T5's stsb preprocessor
    return f"{round(label * 5) / 5:.1f}"
  return config.task.label_names[label] if n else label


def check(config):
  n, t, d = _num_labels(config), config.task, config.data
  tasks.check(config)
  require(n <= 1 or t.label_names, f"config.objective='text_to_text' with config.model.num_labels={n} needs "
           "config.task.label_names (the words the decoder writes for the classes)")
  require(not t.field_names or len(t.field_names) == len(t.text_fields), f"config.task.field_names="
           f"{tuple(t.field_names)!r} must name each of config.task.text_fields={tuple(t.text_fields)!r}")
  require(d.seq_len >= 2, f"config.data.seq_len={d.seq_len} leaves no room for the input: text + EOS")
  require(d.target_len >= 2, f"config.data.target_len must be >= 2 for text_to_text (target tokens + EOS), "
           f"got {d.target_len}")


def lengths(config):
  return Lengths(inputs=config.data.seq_len, targets=config.data.target_len, scored=config.data.target_len)


def text_records(config, split: str) -> records.Records:
  """The records of `split` with texts (input text, target text) (only the input when unlabelled)."""
  return tasks.records(config, split).map(lambda rec: _text_record(config, rec))


def _text_record(config, rec: tasks.Record):
  if not all(text.strip() for text in rec.texts):
    return records.Bad("empty", "a blank text")
  target = () if rec.label is None else (target_text(config, rec.label),)
  return tasks.Record((input_text(config, rec.texts), *target), rec.label)


def choice_width(config) -> int:
  """Tokens per candidate row: an upper bound of its tokens + EOS known without the tokenizer (a token covers at
  least one UTF-8 byte, a word start at most one more), at most data.target_len."""
  return min(config.data.target_len, max(len(c.encode("utf-8")) for c in candidates(config)) + 2)


def choice_ids(config, tokenizer) -> np.ndarray | None:
  """(candidates, choice_width) int32: each candidate's tokens + EOS, padded; None for free-form targets."""
  texts = candidates(config)
  if not texts:
    return None
  ids = np.full((len(texts), choice_width(config)), tokenizer.pad_id, np.int32)
  for k, (text, tokens) in enumerate(zip(texts, tokenizer.encode_batch(list(texts)))):
    require(len(tokens) < ids.shape[1], f"config.task.label_names: {text!r} is {len(tokens)} tokens + EOS, more "
             f"than config.data.target_len={config.data.target_len}")
    ids[k, :len(tokens)], ids[k, len(tokens)] = tokens, tokenizer.eos_id
  return ids


def assemble_rows(examples, n, *, seq_len, target_len, tokenizer, start_id, choices=None, regression=False) -> dict:
  """n rows, the first len(examples) of them the examples (data.tasks.Example with segments (input, target)); the
  rest padding (weight 0, index -1). choices: choice_ids, repeated in every row."""
  t = tokenizer
  ids, targets = np.full((n, seq_len), t.pad_id, np.int32), np.full((n, target_len), t.pad_id, np.int32)
  labels = np.zeros(n, np.float32 if regression else np.int32)
  label_weights, index = np.zeros(n, np.float32), np.full(n, -1, np.int32)
  for r, ex in enumerate(examples):
    source = ex.segments[0][:seq_len - 1]
    ids[r, :len(source)], ids[r, len(source)] = source, t.eos_id
    index[r] = ex.index
    if ex.label is not None:
      target = ex.segments[1][:target_len - 1]
      targets[r, :len(target)], targets[r, len(target)] = target, t.eos_id
      labels[r] = 0 if isinstance(ex.label, str) else ex.label
      label_weights[r] = 1.0
  real = (targets != t.pad_id).astype(np.int32)
  shifted = np.concatenate([np.full((n, 1), start_id, np.int32), targets[:, :-1]], 1)
  out = dict(input_ids=ids, attention_mask=(ids != t.pad_id).astype(np.int32), decoder_input_ids=shifted,
             decoder_target_ids=targets, decoder_attention_mask=real, weights=real.astype(np.float32), labels=labels,
             label_weights=label_weights, index=index)
  if choices is not None:
    out["choice_ids"] = np.repeat(choices[None], n, axis=0)
  return out


def row_layout(config, tokenizer):
  seq_len = config.data.seq_len
  choices = choice_ids(config, tokenizer)
  build = lambda examples, n: assemble_rows(
      examples, n, seq_len=seq_len, target_len=config.data.target_len, tokenizer=tokenizer,
      start_id=config.model.decoder_start_token_id, choices=choices, regression=_num_labels(config) == 1)
  return rows.PerDocument(
      width=seq_len, instances=lambda example, rng, other_doc: [example],
      assemble=lambda examples: build(examples, len(examples)),
      real_tokens=lambda ex: min(len(ex.segments[0]), seq_len - 1) + 1,
      corpus=lambda split: tasks.examples(config, split, tokenizer, text_records(config, split)),
      padding=lambda n: build([], n))


def features(config):
  length, targets = config.data.seq_len, config.data.target_len
  feats = {k: ((length,), np.int32) for k in ("input_ids", "attention_mask")}
  feats.update({k: ((targets,), np.int32) for k in ("decoder_input_ids", "decoder_target_ids",
                                                    "decoder_attention_mask")})
  feats.update(weights=((targets,), np.float32), labels=((), np.float32 if _num_labels(config) == 1 else np.int32),
               label_weights=((), np.float32), index=((), np.int32))
  if candidates(config):
    feats["choice_ids"] = ((len(candidates(config)), choice_width(config)), np.int32)
  return feats


def _weights(batch):
  return jnp.asarray(batch["weights"], jnp.float32) * (jnp.asarray(batch["decoder_attention_mask"]) > 0)


def denominators(batch):
  return {"tokens": jnp.maximum(jnp.sum(_weights(batch)), 1.0),
          "examples": jnp.maximum(jnp.sum(jnp.asarray(batch["label_weights"], jnp.float32)), 1.0)}


def choice_logprobs(config, params, batch):
  """(B, candidates) float32: log P(candidate | input) summed over its tokens + EOS; the encoder runs once."""
  cfg = layers.frozen(config.model)
  model = models.family(cfg).Model(cfg)
  mask, choices = batch["attention_mask"], jnp.asarray(batch["choice_ids"])
  encoded = model.apply({"params": params}, batch["input_ids"], mask, method=type(model).encode)
  b, k, w = choices.shape
  targets = choices.reshape(b * k, w)
  shifted = jnp.concatenate([jnp.full((b * k, 1), cfg.decoder_start_token_id, targets.dtype), targets[:, :-1]], 1)
  real = targets != cfg.pad_token_id
  logits, _, _ = model.apply({"params": params}, shifted, real, jnp.repeat(encoded, k, axis=0),
                             jnp.repeat(mask, k, axis=0), method=type(model).decode)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(logits, axis=-1)
  return jnp.sum(jnp.where(real, picked, 0.0), axis=1).reshape(b, k)


def _label_choice(config, batch):
  """The candidate number of each row's label (regression: its value rounded to 0.2)."""
  if _num_labels(config) == 1:
    return jnp.clip(jnp.round(batch["labels"] * 5), 0, len(STSB_VALUES) - 1).astype(jnp.int32)
  return batch["labels"]


def loss(config, params, batch, den, *, rng=None, train=False):
  out = models.apply(config.model, params, {k: batch[k] for k in _DECODER_KEYS}, rng=rng, train=train)
  targets, weights = batch["decoder_target_ids"], _weights(batch)
  ce = losses.cross_entropy(out["logits"], targets, weights, **losses.options(config))
  wrong = jnp.sum((jnp.argmax(out["logits"], axis=-1) != targets) & (weights > 0), axis=1)
  example_weights = jnp.asarray(batch["label_weights"], jnp.float32)
  total = ce["loss"] / den["tokens"]
  metrics = dict(loss=total, token_loss=ce["nll"] / den["tokens"], token_accuracy=ce["correct"] / den["tokens"],
                 exact_match=jnp.sum(jnp.where(wrong == 0, example_weights, 0.0)) / den["examples"])
  if not train and candidates(config):
    chosen = jnp.argmax(choice_logprobs(config, params, batch), axis=-1)
    right = chosen == _label_choice(config, batch)
    metrics["accuracy"] = jnp.sum(jnp.where(right, example_weights, 0.0)) / den["examples"]
  return total, metrics


def predict(config, params, batch):
  """The candidate of the highest log-probability (its class number, or its value for regression); free-form
  targets: -1 with weight 0 (generate_texts decodes them)."""
  index = batch["index"]
  if not candidates(config):
    return dict(prediction=jnp.full(index.shape, -1, jnp.int32), label=jnp.full(index.shape, -1, jnp.int32),
                weight=jnp.zeros(index.shape, jnp.float32), index=index)
  best = jnp.argmax(choice_logprobs(config, params, batch), axis=-1)
  values = jnp.asarray([float(v) for v in STSB_VALUES], jnp.float32)
  prediction = values[best] if _num_labels(config) == 1 else best.astype(jnp.int32)
  return dict(prediction=prediction, label=batch["labels"], weight=batch["label_weights"], index=index)


def generate_texts(config, params, tokenizer, split: str, generate, *, batch_size: int = 32) -> dict:
  """Greedy decoding with `generate` (lm_jax.decoding.generate, handed in by the caller: an objective is a loss and
  never runs a decoder itself), at most data.target_len tokens, of every usable example of `split` -> {index,
  prediction (texts), target (texts; None when unlabelled), exact_match (the share of labelled examples whose decoded
  text equals the target text, T5's exact match)}. Under the run's mesh, like generate."""
  recs = text_records(config, split)
  found = [(i, rec) for i, rec in enumerate(recs) if not isinstance(rec, records.Bad)]
  if not found:
    raise ValueError(f"{recs.path}: no usable examples")
  eos, limit = tokenizer.eos_id, config.data.seq_len - 1
  prompts = [p[:limit] + [eos] for p in tokenizer.encode_batch([rec.texts[0] for _, rec in found])]
  outputs = []
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    chunk += [chunk[0]] * (batch_size - len(chunk))   # one shape: no recompilation for the last batch
    outputs += generate(config.model, params, chunk, max_new_tokens=config.data.target_len, eos_id=eos,
                                 pad_id=tokenizer.pad_id)[:len(prompts) - start]
  texts = [tokenizer.decode(out[:-1] if out and out[-1] == eos else out) for out in outputs]
  targets = [rec.texts[1] if len(rec.texts) > 1 else None for _, rec in found]
  scored = [p == t for p, t in zip(texts, targets) if t is not None]
  return dict(index=[i for i, _ in found], prediction=texts, target=targets,
              exact_match=float(np.mean(scored)) if scored else float("nan"))


def predict_texts(config, params, tokenizer, split: str, generate) -> dict | None:
  """--mode=predict of free-form targets: generate_texts; None with label words (the eval step predicts those)."""
  return None if candidates(config) else generate_texts(config, params, tokenizer, split, generate)


OBJECTIVE = Objective(name="text_to_text", layouts=("encoder_decoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss, predict=predict,
                      predict_texts=predict_texts,
                      metric_denominators={"loss": "tokens", "token_loss": "tokens", "token_accuracy": "tokens",
                                           "exact_match": "examples", "accuracy": "examples"})

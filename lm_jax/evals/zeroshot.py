"""GPT-1's zero-shot heuristics (Radford et al. 2018 §5, "Zero-shot Behaviors"): a pre-trained language model
solves a task without any training, through the log-probabilities of lm_jax.decoding.score.

- sentiment: the cue word (" very") is appended to each text; the prediction is the label word whose probability
  as the next word is the highest (config.task.label_names in class order; default negative, positive).
- choice (multiple choice: RACE, Story Cloze): the answer with the highest average log-probability per token given
  the context. config.task.text_fields = (context, answer_0, ..., answer_K-1); the label is the correct answer's
  number 0..K-1 (or its name in config.task.label_names).
- acceptability (CoLA): a sentence's average log-probability per token; above the threshold = acceptable (class
  1). The threshold is a fixed one (threshold) or the one of best Matthews correlation on another split
  (threshold_split). The best threshold on the eval split itself is reported too, as `oracle_*`: fitted on the
  examples it is scored on, an upper bound rather than a zero-shot result.

Examples come from config.task as fine-tuning data do (lm_jax/data/tasks.py), from split config.data.eval_split;
labels are as config.task.label_names writes them or class numbers. Every text is read as the start of a document,
after the tokenizer's eos (which lm_jax appends to every training document); answers and label words are tokenized
on their own with a leading space, as a word of running text. A context too long for model.max_positions loses its
first tokens.
"""
import dataclasses

import jax
import numpy as np
from flax import linen as nn

from lm_jax import config_lib, decoding, init_from, models
from lm_jax.data import tasks
from lm_jax.evals import run_eval

HEURISTICS = ("sentiment", "choice", "acceptability")
SENTIMENT_WORDS = ("negative", "positive")   # class 0, class 1 (SST-2)


@dataclasses.dataclass(frozen=True)
class Split:
  """The usable labelled records of a split: texts (one tuple of strings per example), labels (N,) int."""
  name: str
  texts: list
  labels: np.ndarray
  skipped: int


# ------------------------------------------------------------------------------------------------- scores
def _fit(context: list, continuation: list, limit: int) -> tuple[list, list]:
  """The pair cut to `limit` tokens in all: the context loses its first tokens (one stays), then the continuation
  its last ones."""
  continuation = continuation[:limit - 1]
  return context[max(0, len(context) + len(continuation) - limit):], continuation


def _logprobs(model_cfg, params, pairs, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(log P(continuation | context) summed, continuation lengths) of (context ids, continuation ids) pairs."""
  pairs = [_fit(c, x, model_cfg.max_positions + 1) for c, x in pairs]
  logprob, _ = decoding.score(model_cfg, params, [c for c, _ in pairs], [x for _, x in pairs], batch_size=batch_size)
  return logprob, np.array([len(x) for _, x in pairs])


def _documents(tokenizer, texts) -> list:
  """Ids of each text as the start of a document."""
  return [[tokenizer.eos_id] + ids for ids in tokenizer.encode_batch([t.strip() for t in texts])]


def _words(tokenizer, words, what: str) -> list:
  """Ids of each word after a space; one-line error for a word without tokens."""
  ids = tokenizer.encode_batch([" " + w.strip() for w in words])
  for w, x in zip(words, ids):
    if not x:
      raise ValueError(f"{what}: {w!r} has no tokens")
  return ids


def sentiment_logprobs(model_cfg, params, tokenizer, texts, words=SENTIMENT_WORDS, *, cue: str = "very",
                       batch_size: int = 32) -> np.ndarray:
  """log P(word | text + ' ' + cue) of each label word as the next word, (len(texts), len(words))."""
  contexts = _documents(tokenizer, [f"{t.strip()} {cue}" for t in texts])
  options = _words(tokenizer, words, "config.task.label_names")
  logprob, _ = _logprobs(model_cfg, params, [(c, w) for c in contexts for w in options], batch_size)
  return logprob.reshape(len(texts), len(words))


def choice_logprobs(model_cfg, params, tokenizer, contexts, answers, *, batch_size: int = 32) -> np.ndarray:
  """Average log-probability per token of each answer given its context, (len(contexts), K); answers: K strings
  per context."""
  k = len(answers[0])
  ctx = _documents(tokenizer, contexts)
  ans = _words(tokenizer, [a for row in answers for a in row], "an answer")
  logprob, lengths = _logprobs(model_cfg, params, [(ctx[i // k], a) for i, a in enumerate(ans)], batch_size)
  return (logprob / lengths).reshape(len(contexts), k)


def sentence_logprobs(model_cfg, params, tokenizer, texts, *, batch_size: int = 32) -> np.ndarray:
  """Average log-probability per token of each text from the start of a document, (len(texts),)."""
  docs = _documents(tokenizer, texts)
  logprob, lengths = _logprobs(model_cfg, params, [(d[:1], d[1:]) for d in docs], batch_size)
  return logprob / lengths


# --------------------------------------------------------------------------------------------- thresholds
def threshold_metrics(scores, labels, threshold: float) -> dict:
  """Accuracy and Matthews correlation of 'acceptable (1) = score > threshold'."""
  from sklearn import metrics
  pred = (np.asarray(scores) > threshold).astype(int)
  return {"accuracy": float(metrics.accuracy_score(labels, pred)),
          "matthews": float(metrics.matthews_corrcoef(labels, pred))}


def best_threshold(scores, labels) -> float:
  """The threshold of the highest Matthews correlation (then accuracy) for 'acceptable = score > threshold':
  a midpoint between two consecutive distinct scores, or below / above them all."""
  s = np.unique(scores)
  candidates = np.concatenate([[s[0] - 1.0], (s[1:] + s[:-1]) / 2, [s[-1] + 1.0]])
  order = np.argsort(scores, kind="stable")
  sorted_scores, y = np.asarray(scores, np.float64)[order], np.asarray(labels)[order].astype(np.float64)
  below = np.searchsorted(sorted_scores, candidates, side="right")           # predicted 0
  tp = np.concatenate([np.cumsum(y[::-1])[::-1], [0.0]])[below]
  fp, fn = len(y) - below - tp, y.sum() - tp
  tn = below - fn
  denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
  mcc = np.where(denominator > 0, (tp * tn - fp * fn) / np.where(denominator > 0, denominator, 1.0), 0.0)
  return float(candidates[np.lexsort((tp + tn, mcc))[-1]])


# ------------------------------------------------------------------------------------------------- task data
def _fields(config, heuristic: str) -> tuple[tuple, int]:
  """(text fields, classes) the heuristic reads from config.task; one-line errors for what does not fit."""
  t = config.task
  if bool(t.files) == bool(t.tfds_name):
    raise ValueError("config.task: set exactly one of files (e.g. '/data/sst2/{split}.tsv') and tfds_name "
                     f"(e.g. 'glue/sst2'), got files={t.files!r}, tfds_name={t.tfds_name!r}")
  fields, names = tuple(t.text_fields), tuple(t.label_names)
  if heuristic == "choice":
    if len(fields) < 3:
      raise ValueError(f"--zeroshot=choice: config.task.text_fields must name the context and at least two answers, "
                       f"got {fields!r}")
    classes = len(fields) - 1
  else:
    if len(fields) != 1:
      raise ValueError(f"--zeroshot={heuristic}: config.task.text_fields must name one text field, got {fields!r}")
    classes = len(names or SENTIMENT_WORDS) if heuristic == "sentiment" else 2
  if names and len(names) != classes:
    raise ValueError(f"--zeroshot={heuristic}: config.task.label_names has {len(names)} names for {classes} classes")
  if heuristic == "sentiment" and classes < 2:
    raise ValueError(f"--zeroshot=sentiment: config.task.label_names needs two or more label words, got {names!r}")
  return fields, classes


def read(config, heuristic: str, split: str) -> Split:
  """The labelled records of `split` for the heuristic. Labels are config.task.label_names as written in the data,
  or class numbers (e.g. SST-2's 0 / 1 with label_names = the label words)."""
  fields, classes = _fields(config, heuristic)
  c = config_lib.replaced(config, {"task.text_fields": fields, "model.num_labels": classes})

  def usable(label_names):
    c.task.label_names = label_names
    recs = tasks.records(c, split)
    found = [r for r in recs
             if isinstance(r, tasks.Record) and r.label is not None and all(x.strip() for x in r.texts)]
    return found, len(recs), recs.path

  found, total, path = usable(tuple(config.task.label_names))
  if not found and config.task.label_names:
    found, total, path = usable(())
  if not found:
    raise ValueError(f"--zeroshot={heuristic}: no labelled records with non-empty text fields {fields!r} in {path}")
  return Split(split, [r.texts for r in found], np.array([r.label for r in found]), total - len(found))


# ------------------------------------------------------------------------------------------------------- run
def evaluate(model_cfg, params, tokenizer, heuristic: str, data: Split, *, cue: str = "very", words=(),
             threshold: float | None = None, chosen_on: Split | None = None, batch_size: int = 32) -> dict:
  """The heuristic's result on `data`: {heuristic, split, examples, skipped, accuracy, ...}. Acceptability: accuracy
  and matthews at `threshold`, or at the best threshold on `chosen_on`, and oracle_* (best on `data` itself)."""
  if models.family(model_cfg).layout != "decoder":
    raise ValueError(f"--mode=zeroshot scores with a GPT language model; this is a {model_cfg.family!r} model")
  out = {"heuristic": heuristic, "split": data.name, "examples": len(data.labels), "skipped": data.skipped}
  if heuristic == "sentiment":
    words = tuple(words) or SENTIMENT_WORDS
    lp = sentiment_logprobs(model_cfg, params, tokenizer, [t[0] for t in data.texts], words, cue=cue,
                            batch_size=batch_size)
    return {**out, "accuracy": float(np.mean(lp.argmax(1) == data.labels)), "label_words": list(words), "cue": cue}
  if heuristic == "choice":
    lp = choice_logprobs(model_cfg, params, tokenizer, [t[0] for t in data.texts], [t[1:] for t in data.texts],
                         batch_size=batch_size)
    return {**out, "accuracy": float(np.mean(lp.argmax(1) == data.labels)), "answers": lp.shape[1]}
  if heuristic != "acceptability":
    raise ValueError(f"unknown zero-shot heuristic {heuristic!r}; known: {', '.join(HEURISTICS)}")
  score = lambda split: sentence_logprobs(model_cfg, params, tokenizer, [t[0] for t in split.texts],
                                          batch_size=batch_size)
  scores = score(data)
  if chosen_on is not None:
    threshold = best_threshold(score(chosen_on), chosen_on.labels)
    out["threshold_split"] = chosen_on.name
  if threshold is not None:
    out.update(threshold=float(threshold), **threshold_metrics(scores, data.labels, threshold))
  oracle = best_threshold(scores, data.labels)
  return {**out, "oracle_threshold": oracle,
          **{f"oracle_{k}": v for k, v in threshold_metrics(scores, data.labels, oracle).items()}}


def _family(config) -> str:
  return init_from.source_model(config.init_from)[0].family if config.init_from else config.model.family


def run(config, workdir: str, heuristic: str, *, cue: str = "very", threshold: float | None = None,
        threshold_split: str = "") -> dict:
  """Reads the task (config.data.eval_split, and threshold_split), loads the latest checkpoint of workdir or
  config.init_from (run_eval.restore_params) and evaluates the heuristic (see evaluate)."""
  if heuristic not in HEURISTICS:
    raise config_lib.ConfigError(f"unknown zero-shot heuristic {heuristic!r}; known: {', '.join(HEURISTICS)}")
  if heuristic != "acceptability" and (threshold is not None or threshold_split):
    raise config_lib.ConfigError(f"--threshold / --threshold_split are for --zeroshot=acceptability, not {heuristic}")
  if threshold is not None and threshold_split:
    raise config_lib.ConfigError("give --threshold or --threshold_split, not both")
  family = _family(config)
  if models.family(family).layout != "decoder":
    raise config_lib.ConfigError(f"--mode=zeroshot scores with a GPT language model; config.model.family={family!r}")
  data = read(config, heuristic, config.data.eval_split)
  chosen_on = read(config, heuristic, threshold_split) if threshold_split else None
  s, params, _ = run_eval.restore_params(config, workdir)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    return evaluate(s.config.model, params, s.tokenizer, heuristic, data, cue=cue, words=config.task.label_names,
                    threshold=threshold, chosen_on=chosen_on, batch_size=config.batch_size)

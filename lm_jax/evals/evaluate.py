"""Held-out metrics over a whole eval set, exact at corpus level: loss, perplexity, bits, accuracies.

Each eval batch gives the objective's metrics (sums over the batch / the batch's denominators) and the
denominators themselves. Multiplying back gives the batch's sums, so every metric is the total over all
batches divided by the total denominator: perplexity = exp(total NLL / total scored tokens), not a mean of
batch means (batches of packed or padded text score different numbers of tokens). token_loss is the NLL in
nats per scored token; bits per token = token_loss / ln 2; bits per byte (per character) divide the total
bits by the UTF-8 bytes (characters) the scored tokens stand for, estimated from the eval text's bytes
(characters) per token (docs/reference.md#eval-metrics).

Objectives with per-example predictions (classification) add metrics over the whole eval set that are no sums
(F1, Matthews correlation, Pearson / Spearman correlation), computed by scikit-learn and scipy.
"""
import math

import numpy as np


def perplexity(token_loss: float) -> float:
  return math.exp(min(token_loss, 700.0))


def bits_per_byte(token_loss: float, bytes_per_token: float) -> float:
  return token_loss / math.log(2) / bytes_per_token


def summarize(batches: list[tuple[dict, dict]], denominator_of, text_per_token: dict | None = None) -> dict:
  """[(metrics, denominators) per batch, floats] -> {eval_<metric>, eval_perplexity, eval_bits_per_token,
  eval_bits_per_byte, eval_bits_per_char} (the last five for objectives with a token_loss). denominator_of(metric
  name) -> the denominator key it was divided by; text_per_token = {'bytes': ..., 'chars': ...} of the eval text."""
  if not batches:
    raise ValueError("no eval batches: check config.data.eval_split and config.data.eval_batches")
  out = {}
  for k in batches[0][0]:
    key = denominator_of(k)
    total = sum(den[key] for _, den in batches)
    out[f"eval_{k}"] = sum(m[k] * den[key] for m, den in batches) / max(total, 1.0)
  if "eval_token_loss" not in out:
    return out
  token_loss = out["eval_token_loss"]
  out["eval_perplexity"] = perplexity(token_loss)
  out["eval_bits_per_token"] = token_loss / math.log(2)
  for unit in ("bytes", "chars"):
    if text_per_token and text_per_token.get(unit):
      out[f"eval_bits_per_{unit[:-1]}"] = bits_per_byte(token_loss, text_per_token[unit])
  out["eval_tokens"] = sum(den[denominator_of("token_loss")] for _, den in batches)
  return out


def prediction_metrics(outputs: dict) -> dict:
  """Metrics of the labelled examples' predictions ({prediction, label, weight} arrays over the eval set; weight 0
  = padding or no label): F1 (of class 1 with two classes, else macro) and Matthews correlation for classes,
  Pearson and Spearman correlation for regression (float predictions). GLUE's metrics (Wang et al. 2019)."""
  keep = np.asarray(outputs["weight"]) > 0
  pred, label = np.asarray(outputs["prediction"])[keep], np.asarray(outputs["label"])[keep]
  if len(label) < 2:
    return {}
  if np.issubdtype(pred.dtype, np.floating):
    from scipy import stats
    return {"eval_pearson": float(stats.pearsonr(pred, label)[0]),
            "eval_spearman": float(stats.spearmanr(pred, label)[0])}
  from sklearn import metrics
  binary = max(pred.max(), label.max()) <= 1
  return {"eval_f1": float(metrics.f1_score(label, pred, average="binary" if binary else "macro", zero_division=0)),
          "eval_matthews": float(metrics.matthews_corrcoef(label, pred))}

"""Held-out metrics from per-batch eval metrics: loss, perplexity, bits per byte, accuracies.

Eval batches have the same number of rows, and for packed text nearly the same number of scored
tokens, so batch means are averaged with equal weights. token_loss is the mean NLL in nats per scored
token: perplexity = e^token_loss, bits per byte = token_loss / ln 2 / (bytes per token)
(docs/reference.md#eval-metrics).
"""
import math

import numpy as np


def perplexity(token_loss: float) -> float:
  return math.exp(min(token_loss, 700.0))


def bits_per_byte(token_loss: float, bytes_per_token: float) -> float:
  return token_loss / math.log(2) / bytes_per_token


def summarize(batch_metrics: list[dict], bytes_per_token: float | None) -> dict:
  """List of per-batch metric dicts (floats) -> {eval_<metric>, eval_perplexity, eval_bits_per_byte}."""
  if not batch_metrics:
    raise ValueError("no eval batches: check config.data.eval_split and config.data.eval_batches")
  mean = {k: float(np.mean([m[k] for m in batch_metrics])) for k in batch_metrics[0]}
  out = {f"eval_{k}": v for k, v in mean.items()}
  out["eval_perplexity"] = perplexity(mean["token_loss"])
  if bytes_per_token:
    out["eval_bits_per_byte"] = bits_per_byte(mean["token_loss"], bytes_per_token)
  return out

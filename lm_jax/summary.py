"""`--mode=summary`: parameter count and per-module table from shapes alone (jax.eval_shape, no
allocation), then the memory estimate when lm_jax.plan.memory is there.

`params:` counts the model without its task heads (BERT: BertModel with pooler, the paper's 110M /
340M; GPT-1 and T5: everything, tied embeddings once); each head gets its own `head <name>:` line.
"""
import math

import jax

from lm_jax import models
from lm_jax.models import layers
from lm_jax.plan import memory


def _rows(abstract) -> list[tuple[str, tuple, int, int]]:
  """(module path, per-layer shape, copies, params) with looped layers (`layers_3`) folded together."""
  rows = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    keys = [p.key for p in path]
    name = "/".join("layers_*" if layers.LOOPED.fullmatch(str(k)) else str(k) for k in keys)
    shape = tuple(leaf.shape)
    if name in rows:
      rows[name][2] += 1
    else:
      rows[name] = [name, shape, 1]
  return [(n, s, c, c * math.prod(s)) for n, s, c in rows.values()]


def print_summary(config) -> None:
  model_cfg = config.model
  abstract = models.abstract_params(model_cfg)
  heads = models.family(model_cfg).heads
  rows = _rows(abstract)
  width = max(len(r[0]) for r in rows)
  print(f"{'module':<{width}}  {'shape':<22} {'copies':>6} {'params':>13}")
  for name, shape, copies, n in rows:
    print(f"{name:<{width}}  {str(shape):<22} {copies:>6} {n:>13,}")
  body = {k: v for k, v in abstract.items() if k not in heads}
  print(f"params: {models.count(body)}")
  for head in heads:
    if head in abstract:
      print(f"head {head}: {models.count(abstract[head])}")
  print(f"params with heads: {models.count(abstract)}")
  report = memory.estimate(config)
  if isinstance(report, dict):
    for key, value in report.items():
      print(f"memory {key}: {value}")
  else:
    print(report)

"""What trains when fine-tuning (config.finetune); where the model starts is lm_jax.init_from.

- layer_decay: finetune.layer_decay < 1 gives layer i the learning rate lr * decay^(num_layers - i)
  (lm_jax.optim.layer_lr_scales).
- trainable_mask / split / merge: finetune.freeze holds regexes over parameter paths ('/'-joined, layers named
  as when looped: 'word_embeddings/embedding', 'layers_3/mlp/wi/kernel'); matching parameters are frozen: the
  train step differentiates only the trainable part and the optimizer keeps state only for it (lm_jax/step.py,
  lm_jax/optim.py), while checkpoints still hold every parameter.
"""
import re

from lm_jax import models
from lm_jax.models import layers
from lm_jax.peft import lora

_LAYER = re.compile(r"layers_(\d+)")   # a looped layer's params; scanned ones are all under "layers"


def _paths(tree, prefix=()) -> dict:
  """{path tuple: leaf} of a nested dict."""
  out = {}
  for k, v in tree.items():
    out.update(_paths(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


# ------------------------------------------------------------------------------------------------------ freezing
def _patterns(config) -> tuple:
  """finetune.freeze, and the reference copy of model.frozen_reference."""
  group = config.get("finetune")
  reference = (f"^{models.REFERENCE}/",) if config.model.get("frozen_reference", False) else ()
  return (tuple(group.get("freeze", ())) if group is not None else ()) + reference


def layer_decay(config) -> float:
  """config.finetune.layer_decay (1.0 = every layer at the same lr), 1.0 for configs without the field."""
  group = config.get("finetune")
  return float(group.get("layer_decay", 1.0)) if group is not None else 1.0


def _frozen_looped(model_cfg, patterns) -> dict:
  """{looped path string: frozen?} of every parameter."""
  looped = models.abstract_params(layers.replace(model_cfg, scan_layers=False))
  return {"/".join(p): any(re.search(rx, "/".join(p)) for rx in patterns) for p in _paths(looped)}


def check(config):
  """One-line ValueError naming the config.finetune (or config.lora) field that cannot apply to config.model."""
  lora.check(config)
  patterns, top = _patterns(config), config.finetune.reinit_top_layers
  if not 0 <= top <= config.model.num_layers:
    raise ValueError(f"config.finetune.reinit_top_layers must be in [0, model.num_layers={config.model.num_layers}],"
                     f" got {top}")
  if top and not config.init_from:
    raise ValueError("config.finetune.reinit_top_layers needs config.init_from (the model to start from)")
  best = config.finetune.best_metric
  if best and (not best.startswith("eval_") or not config.eval_every):
    raise ValueError(f"config.finetune.best_metric={best!r} must name an eval metric (eval_accuracy, eval_loss, ...) "
                     f"and needs config.eval_every > 0, got eval_every={config.eval_every}")
  decay = layer_decay(config)
  if not 0 < decay <= 1:
    raise ValueError(f"config.finetune.layer_decay must be in (0, 1] (1 = off), got {decay}")
  if decay != 1 and config.model.family not in ("bert", "gpt"):
    raise ValueError(f"config.finetune.layer_decay needs a bert or gpt model (one layer stack), got "
                     f"{config.model.family!r}")
  for rx in patterns:
    try:
      re.compile(rx)
    except re.error as e:
      raise ValueError(f"config.finetune.freeze: {rx!r} is not a regular expression ({e})") from None
  if patterns:
    frozen = _frozen_looped(config.model, patterns)
    for rx in patterns:
      if not any(re.search(rx, p) for p in frozen):
        raise ValueError(f"config.finetune.freeze: {rx!r} matches no parameter (paths look like "
                         f"{next(iter(frozen))!r}, {next(p for p in frozen if p.startswith('layers_'))!r})")
    if all(frozen.values()):
      raise ValueError(f"config.finetune.freeze={patterns!r} freezes every parameter")
    trainable_mask(config)


def trainable_mask(config) -> dict | None:
  """Bool tree over config.model's params (in its layout): False for the frozen ones; None when nothing is. With
  LoRA the adapters and lora.modules_to_save train (lm_jax.peft.lora.trainable_mask)."""
  if lora.enabled(config):
    return lora.trainable_mask(config)
  patterns = _patterns(config)
  if not patterns:
    return None
  frozen = _frozen_looped(config.model, patterns)
  mask = {}
  for path, is_frozen in frozen.items():
    keys = ["layers" if config.model.scan_layers and _LAYER.fullmatch(k) else k for k in path.split("/")]
    node = mask
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    if node.get(keys[-1], not is_frozen) != (not is_frozen):
      raise ValueError(f"config.finetune.freeze={patterns!r} freezes some layers of a scanned stack "
                       f"({'/'.join(keys)}); set config.model.scan_layers=False")
    node[keys[-1]] = not is_frozen
  return mask


def split(tree: dict, mask: dict | None) -> tuple[dict, dict]:
  """(trainable, frozen) parts of a params-shaped nested dict; with mask None, (tree, {})."""
  if mask is None:
    return tree, {}
  trainable, frozen = {}, {}
  for k, v in tree.items():
    if isinstance(v, dict):
      a, b = split(v, mask[k])
      trainable.update({k: a} if a else {})
      frozen.update({k: b} if b else {})
    else:
      (trainable if mask[k] else frozen)[k] = v
  return trainable, frozen


def merge(a: dict, b: dict) -> dict:
  """The union of two disjoint nested dicts (inverse of split)."""
  out = dict(a)
  for k, v in b.items():
    out[k] = merge(out[k], v) if k in out else v
  return out


def trainable_count(config) -> tuple[int, int]:
  """(trainable, total) parameter counts of config.model under config.finetune.freeze (or LoRA)."""
  if lora.enabled(config):
    return lora.count(config)
  abstract = models.abstract_params(config.model)
  return models.count(split(abstract, trainable_mask(config))[0]), models.count(abstract)

"""Optimizers and learning-rate schedules from `config.optimizer` (optax, plus one written-out Adam).

The papers' recipes (docs/reference.md#optimizers):
  bert_adamw  Adam + decoupled weight decay (lr * wd * param) skipped for LayerNorm and biases, eps 1e-6,
              no bias correction (google-research/bert AdamWeightDecayOptimizer).
  adam_l2     GPT-1: Adam + the "modified L2" of openai/finetune-transformer-lm opt.py, which is the same
              decoupled decay (lr * l2 * param) on weights of rank > 1.
  adafactor   T5: factored second moments, update clipping 1.0, decay 0.8, parameter-scaled steps.
  adamw       generic AdamW, decay on weights of rank > 1.
The Adam family is written out (adam below) rather than chained from optax because optax's Adam always
applies bias correction and BERT's does not; for the others it equals the optax chain (tests/test_step.py).
"Rank" ignores the stacked 'layers' axis of scanned models, so LayerNorm scales are vectors with or
without `scan_layers`; params named 'bias' are never decayed. For BERT that is exactly "not LayerNorm,
not bias", for GPT-1 exactly "rank > 1" of the original code.
"""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from lm_jax import params as params_lib
from lm_jax.models import layers, mup

OPTIMIZERS = ("bert_adamw", "adam_l2", "adafactor", "adamw")
SCHEDULES = ("linear", "cosine", "rsqrt", "constant")


def schedule(opt, total_steps: int):
  """Learning rate as a function of the update count (0 for the first update)."""
  lr, w, t = opt.lr, opt.warmup_steps, total_steps
  if not 0 <= opt.min_lr_ratio <= 1:
    raise ValueError(f"config.optimizer.min_lr_ratio={opt.min_lr_ratio} must be in [0, 1]")
  floor = lr * opt.min_lr_ratio     # where linear and cosine decay end (nanoGPT's min_lr)
  if opt.schedule == "linear":  # BERT: lr * step/w during warmup, else lr * (1 - step/total) (power-1 poly decay)
    decay = optax.linear_schedule(floor + (lr - floor) * (1 - w / t), floor, t - w) if t > w else \
        optax.constant_schedule(floor)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, w), decay], [w]) if w else decay
  if opt.schedule == "cosine":  # GPT-1: linear warmup from 0, then cosine to 0 at total_steps; nanoGPT: to min_lr
    decay = optax.cosine_decay_schedule(lr, max(t - w, 1), alpha=floor / lr)
    return optax.join_schedules([optax.linear_schedule(0.0, lr, w), decay], [w]) if w else decay
  if opt.schedule == "rsqrt":  # T5: lr * sqrt(w / max(step, w)); lr 0.01, w 10k = 1/sqrt(max(step, 10k))
    w = max(w, 1)
    return lambda step: lr * jnp.sqrt(w / jnp.maximum(step, w).astype(jnp.float32))
  if opt.schedule == "constant":
    return optax.warmup_constant_schedule(0.0, lr, w) if w else optax.constant_schedule(lr)
  raise ValueError(f"config.optimizer.schedule={opt.schedule!r} unknown; use one of {', '.join(SCHEDULES)}")


def decay_mask(logical_axes):
  """True for weights of rank > 1 that are not biases (see module doc); attention q/k/v biases are
  (heads, head_dim) matrices here but vectors in the original code, so the name decides."""
  def decay(path, spec):
    return getattr(path[-1], "key", None) != "bias" and sum(1 for a in spec if a != "layers") > 1
  return jax.tree_util.tree_map_with_path(decay, logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


class AdamState(NamedTuple):
  count: jax.Array  # updates done
  mu: Any
  nu: Any


def adam(lr, b1: float, b2: float, eps: float, weight_decay: float, decay_mask, clip_norm: float = 0.0,
         bias_correction: bool = True, lr_scales=None) -> optax.GradientTransformation:
  """Global-norm clipping + Adam + decoupled weight decay on decay_mask's leaves, one expression per
  parameter. Equals optax.chain(clip_by_global_norm(clip_norm), adamw(lr, b1, b2, eps, weight_decay,
  mask=decay_mask)); bias_correction=False is BERT's AdamWeightDecayOptimizer. lr_scales (a tree like the params,
  µP's: lm_jax.models.mup.lr_scales) multiplies each param's lr and divides its weight decay, as mup.MuAdam's
  param groups do: lr * weight decay stays as set."""
  def init(params):
    return AdamState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params),
                     jax.tree.map(jnp.zeros_like, params))

  def update(grads, state, params):
    count = state.count + 1
    scale = 1.0
    if clip_norm:
      norm = optax.tree.norm(grads)
      scale = jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
    c1 = 1 - b1 ** count.astype(jnp.float32) if bias_correction else 1.0
    c2 = 1 - b2 ** count.astype(jnp.float32) if bias_correction else 1.0
    step_size = -(lr(state.count) if callable(lr) else lr)

    def leaf(g, m, v, p, decay, k=1.0):
      g = g * scale
      m = b1 * m + (1 - b1) * g
      v = b2 * v + (1 - b2) * g * g
      u = (m / c1) / (jnp.sqrt(v / c2) + eps)
      if k != 1.0:
        u = u * k
      if decay and weight_decay:
        u = u + weight_decay * p
      return (step_size * u).astype(p.dtype), m, v

    out = jax.tree.map(leaf, grads, state.mu, state.nu, params, decay_mask,
                       *(() if lr_scales is None else (lr_scales,)))
    pick = lambda i: jax.tree.map(lambda _, o: o[i], grads, out)
    return pick(0), AdamState(count, pick(1), pick(2))

  return optax.GradientTransformation(init, update)


def layer_lr_scales(logical_axes, num_layers: int, decay: float):
  """Per-parameter lr factors of layer-wise lr decay (ELECTRA, Clark et al. 2020 App. A): decay^(L + 1 - depth)
  with depth 0 for the embeddings, i + 1 for layer i and L + 1 (factor 1) above (pooler, heads); a scanned stack
  gets one factor per layer along its leading axis."""
  def scale(path, spec):
    top = path[0].key
    looped = layers.LOOPED.fullmatch(top)
    if looped:
      return np.float32(decay ** (num_layers - int(looped.group(1))))
    if top == "layers":
      return (decay ** (num_layers - np.arange(num_layers, dtype=np.float32))).reshape((-1,) + (1,) * (len(spec) - 1))
    return np.float32(decay ** (num_layers + 1) if "embed" in top else 1.0)
  return jax.tree_util.tree_map_with_path(scale, logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def scale_updates(scales) -> optax.GradientTransformation:
  """Multiplies each update by its factor in `scales` (a tree like the params): per-parameter learning rates."""
  return optax.GradientTransformation(
      lambda params: optax.EmptyState(),
      lambda updates, state, params=None: (jax.tree.map(lambda u, k: (u * k).astype(u.dtype), updates, scales), state))


def make(policy, logical_axes):
  """Returns (optax transformation, lr schedule) for config.optimizer; policy: the run's params.Policy (a config is
  resolved); logical_axes from lm_jax.models. The transformation is over the trainable params only
  (policy.trainable), with config.finetune.layer_decay's per-layer learning rates when it is below 1 and µP's
  per-param ones with model.mup_base_width (Adam family only: Adafactor's parameter-scaled steps are another
  parametrization)."""
  policy = params_lib.resolve(policy)
  config = policy.config
  logical_axes = params_lib.split(logical_axes, policy.trainable)[0]
  opt = config.optimizer
  if opt.name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer.name={opt.name!r} unknown; use one of {', '.join(OPTIMIZERS)}")
  lr = schedule(opt, config.total_steps)
  mup_scales = mup.lr_scales(config.model, logical_axes) if mup.width_mult(config.model) != 1.0 else None
  if opt.name == "adafactor" and mup.base_width(config.model):
    raise ValueError("model.mup_base_width needs an Adam-family optimizer (config.optimizer.name: bert_adamw, "
                     "adam_l2, adamw), not adafactor")
  if opt.name == "adafactor":
    tx = optax.adafactor(lr, weight_decay_rate=opt.weight_decay or None,
                         weight_decay_mask=decay_mask(logical_axes) if opt.weight_decay else None)
    if opt.clip_norm:
      tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
  else:
    tx = adam(lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, decay_mask(logical_axes), opt.clip_norm,
              bias_correction=opt.name != "bert_adamw", lr_scales=mup_scales)
  if policy.layer_decay != 1.0:
    tx = optax.chain(tx, scale_updates(layer_lr_scales(logical_axes, config.model.num_layers, policy.layer_decay)))
  return tx, lr

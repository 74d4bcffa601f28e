"""Optimizers and learning-rate schedules from `config.optimizer` (optax, plus one written-out Adam).

The papers' recipes (docs/reference.md#optimizers):
  bert_adamw  Adam + decoupled weight decay (lr * wd * param) skipped for LayerNorm and biases, eps 1e-6,
              no bias correction (google-research/bert AdamWeightDecayOptimizer).
  adam_l2     GPT-1: Adam + the "modified L2" of openai/finetune-transformer-lm opt.py, which is the same
              decoupled decay (lr * l2 * param) on weights of rank > 1.
  adafactor   T5: factored second moments, update clipping 1.0, decay 0.8, parameter-scaled steps.
  adamw       generic AdamW, decay on weights of rank > 1.
And 2024's, through optax (docs/configs.md#optimizers-of-2024-and-wsd): muon (the hidden matrices by their
logical axes, AdamW for the rest), lion, schedule_free_adamw (evaluated at eval_params); the wsd schedule.
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

OPTIMIZERS = ("bert_adamw", "adam_l2", "adafactor", "adamw", "muon", "lion", "schedule_free_adamw")
ADAM_FAMILY = ("bert_adamw", "adam_l2", "adamw")   # this module's adam (clipping and µP's lr scales inside)
SF_STATE = optax.contrib.ScheduleFreeState
SCHEDULES = ("linear", "cosine", "rsqrt", "constant", "wsd")
COOLDOWN_SHAPES = {   # fraction of (lr - floor) left at cooldown progress p in [0, 1]
    "linear": lambda p: 1 - p,
    "1-sqrt": lambda p: 1 - jnp.sqrt(p),   # Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training ..."
    "cosine": lambda p: 0.5 * (1 + jnp.cos(jnp.pi * p)),
}


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
  if opt.schedule == "wsd":
    return wsd(lr, floor, w, cooldown_start(opt, t), t, opt.cooldown_shape)
  raise ValueError(f"config.optimizer.schedule={opt.schedule!r} unknown; use one of {', '.join(SCHEDULES)}")


def cooldown_start(opt, total_steps: int) -> int:
  """The step WSD's cooldown starts: optimizer.cooldown_start, or 0 for the last cooldown_fraction of the steps."""
  if not 0 <= opt.cooldown_fraction <= 1:
    raise ValueError(f"config.optimizer.cooldown_fraction={opt.cooldown_fraction} must be in [0, 1]")
  start = opt.cooldown_start or total_steps - round(opt.cooldown_fraction * total_steps)
  if not opt.warmup_steps <= start <= total_steps:
    raise ValueError(f"config.optimizer.cooldown_start={start} must be in [warmup_steps={opt.warmup_steps}, "
                     f"total_steps={total_steps}]")
  return start


def branches_cooldown(config) -> bool:
  """Whether a fresh run branches a WSD cooldown off config.init_from's run (when a workdir, not a Hugging Face
  directory): it resumes that run's train state, step and data position; only the schedule from
  optimizer.cooldown_start on differs."""
  opt = config.optimizer
  return bool(opt.schedule == "wsd" and opt.cooldown_start and config.init_from)


def check_branch(config, restored):
  """`restored` (config.init_from's latest checkpoint) when it lies in the stable phase, else a one-line ValueError."""
  start = config.optimizer.cooldown_start
  if restored is None or restored.step > start:
    where = "has no checkpoint" if restored is None else f"has its latest checkpoint at step {restored.step}"
    raise ValueError(f"config.init_from={config.init_from!r} {where}: a cooldown branched at "
                     f"optimizer.cooldown_start={start} needs one at or before that step")
  return restored


def wsd(lr: float, floor: float, warmup: int, start: int, total: int, shape: str):
  """Warmup-stable-decay (MiniCPM, Hu et al. 2024; MaxText's and Levanter's wsd): linear warmup from 0 over
  `warmup` steps, lr until step `start`, then `shape` down to `floor` at step `total`. Every step before `start`
  is the same whatever `start` and `total` are, so a cooldown can branch from any stable-phase checkpoint."""
  if shape not in COOLDOWN_SHAPES:
    raise ValueError(f"config.optimizer.cooldown_shape={shape!r} unknown; use one of {', '.join(COOLDOWN_SHAPES)}")
  decay = COOLDOWN_SHAPES[shape]

  def rate(step):
    step = jnp.asarray(step, jnp.float32)
    p = jnp.clip((step - start) / max(total - start, 1), 0.0, 1.0)
    stable = jnp.where(step < start, lr, floor + (lr - floor) * decay(p))
    return jnp.where(step < warmup, lr * step / max(warmup, 1), stable)
  return rate


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


def layer_lr_scales(logical_axes, model_cfg, decay: float):
  """Per-parameter lr factors of layer-wise lr decay (ELECTRA, Clark et al. 2020 App. A): decay^(L + 1 - depth)
  with depth 0 for the embeddings, i + 1 for layer i and L + 1 (factor 1) above (pooler, heads); a scanned stack
  gets one factor per layer along its leading axis (params.stacked_layers: the layers its family puts there)."""
  num_layers = model_cfg.num_layers

  def scale(path, spec):
    top = path[0].key
    looped = layers.LOOPED.fullmatch(top)
    if looped:
      return np.float32(decay ** (num_layers - int(looped.group(1))))
    if top == "layers":
      depth = params_lib.stacked_layers(model_cfg, [p.key for p in path]).astype(np.float32)
      return (decay ** (num_layers - depth)).reshape((-1,) + (1,) * (len(spec) - 1))
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
  if opt.name not in ADAM_FAMILY and mup.base_width(config.model):
    raise ValueError(f"model.mup_base_width needs an Adam-family optimizer (config.optimizer.name: "
                     f"{', '.join(ADAM_FAMILY)}), not {opt.name}")
  if opt.name == "schedule_free_adamw" and policy.layer_decay != 1.0:
    raise ValueError("config.finetune.layer_decay scales updates after the optimizer, which schedule-free "
                     "averaging does not allow; use another config.optimizer.name or layer_decay=1.0")
  mask = decay_mask(logical_axes)
  if opt.name == "adafactor":
    tx = optax.adafactor(lr, weight_decay_rate=opt.weight_decay or None,
                         weight_decay_mask=mask if opt.weight_decay else None)
  elif opt.name == "muon":
    tx = muon(opt, lr, logical_axes)
  elif opt.name == "lion":
    tx = optax.lion(lr, opt.b1, opt.b2, weight_decay=opt.weight_decay, mask=mask)
  elif opt.name == "schedule_free_adamw":
    tx = schedule_free_adamw(opt, lr, mask)
  else:
    tx = adam(lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, mask, opt.clip_norm,
              bias_correction=opt.name != "bert_adamw", lr_scales=mup_scales)
  if opt.clip_norm and opt.name not in ADAM_FAMILY:
    tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
  if policy.layer_decay != 1.0:
    tx = optax.chain(tx, scale_updates(layer_lr_scales(logical_axes, config.model, policy.layer_decay)))
  return tx, lr


# ------------------------------------------------------------------------------------------ 2024's optimizers
def muon_dims(logical_axes):
  """optax.contrib.MuonDimensionNumbers of each hidden matrix, None for the leaves AdamW trains. A hidden matrix is
  a Dense 'kernel' whose axes all have names other than 'vocab' (output heads, task heads and LoRA adapters have
  a vocab or unnamed axis); embeddings, norms and biases are not kernels. Its reduction (input) axis is a leading
  'embed' (q/k/v, MLP in: (embed, heads, kv), (embed, mlp)); otherwise the output axis is the last one (attention
  out, MLP out: (heads, kv, embed), (mlp, embed)). A scanned 'layers' axis is neither, so Newton-Schulz runs on each
  layer's matrix separately (optax vmaps the other axes)."""
  def dims(path, spec):
    axes = [i for i, a in enumerate(spec) if a != "layers"]
    names = [spec[i] for i in axes]
    if getattr(path[-1], "key", None) != "kernel" or len(axes) < 2 or None in names or "vocab" in names:
      return None
    if names[0] == "embed":
      return optax.contrib.MuonDimensionNumbers(axes[0], tuple(axes[1:]))
    return optax.contrib.MuonDimensionNumbers(tuple(axes[:-1]), axes[-1])
  return jax.tree_util.tree_map_with_path(dims, logical_axes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def muon(opt, lr, logical_axes) -> optax.GradientTransformation:
  """Muon (Jordan et al. 2024; optax.contrib.muon) on the hidden matrices (muon_dims) at lr, decoupled weight decay
  on all of them; the other leaves get this module's AdamW at optimizer.adam_lr (0 = lr) with decay_mask's decay,
  as the existing AdamW runs (optax.contrib.muon's own Adam would decay norms and biases too)."""
  dims = muon_dims(logical_axes)
  is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=is_dims)
  only = lambda label, tree: jax.tree.map(lambda x, l: x if l == label else optax.MaskedNode(), tree, labels,
                                          is_leaf=is_dims)
  adam_lr = lr if not opt.adam_lr else (lambda step: lr(step) * (opt.adam_lr / opt.lr))
  matrices = optax.contrib.muon(lr, beta=opt.muon_momentum, weight_decay=opt.weight_decay,
                                muon_weight_dimension_numbers=only("muon", dims))
  rest = adam(adam_lr, opt.b1, opt.b2, opt.eps, opt.weight_decay, only("adam", decay_mask(logical_axes)))
  return optax.partition({"muon": matrices, "adam": rest}, labels)


def schedule_free_adamw(opt, lr, mask) -> optax.GradientTransformation:
  """optax.contrib.schedule_free_adamw (Defazio et al. 2024) with its weight decay on decay_mask's leaves only; lr is
  the run's schedule (constant with warmup, as the paper's). Evaluate at eval_params, not at the iterate."""
  base = optax.chain(optax.scale_by_rms(decay=opt.b2, eps=opt.eps, eps_in_sqrt=False, bias_correction=True),
                     optax.add_decayed_weights(opt.weight_decay, mask), optax.scale_by_learning_rate(lr))
  return optax.contrib.schedule_free(base, lr, b1=opt.b1)


def eval_params(state: dict, trainable=None) -> dict:
  """The params to evaluate, export and decode a train state {params, opt_state, step} at: schedule-free AdamW's
  average (optax.contrib.schedule_free_eval_params) of the trainable params; for every other optimizer the params."""
  found = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, SF_STATE))
           if isinstance(s, SF_STATE)]
  if not found:
    return state["params"]
  params, frozen = params_lib.split(state["params"], trainable)
  return params_lib.join(optax.contrib.schedule_free_eval_params(found[0], params), frozen)

"""µP's coordinate check (Tensor Programs V, Yang et al. 2022, §D.1; the `mup` package's README): a few Adam steps
of one model at several widths, under µP (model.mup_base_width = the narrowest width) and under the standard
parametrization, recording each layer's mean |activation| after the last step. Under µP the curves are flat in
width; under SP the logits (and the layers an update feeds) grow with it.

The widths scale d_model, d_ff and an explicit head_dim together (lm_jax/models/mup.py's base model); heads, depth,
vocabulary and the batch stay. The batch is a fixed draw of Zipf-distributed token ids (a unigram to learn).
"""
import io
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lm_jax import models, optim, params as params_lib, storage
from lm_jax.models import layers

PARAMETRIZATIONS = ("mup", "sp")
TITLES = {"mup": "µP", "sp": "SP"}
RECORDED = ("word_embeddings", "position_embeddings", "token_type_embeddings", "attention", "mlp")   # module names


def widen(model_cfg, width: int, base: int):
  """model_cfg at d_model = width (d_ff, head_dim scaled alike), dropout off, looped layers; mup_base_width = base,
  or 0 at the base width itself (the same model: lm_jax/models/mup.py), so equal configs mean equal runs."""
  ratio = width / model_cfg.d_model
  if not model_cfg.get("head_dim", 0) and width % model_cfg.num_heads:
    raise ValueError(f"--widths: {width} is not divisible by model.num_heads={model_cfg.num_heads}")
  fields = dict(d_model=width, d_ff=max(1, round(model_cfg.d_ff * ratio)), mup_base_width=0 if base == width else base,
                scan_layers=False, dropout_rate=0.0, attention_dropout_rate=0.0)
  if model_cfg.get("head_dim", 0):
    fields["head_dim"] = max(1, round(model_cfg.head_dim * ratio))
  return layers.replace(model_cfg, **fields)


def batch(model_cfg, size: int, length: int, seed: int) -> dict:
  """Token ids drawn from a Zipf(1) unigram over the vocabulary."""
  p = 1 / np.arange(1, model_cfg.vocab_size + 1)
  ids = np.random.default_rng(seed).choice(model_cfg.vocab_size, (size, length), p=p / p.sum())
  return {"input_ids": jnp.asarray(ids, jnp.int32)}


def _loss(logits, ids):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def record(config, model_cfg, tokens: dict, *, steps: int, lr: float, seed: int = 0) -> dict:
  """{layer: mean |x|} after `steps` Adam steps (config.optimizer's, at a constant lr) of the model model_cfg."""
  run = config.copy_and_resolve_references()
  run.unlock()
  run.model = model_cfg
  run.optimizer.update(lr=lr, schedule="constant", warmup_steps=0)
  run.total_steps = steps
  fam, frozen = models.family(model_cfg), layers.frozen(model_cfg)
  model = fam.Model(frozen)
  p = params_lib.init(run, jax.random.key(seed))
  tx, _ = optim.make(run, models.logical_axes(model_cfg))
  ids = tokens["input_ids"]

  @jax.jit
  def step(p, state):
    grads = jax.grad(lambda p: _loss(model.apply({"params": p}, tokens)["logits"], ids))(p)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  state = tx.init(p)
  for _ in range(steps):
    p, state = step(p, state)

  @jax.jit
  def measure(p):
    out, captured = model.apply({"params": p}, tokens, capture_intermediates=lambda m, method: (
        method == "__call__" and m.name in RECORDED), mutable=["intermediates"])
    found = {"logits": jnp.abs(out["logits"]).mean()}
    for path, value in jax.tree_util.tree_flatten_with_path(captured["intermediates"], is_leaf=lambda x: isinstance(
        x, tuple))[0]:
      names = [k.key for k in path if hasattr(k, "key") and k.key != "__call__"]
      y = value[0][0] if isinstance(value[0], tuple) else value[0]   # Attention returns (y, cache)
      found["/".join(names)] = jnp.abs(y.astype(jnp.float32)).mean()
    return found

  return {k: float(v) for k, v in measure(p).items()}


def run(config, widths: list[int], *, steps: int = 3, lr: float = 3e-3, batch_size: int = 8, length: int = 64,
        seed: int = 0) -> dict:
  """{parametrization: {"parametrization", "widths", "layers": {name: [mean |x| per width]}}}."""
  if len(widths) < 2 or any(not isinstance(w, int) or w <= 0 for w in widths) or sorted(set(widths)) != widths:
    raise ValueError(f"--widths needs two or more increasing positive integers, got {widths}")
  tokens = batch(config.model, batch_size, min(length, config.model.get("max_positions", length)), seed)
  results, done = {}, {}
  for name in PARAMETRIZATIONS:
    cfgs = [widen(config.model, w, widths[0] if name == "mup" else 0) for w in widths]
    for c in cfgs:
      models.validate(c)
    for c in cfgs:   # µP at the base width is SP's run: done once
      if c.to_json() not in done:
        done[c.to_json()] = record(config, c, tokens, steps=steps, lr=lr, seed=seed)
    per_width = [done[c.to_json()] for c in cfgs]
    names = [k for k in per_width[0] if k != "logits"] + ["logits"]
    results[name] = {"parametrization": name, "widths": widths,
                     "layers": {k: [r[k] for r in per_width] for k in names}}
  return results


def plot(results: dict):
  """The mup README's figure: one panel per parametrization, mean |x| against width (log-log), a line per layer."""
  from matplotlib.figure import Figure
  fig = Figure(figsize=(5 * len(results), 4), layout="constrained")
  axes = fig.subplots(1, len(results), sharey=True, squeeze=False)[0]
  for ax, (name, r) in zip(axes, results.items()):
    for layer, values in r["layers"].items():
      ax.plot(r["widths"], values, marker="o", label=layer, lw=2.5 if layer == "logits" else 1.2)
    ax.set(xscale="log", yscale="log", xlabel="width (d_model)", title=f"{TITLES[name]}: mean |x| after the steps")
    ax.set_xticks(r["widths"], [str(w) for w in r["widths"]])
    ax.minorticks_off()
  axes[0].set_ylabel("mean |activation|")
  axes[-1].legend(fontsize=7, loc="best")
  return fig


def write(results: dict, out: str) -> list[str]:
  """DIR/<parametrization>.json and DIR/coord_check.png, each written whole and renamed in (never through a link)."""
  os.makedirs(out, exist_ok=True)
  files = {f"{name}.json": json.dumps(r, indent=1).encode() for name, r in results.items()}
  png = io.BytesIO()
  plot(results).savefig(png, format="png", dpi=110)
  files["coord_check.png"] = png.getvalue()
  paths = []
  for name, data in files.items():
    paths.append(os.path.join(out, name))
    os.replace(storage.write_new(out, ".coord-", data), paths[-1])
  return paths

"""ModernBERT (Warner et al. 2024, arXiv 2412.13663; HF ModernBertForMaskedLM): a pre-norm encoder with rotary
positions, alternating global and local (sliding-window) attention, GeGLU and no biases, with BERT's MLM head.

Params: word_embeddings + embeddings_ln, the layers (layer 0 has no attention_ln: the embeddings are normalised
already), final_ln, the 'head' (dense + act + LN, shared by the MLM and the classifier as in HF) and the 'decoder'
bias of the MLM logits (decoder tied to the word embeddings). Layer i attends globally with rotary theta
model.rope_theta when i % model.global_every == 0, else to keys within model.sliding_window positions (HF's
local_attention = 2 * sliding_window) with model.local_rope_theta. Init is HF's: truncated normal
(initializer_range), the residual projections and the head's dense scaled by 1 / sqrt(2 * num_layers).

Layer 0 differs from the rest (no attention norm) and the attention kinds alternate, so model.scan_layers scans
groups of model.global_every layers instead of single ones: layer 0 stays looped (`layers_0`), then layers 1 ...
G * global_every, G = (num_layers - 1) // global_every, are G groups of (local, ..., local, global) under 'layers'
(sub-layers `local_0` ... and `global`, params with a leading axis of G), then the remaining local layers looped
under their own index (`layers_<i>`). base's 22 layers: layers_0 + 7 groups; large's 28: layers_0 + 9 groups.
grouped / ungrouped convert between the two layouts (the HF converter goes through the looped one); place_layer and
relaid (the Family's) tell adapters, PEFT files, layer_decay and reinit_top_layers where each layer sits.

A model config with num_labels > 0 is a sequence classifier (HF ModernBertForSequenceClassification): the final
states pooled (model.classifier_pooling: [CLS] or the mean over real tokens) -> head -> dropout -> 'classifier'.
"""
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm_jax import flops
from lm_jax.models import attention, blocks, costs, layers, mup, relayout
from lm_jax.models.registry import Family, Tokens

FIELDS = {                        # its own model config fields beyond the shared ones, with HF ModernBertConfig's
    "max_positions": 8192,        # the context it is trained for (rotary positions set no hard limit)
    "rope_theta": 160000.0,       # rotary base of the global layers
    "local_rope_theta": 10000.0,  # and of the local ones
    "global_every": 3,            # layer i attends globally when i % global_every == 0
    "sliding_window": 64,         # a local layer's query sees keys this many positions either side
    "classifier_pooling": "cls",  # num_labels > 0: "cls" or "mean" over the real tokens
    "mup_base_width": 0,          # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}
HEADS = ("head", "decoder", "classifier")   # on top of ModernBertModel (embeddings + layers + final norm)
POOLING = ("cls", "mean")


class Block(nn.Module):
  """x = x + Drop(Attn(LN(x))); x = x + MLP(LN(x)) (GeGLU with model.gated_ffn, dropout inside), as HF's
  ModernBertEncoderLayer. `first`: layer 0, whose attention reads x as it is. `rope_theta` and `window` (None =
  global) make it global or local; the caller's mask must apply the window too."""
  cfg: Any
  first: bool
  rope_theta: float
  window: int | None
  deterministic: bool = True
  kernel_init: layers.Init = nn.initializers.normal(0.02)
  out_init: layers.Init | None = None

  @nn.compact
  def __call__(self, x, mask, positions):
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    norm = lambda name: layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, name=name, **kw)
    h = x if self.first else norm("attention_ln")(x)
    a, _ = attention.Attention(cfg.num_heads, layers.head_dim(cfg), use_bias=False, rope_theta=self.rope_theta,
                               window=self.window, dropout_rate=cfg.attention_dropout_rate,
                               deterministic=self.deterministic, kernel_init=self.kernel_init,
                               out_init=self.out_init, logit_scale=mup.attention_scale(cfg), name="attention",
                               **kw)(h, mask=mask, positions=positions)
    x = x + layers.Dropout(cfg.attention_dropout_rate, deterministic=self.deterministic)(a)
    x = x + layers.MLP(cfg.d_ff, cfg.activation, gated=cfg.gated_ffn, use_bias=False, dropout_rate=cfg.dropout_rate,
                       deterministic=self.deterministic, kernel_init=self.kernel_init, out_init=self.out_init,
                       name="mlp", **kw)(norm("mlp_ln")(x))
    return layers.constrain(x, ("batch", "length", "embed")), None   # (x, cache) as blocks.stack's blocks


class Group(nn.Module):
  """One scanned step: model.global_every - 1 local layers, then a global one (HF's layers 1 + k * global_every ...
  (k + 1) * global_every). Each layer is rematerialised on its own, as a looped one is."""
  cfg: Any
  deterministic: bool = True
  kernel_init: layers.Init = nn.initializers.normal(0.02)
  out_init: layers.Init | None = None

  @nn.compact
  def __call__(self, x, cache, global_mask, local_mask, positions):
    cfg, block = self.cfg, _remat(self.cfg, Block, scanned=True)
    kw = dict(first=False, deterministic=self.deterministic, kernel_init=self.kernel_init, out_init=self.out_init)
    for name in group_names(cfg):
      glob = name == "global"
      x, _ = block(cfg, rope_theta=cfg.rope_theta if glob else cfg.local_rope_theta,
                   window=None if glob else cfg.sliding_window, name=name, **kw)(
                       x, global_mask if glob else local_mask, positions)
    return x, cache


class Head(nn.Module):
  """HF ModernBertPredictionHead: LN(act(dense(x))), no biases."""
  cfg: Any
  kernel_init: layers.Init

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    x = layers.Dense((cfg.d_model,), ("embed", "mlp"), use_bias=False, kernel_init=self.kernel_init, name="dense",
                     **kw)(x)
    return layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, name="ln", **kw)(layers.activation(cfg.activation)(x))


def is_global(cfg, i: int) -> bool:
  return i % cfg.global_every == 0


def group_names(cfg) -> list[str]:
  return [f"local_{j}" for j in range(cfg.global_every - 1)] + ["global"]


def grouped_layers(cfg) -> range:
  """The layers model.scan_layers scans (in groups); the others stay looped."""
  return range(1, 1 + (cfg.num_layers - 1) // cfg.global_every * cfg.global_every) if cfg.scan_layers else range(0)


def _remat(cfg, block, scanned: bool):
  if cfg.remat_policy == "none":
    return block
  return nn.remat(block, policy=layers.REMAT_POLICIES[cfg.remat_policy], prevent_cse=not scanned)


def grouped(cfg, params: dict) -> dict:
  """Looped params (`layers_<i>`) in cfg's layout: with model.scan_layers, grouped_layers' layers stacked into
  the groups under 'layers' (module docstring). A tree of some of the params (adapters) gets the groups it has
  every layer of."""
  inside = grouped_layers(cfg)
  g, names = cfg.global_every, group_names(cfg)
  have = [j for j in range(g) if inside and all(f"layers_{i}" in params for i in inside[j::g])]
  if not have:
    return params
  stack = lambda j: relayout.put_layers([params[f"layers_{i}"] for i in inside[j::g]], scan=True)["layers"]
  moved = {f"layers_{i}" for j in have for i in inside[j::g]}
  return {k: v for k, v in params.items() if k not in moved} | {"layers": {names[j]: stack(j) for j in have}}


def ungrouped(cfg, params: dict) -> dict:
  """Inverse of grouped: every layer under `layers_<i>`."""
  inside = grouped_layers(cfg)
  if not inside or "layers" not in params:
    return params
  g, names, stacked = cfg.global_every, group_names(cfg), params["layers"]
  out = {k: v for k, v in params.items() if k != "layers"}
  for n, i in enumerate(inside):
    if names[n % g] in stacked:
      out[f"layers_{i}"] = jax.tree.map(lambda a: a[n // g], stacked[names[n % g]])
  return out


def place_layer(cfg, i: int):
  """Family.place_layer: a grouped layer sits in its group's sub-layer under 'layers', at its group's index."""
  inside = grouped_layers(cfg)
  if i not in inside:
    return None
  n = i - inside.start
  return ("layers", group_names(cfg)[n % cfg.global_every]), n // cfg.global_every


def relaid(cfg, tree, scan: bool):
  """Family.relaid: `tree` with its layers looped, then (scan) grouped as cfg's layout groups them, at every
  level that holds layers (the params, the adapters under their own key)."""
  if not isinstance(tree, dict):
    return tree
  as_scanned = layers.replace(cfg, scan_layers=True)
  tree = {k: v if k == "layers" or layers.LOOPED.fullmatch(k) else relaid(cfg, v, scan) for k, v in tree.items()}
  tree = ungrouped(as_scanned, jax.device_get(tree))
  return grouped(cfg, tree) if scan else tree


class Model(nn.Module):
  """batch: input_ids (B,L), attention_mask (default 1s), optional mlm_positions (B,P); token_type_ids are
  ignored. -> logits (B,L,V) or (B,P,V) at mlm_positions, and hidden (the final-norm states). A classifier
  (num_labels > 0): logits (B, num_labels), hidden, pooled."""
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False) -> dict:
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    init = nn.initializers.truncated_normal(cfg.initializer_range)
    out_init = nn.initializers.truncated_normal(cfg.initializer_range / math.sqrt(2 * cfg.num_layers))
    ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask", jnp.ones_like(ids))

    embed = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="word_embeddings", **kw)
    x = layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, name="embeddings_ln", **kw)(embed(ids))
    x = layers.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    x = layers.constrain(x, ("batch", "length", "embed"))

    length = ids.shape[1]
    positions = jnp.arange(length)[None]
    masks = {True: attention.make_attention_mask(attention_mask),
             False: attention.make_attention_mask(attention_mask, window=cfg.sliding_window, q_len=length,
                                                  kv_len=length)}
    block, inside = _remat(cfg, Block, scanned=False), grouped_layers(cfg)
    attrs = dict(deterministic=not train, kernel_init=init, out_init=out_init)
    for i in range(cfg.num_layers):
      if i in inside:   # all the groups at the first of their layers
        if i == inside.start:
          x, _ = blocks.stack(Group, len(inside) // cfg.global_every, scan=True, cfg=cfg, **attrs)(
              x, None, masks[True], masks[False], positions)
        continue
      glob = is_global(cfg, i)
      x, _ = block(cfg, first=i == 0, rope_theta=cfg.rope_theta if glob else cfg.local_rope_theta,
                   window=None if glob else cfg.sliding_window, name=f"layers_{i}", **attrs)(x, masks[glob], positions)
    x = layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, name="final_ln", **kw)(x)

    if cfg.get("num_labels", 0):
      if cfg.classifier_pooling == "cls":
        pooled = x[:, 0]
      else:
        m = attention_mask[..., None].astype(x.dtype)
        pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1)
      h = layers.Dropout(cfg.dropout_rate, deterministic=not train)(Head(cfg, out_init, name="head")(pooled))
      logits = layers.Dense((cfg.num_labels,), ("embed", None), kernel_init=init, name="classifier", **kw)(
          mup.readout(cfg, h))
      return {"logits": logits.astype(jnp.float32), "hidden": x, "pooled": pooled}
    h = x
    if "mlm_positions" in batch:
      h = jnp.take_along_axis(x, batch["mlm_positions"][..., None], axis=1)
    bias = self.param("decoder", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,),
                      kw["param_dtype"])
    # the activations' usual sharding before the tied decoder: see bert.MLMHead
    h = layers.constrain(Head(cfg, out_init, name="head")(h), ("batch", "length", "embed"))
    logits = embed.attend(mup.readout(cfg, h)) + bias.astype(kw["dtype"])
    return {"logits": layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32), "hidden": x}


def check_config(cfg) -> None:
  mup.check(cfg)
  n = cfg.get("num_labels", 0)
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"model.num_labels must be a non-negative integer (0 = the MLM head), got {n!r}")
  if cfg.classifier_pooling not in POOLING:
    raise ValueError(f"unknown model.classifier_pooling {cfg.classifier_pooling!r}; known: {', '.join(POOLING)}")
  for name in ("rope_theta", "local_rope_theta"):
    if not cfg[name] > 0:
      raise ValueError(f"model.{name} must be positive, got {cfg[name]!r}")


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "attention_mask": ids + 1}


def forward_flops(cfg, lengths) -> float:
  """The layers (local ones too compute the whole L x L grid, masked), then a classifier (num_labels > 0) on the
  pooled state, or the MLM head (transform + tied decoder) on the scored positions."""
  d, scored = cfg.d_model, lengths.scored
  total = cfg.num_layers * flops.encoder_layer(cfg, lengths.inputs)
  if cfg.get("num_labels", 0):
    return total + flops.dense(1, d, d) + flops.dense(1, d, cfg.num_labels)
  return total + flops.dense(scored, d, d) + flops.dense(scored, d, cfg.vocab_size)


def activation_bytes(cfg, lengths, div) -> int:
  """costs.one_stack (with BERT's head transform) plus what the scanned groups keep beyond it (costs.grouped_extra,
  through costs.with_scanned)."""
  return costs.with_scanned(cfg, lengths, div, costs.grouped_extra, len(grouped_layers(cfg)), head_transform=True)


FAMILY = Family(
    name="modernbert", layout="encoder", Model=Model, example_batch=example_batch, forward_flops=forward_flops,
    fields=FIELDS, sizes=("max_positions", "global_every", "sliding_window"), check_config=check_config, heads=HEADS,
    rescan=lambda source, target, params: grouped(target, ungrouped(source, jax.device_get(params))),
    place_layer=place_layer, relaid=relaid,
    activation_bytes=activation_bytes,
    tokens=Tokens(spm=dict(pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
                           control_symbols=["[CLS]", "[SEP]", "[MASK]"]),
                  required=("pad_id", "cls_id", "sep_id", "mask_id"), template=("cls_id", "$A", "sep_id")))

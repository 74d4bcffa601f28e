"""BERT (Devlin et al. 2019; google-research/bert): post-LN encoder, pooler, MLM and NSP heads.

Params: word/position/token_type embeddings + embeddings_ln, the layer stack (layers.PostLNBlock),
pooler, and the heads 'mlm' (dense + act + LN, decoder tied to the word embeddings, output bias) and
'nsp'. Init is TF BERT's truncated normal (initializer_range). Also the Hugging Face mapping
(BertForPreTraining; encoder-only BertModel checkpoints load with freshly initialised heads).
"""
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.models import layers

HEADS = ("mlm", "nsp")          # on top of BertModel (embeddings + layers + pooler)
_RANDOM_IF_MISSING = ("pooler", "mlm", "nsp")   # absent from encoder-only checkpoints


class MLMHead(nn.Module):
  cfg: Any

  @nn.compact
  def __call__(self, x: jax.Array, embed: layers.Embed) -> jax.Array:
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    init = nn.initializers.truncated_normal(cfg.initializer_range)
    x = layers.Dense((cfg.d_model,), ("embed", "mlp"), kernel_init=init, name="dense", **kw)(x)
    x = layers.LayerNorm(cfg.layer_norm_eps, name="ln", **kw)(layers.activation(cfg.activation)(x))
    # The activations' usual sharding, not the dense's 'mlp' (tensor) one: with that, the gradient dlogits @ embedding
    # is a dot that XLA's SPMD partitioner (jaxlib 0.10.2) gets wrong when mesh data, fsdp and tensor are all > 1:
    # it permutes dlogits' batch shards between data and fsdp and never permutes the product back.
    x = layers.constrain(x, ("batch", "length", "embed"))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,),
                      kw["param_dtype"])
    logits = embed.attend(x) + bias.astype(kw["dtype"])
    return layers.constrain(logits, ("batch", "length", "vocab"))


class Model(nn.Module):
  """batch: input_ids (B,L), token_type_ids, attention_mask (default 0s / 1s), optional mlm_positions
  (B,P). -> logits (B,L,V) or, with mlm_positions, (B,P,V) at those positions only; hidden, pooled,
  nsp_logits."""
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False) -> dict:
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    init = nn.initializers.truncated_normal(cfg.initializer_range)
    ids = batch["input_ids"]
    token_types = batch.get("token_type_ids", jnp.zeros_like(ids))
    attention_mask = batch.get("attention_mask", jnp.ones_like(ids))

    embed = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="word_embeddings", **kw)
    x = embed(ids)
    x += layers.Embed(cfg.max_positions, cfg.d_model, (None, "embed"), embedding_init=init,
                      name="position_embeddings", **kw)(jnp.arange(ids.shape[1])[None])
    x += layers.Embed(cfg.type_vocab_size, cfg.d_model, (None, "embed"), embedding_init=init,
                      name="token_type_embeddings", **kw)(token_types)
    x = layers.LayerNorm(cfg.layer_norm_eps, name="embeddings_ln", **kw)(x)
    x = layers.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    x = layers.constrain(x, ("batch", "length", "embed"))

    mask = layers.make_attention_mask(attention_mask)
    x, _ = layers.stack(layers.PostLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                        cfg=cfg, deterministic=not train, kernel_init=init)(x, None, mask)

    pooled = jnp.tanh(layers.Dense((cfg.d_model,), ("embed", "mlp"), kernel_init=init, name="pooler", **kw)(x[:, 0]))
    nsp_logits = layers.Dense((2,), ("embed", None), kernel_init=init, name="nsp", **kw)(pooled)
    h = x
    if "mlm_positions" in batch:
      h = jnp.take_along_axis(x, batch["mlm_positions"][..., None], axis=1)
    logits = MLMHead(cfg, name="mlm")(h, embed)
    return {"logits": logits.astype(jnp.float32), "hidden": x, "pooled": pooled,
            "nsp_logits": nsp_logits.astype(jnp.float32)}


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "token_type_ids": ids, "attention_mask": ids + 1}


# ---- Hugging Face (BertForPreTraining / BertModel) ----

_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

_LAYER = [
    *[(f"attention.self.{n}.weight", ("attention", n, "kernel"), "T1") for n in ("query", "key", "value")],
    *[(f"attention.self.{n}.bias", ("attention", n, "bias"), "flat") for n in ("query", "key", "value")],
    ("attention.output.dense.weight", ("attention", "out", "kernel"), "T2"),
    ("attention.output.dense.bias", ("attention", "out", "bias"), "same"),
    ("attention.output.LayerNorm.weight", ("attention_ln", "scale"), "same"),
    ("attention.output.LayerNorm.bias", ("attention_ln", "bias"), "same"),
    ("intermediate.dense.weight", ("mlp", "wi", "kernel"), "T1"),
    ("intermediate.dense.bias", ("mlp", "wi", "bias"), "same"),
    ("output.dense.weight", ("mlp", "wo", "kernel"), "T1"),
    ("output.dense.bias", ("mlp", "wo", "bias"), "same"),
    ("output.LayerNorm.weight", ("mlp_ln", "scale"), "same"),
    ("output.LayerNorm.bias", ("mlp_ln", "bias"), "same"),
]
_BODY = [   # under "bert." in BertForPreTraining, at the top in BertModel
    ("embeddings.word_embeddings.weight", ("word_embeddings", "embedding"), "same"),
    ("embeddings.position_embeddings.weight", ("position_embeddings", "embedding"), "same"),
    ("embeddings.token_type_embeddings.weight", ("token_type_embeddings", "embedding"), "same"),
    ("embeddings.LayerNorm.weight", ("embeddings_ln", "scale"), "same"),
    ("embeddings.LayerNorm.bias", ("embeddings_ln", "bias"), "same"),
    ("pooler.dense.weight", ("pooler", "kernel"), "T1"),
    ("pooler.dense.bias", ("pooler", "bias"), "same"),
]
_HEADS = [  # under "cls."
    ("predictions.transform.dense.weight", ("mlm", "dense", "kernel"), "T1"),
    ("predictions.transform.dense.bias", ("mlm", "dense", "bias"), "same"),
    ("predictions.transform.LayerNorm.weight", ("mlm", "ln", "scale"), "same"),
    ("predictions.transform.LayerNorm.bias", ("mlm", "ln", "bias"), "same"),
    ("predictions.bias", ("mlm", "bias"), "same"),
    ("seq_relationship.weight", ("nsp", "kernel"), "T1"),
    ("seq_relationship.bias", ("nsp", "bias"), "same"),
]


def hf_config(cfg) -> dict:
  if cfg.num_heads * layers.head_dim(cfg) != cfg.d_model:
    raise ValueError(f"HF BERT needs num_heads * head_dim == d_model, got {cfg.num_heads} * "
                     f"{layers.head_dim(cfg)} != {cfg.d_model}")
  return {
      "architectures": ["BertForPreTraining"], "model_type": "bert",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.d_ff,
      "hidden_act": _ACT_TO_HF[cfg.activation], "hidden_dropout_prob": cfg.dropout_rate,
      "attention_probs_dropout_prob": cfg.attention_dropout_rate, "max_position_embeddings": cfg.max_positions,
      "type_vocab_size": cfg.type_vocab_size, "initializer_range": cfg.initializer_range,
      "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": cfg.pad_token_id,
      "position_embedding_type": "absolute", "tie_word_embeddings": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported (absolute only)")
  if hf["hidden_act"] not in _ACT_FROM_HF:
    raise ValueError(f"unsupported BERT hidden_act {hf['hidden_act']!r}; known: {', '.join(_ACT_FROM_HF)}")
  m = defaults.model_defaults("bert")
  m.vocab_size, m.d_model, m.num_layers = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
  m.num_heads, m.d_ff = hf["num_attention_heads"], hf["intermediate_size"]
  m.activation = _ACT_FROM_HF[hf["hidden_act"]]
  m.dropout_rate, m.attention_dropout_rate = hf["hidden_dropout_prob"], hf["attention_probs_dropout_prob"]
  m.max_positions, m.type_vocab_size = hf["max_position_embeddings"], hf["type_vocab_size"]
  m.initializer_range, m.layer_norm_eps = hf.get("initializer_range", 0.02), hf["layer_norm_eps"]
  m.pad_token_id = hf.get("pad_token_id") or 0
  return m


def to_hf(cfg, params: dict) -> dict:
  out = layers.tree_to_hf(params, _BODY, "bert.") | layers.tree_to_hf(params, _HEADS, "cls.")
  for i, layer in enumerate(layers.get_layers(params, cfg.num_layers)):
    out |= layers.tree_to_hf(layer, _LAYER, f"bert.encoder.layer.{i}.")
  return out


def from_hf(cfg, tensors: dict) -> dict:
  """Params from BertForPreTraining or BertModel tensors. What an encoder-only checkpoint lacks
  (pooler, MLM / NSP heads) is initialised randomly (numpy seed 0) as transformers would, with a warning."""
  from lm_jax import models
  prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""
  if "cls.predictions.bias" not in tensors and "cls.predictions.decoder.bias" in tensors:   # older exports
    tensors = {**tensors, "cls.predictions.bias": tensors["cls.predictions.decoder.bias"]}
  looped = layers.replace(cfg, scan_layers=False)
  shapes = models.abstract_params(looped)
  params, missing = {}, []
  for table, pre in ((_BODY, prefix), (_HEADS, "cls.")):
    for hf, path, kind in table:
      if pre + hf in tensors:
        _set(params, path, layers.from_hf_array(tensors[pre + hf], kind, _get(shapes, path).shape))
      elif path[0] in _RANDOM_IF_MISSING:
        missing.append((pre + hf, path))
      else:
        raise ValueError(f"BERT checkpoint lacks tensor {pre + hf!r}")
  if missing:   # transformers' _init_weights: N(0, initializer_range) kernels, LN 1 / 0, zero biases
    logging.warning("BERT checkpoint lacks %s: initialised randomly", ", ".join(name for name, _ in missing))
    rng = np.random.default_rng(0)
    for _, path in missing:
      shape = _get(shapes, path).shape
      if path[-1] == "kernel":
        _set(params, path, rng.normal(0.0, cfg.initializer_range, shape))
      else:
        _set(params, path, np.ones(shape) if path[-1] == "scale" else np.zeros(shape))
  per_layer = [layers.tree_from_hf(tensors, _LAYER, shapes[f"layers_{i}"], f"{prefix}encoder.layer.{i}.")
               for i in range(cfg.num_layers)]
  params |= layers.put_layers(per_layer, cfg.scan_layers)
  pdt = layers.dtype(cfg.param_dtype)
  return jax.tree.map(lambda a: jnp.asarray(a, pdt), params)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value

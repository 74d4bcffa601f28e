"""BERT (Devlin et al. 2019; google-research/bert): post-LN encoder, pooler, MLM and NSP heads.

Params: word/position/token_type embeddings + embeddings_ln, the layer stack (blocks.PostLNBlock),
pooler, and the heads 'mlm' (dense + act + LN, decoder tied to the word embeddings, output bias) and
'nsp'. Init is TF BERT's truncated normal (initializer_range).

A model config with num_labels > 0 (configs/finetune/bert.py) is a sequence classifier instead (paper §4.1, HF
BertForSequenceClassification): [CLS] -> pooler -> dropout -> linear 'classifier' to num_labels logits (one
for regression), in place of the pre-training heads.
"""
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm_jax import flops
from lm_jax.models import attention, blocks, costs, layers, mup
from lm_jax.models.registry import Family, Tokens

FIELDS = {                 # model config fields of BERT's own, beyond defaults.model_defaults' shared ones
    "max_positions": 512,  # learned position embeddings
    "type_vocab_size": 2,  # token type (segment) embeddings
    "mup_base_width": 0,   # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}
HEADS = ("mlm", "nsp", "classifier")   # on top of BertModel (embeddings + layers + pooler)


class MLMHead(nn.Module):
  cfg: Any

  @nn.compact
  def __call__(self, x: jax.Array, embed: layers.Embed) -> jax.Array:
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    init = nn.initializers.truncated_normal(cfg.initializer_range)
    x = layers.Dense((cfg.d_model,), ("embed", "mlp"), kernel_init=init, name="dense", **kw)(x)
    x = layers.LayerNorm(cfg.layer_norm_eps, name="ln", **kw)(layers.activation(cfg.activation)(x))
    # The activations' usual sharding, not the dense's 'mlp' (tensor) one: with that, the gradient dlogits @ embedding
    # is a dot that XLA's SPMD partitioner (jaxlib 0.10.2) gets wrong when mesh data, fsdp and tensor are all > 1:
    # it permutes dlogits' batch shards between data and fsdp and never permutes the product back.
    x = layers.constrain(x, ("batch", "length", "embed"))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,),
                      kw["param_dtype"])
    logits = embed.attend(mup.readout(cfg, x)) + bias.astype(kw["dtype"])
    return layers.constrain(logits, ("batch", "length", "vocab"))


class Model(nn.Module):
  """batch: input_ids (B,L), token_type_ids, attention_mask (default 0s / 1s), optional mlm_positions
  (B,P). -> logits (B,L,V) or, with mlm_positions, (B,P,V) at those positions only; hidden, pooled,
  nsp_logits. A classifier (cfg.num_labels > 0): logits (B, num_labels), hidden, pooled."""
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False) -> dict:
    cfg = self.cfg
    kw = layers.dtypes(cfg)
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

    mask = attention.make_attention_mask(attention_mask)
    x, _ = blocks.stack(blocks.PostLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                        cfg=cfg, deterministic=not train, kernel_init=init)(x, None, mask)

    pooled = jnp.tanh(layers.Dense((cfg.d_model,), ("embed", "mlp"), kernel_init=init, name="pooler", **kw)(x[:, 0]))
    if cfg.get("num_labels", 0):
      h = layers.Dropout(cfg.dropout_rate, deterministic=not train)(pooled)
      logits = layers.Dense((cfg.num_labels,), ("embed", None), kernel_init=init, name="classifier",
                            **kw)(mup.readout(cfg, h))
      return {"logits": logits.astype(jnp.float32), "hidden": x, "pooled": pooled}
    nsp_logits = layers.Dense((2,), ("embed", None), kernel_init=init, name="nsp", **kw)(mup.readout(cfg, pooled))
    h = x
    if "mlm_positions" in batch:
      h = jnp.take_along_axis(x, batch["mlm_positions"][..., None], axis=1)
    logits = MLMHead(cfg, name="mlm")(h, embed)
    return {"logits": logits.astype(jnp.float32), "hidden": x, "pooled": pooled,
            "nsp_logits": nsp_logits.astype(jnp.float32)}


def check_config(cfg) -> None:
  n = cfg.get("num_labels", 0)
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"model.num_labels must be a non-negative integer (0 = the pre-training heads), got {n!r}")
  mup.check(cfg)


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "token_type_ids": ids, "attention_mask": ids + 1}



def forward_flops(cfg, lengths) -> float:
  """The layers and the pooler on [CLS]; then a classifier (num_labels > 0) on the pooler, or NSP and the MLM head
  (transform + tied decoder) on the scored positions."""
  d, scored = cfg.d_model, lengths.scored
  total = cfg.num_layers * flops.encoder_layer(cfg, lengths.inputs) + flops.dense(1, d, d)
  if cfg.get("num_labels", 0):
    return total + flops.dense(1, d, cfg.num_labels)
  return total + flops.dense(1, d, 2) + flops.dense(scored, d, d) + flops.dense(scored, d, cfg.vocab_size)


FAMILY = Family(
    name="bert", layout="encoder", Model=Model, example_batch=example_batch, forward_flops=forward_flops,
    fields=FIELDS, sizes=("max_positions", "type_vocab_size"), check_config=check_config, heads=HEADS,
    learned_positions=True, activation_bytes=functools.partial(costs.one_stack, head_transform=True),
    tokens=Tokens(spm=dict(pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
                           control_symbols=["[CLS]", "[SEP]", "[MASK]"]),
                  required=("pad_id", "cls_id", "sep_id", "mask_id"), template=("cls_id", "$A", "sep_id"),
                  token_types=True))

"""GPT-1 (Radford et al. 2018; openai/finetune-transformer-lm): post-LN causal decoder.

Token + learned position embeddings, layers.PostLNBlock with a causal mask, LM head tied to the
token embeddings, N(0, initializer_range) init. Packed rows: segment_ids keep documents apart and
positions restart per document. Incremental decoding uses an explicit KV cache (init_cache/decode).
Also the Hugging Face mapping (OpenAIGPTLMHeadModel; its fused c_attn is split into query/key/value).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.models import layers

HEADS = ()


class Model(nn.Module):
  """batch: input_ids (B,T), optional attention_mask (B,T), segment_ids (B,T) (0 = padding),
  positions (B,T). -> logits (B,T,V) for the next token, hidden (B,T,D).

  With `cache` (see init_cache) the tokens are appended at cache['index'] and attend to everything
  cached before them; positions default to index + arange(T); the output also has the new 'cache'.
  """
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False, cache: dict | None = None) -> dict:
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    init = nn.initializers.normal(cfg.initializer_range)
    ids = batch["input_ids"]
    length = ids.shape[1]
    key_mask = batch.get("attention_mask")
    if cache is None:
      index, layer_cache = None, None
      positions = batch.get("positions", jnp.arange(length)[None])
      mask = layers.make_attention_mask(key_mask, causal=True, q_len=length, kv_len=length,
                                        q_segments=batch.get("segment_ids"))
    else:
      index, layer_cache = cache["index"], {"k": cache["k"], "v": cache["v"]}
      new = jnp.ones_like(ids, dtype=bool) if key_mask is None else key_mask.astype(bool)
      key_mask = jax.lax.dynamic_update_slice(cache["mask"], new, (0, index))
      q_index = index + jnp.arange(length)[None]
      positions = batch.get("positions", q_index)
      mask = layers.make_attention_mask(key_mask, causal=True, q_index=q_index,
                                        kv_index=jnp.arange(key_mask.shape[1])[None])

    embed = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="word_embeddings", **kw)
    x = embed(ids) + layers.Embed(cfg.max_positions, cfg.d_model, (None, "embed"), embedding_init=init,
                                  name="position_embeddings", **kw)(positions)
    x = layers.Dropout(cfg.dropout_rate, deterministic=not train)(x)
    x = layers.constrain(x, ("batch", "length", "embed"))
    x, layer_cache = layers.stack(layers.PostLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                                  cfg=cfg, deterministic=not train, kernel_init=init)(x, layer_cache, mask, index)
    logits = layers.constrain(embed.attend(x), ("batch", "length", "vocab")).astype(jnp.float32)
    out = {"logits": logits, "hidden": x}
    if cache is not None:
      out["cache"] = {**layer_cache, "mask": key_mask, "index": index + length}
    return out


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "attention_mask": ids + 1}


def init_cache(cfg, params: dict, batch: dict, max_length: int) -> dict:
  """Empty cache for batch['input_ids'].shape[0] rows (params unused: the signature is shared with T5):
  k/v (layers, B, max_length, heads, head_dim) in model.dtype, mask (B, max_length) of filled slots,
  index = next slot."""
  del params
  if max_length > cfg.max_positions:
    raise ValueError(f"cache max_length {max_length} exceeds model.max_positions {cfg.max_positions}")
  batch_size = batch["input_ids"].shape[0]
  shape = (cfg.num_layers, batch_size, max_length, cfg.num_heads, layers.head_dim(cfg))
  zeros = jnp.zeros(shape, layers.dtype(cfg.dtype))
  return {"k": zeros, "v": zeros, "mask": jnp.zeros((batch_size, max_length), bool), "index": jnp.zeros((), jnp.int32)}


def decode_step(cfg, params: dict, input_ids: jax.Array, cache: dict, attention_mask: jax.Array | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Appends input_ids (B,T) at cache['index'] -> (logits (B,T,V), cache). attention_mask marks padding
  among the new tokens; positions default to index + arange(T). The first call can feed the prompt."""
  batch = {"input_ids": input_ids}
  if attention_mask is not None:
    batch["attention_mask"] = attention_mask
  if positions is not None:
    batch["positions"] = positions
  out = Model(layers.frozen(cfg)).apply({"params": params}, batch, cache=cache)
  return out["logits"], out["cache"]


# ---- Hugging Face (OpenAIGPTLMHeadModel) ----

_ACT_TO_HF = {"gelu_tanh": "gelu", "relu": "relu"}   # HF's openai "gelu" is the tanh form
_ACT_FROM_HF = {"gelu": "gelu_tanh", "relu": "relu"}
_QKV = ("query", "key", "value")

_LAYER = [   # c_attn is fused in HF: split into the pseudo names attn.<query|key|value>.*
    *[(f"attn.{n}.weight", ("attention", n, "kernel"), "C1") for n in _QKV],
    *[(f"attn.{n}.bias", ("attention", n, "bias"), "flat") for n in _QKV],
    ("attn.c_proj.weight", ("attention", "out", "kernel"), "C2"),
    ("attn.c_proj.bias", ("attention", "out", "bias"), "same"),
    ("ln_1.weight", ("attention_ln", "scale"), "same"),
    ("ln_1.bias", ("attention_ln", "bias"), "same"),
    ("mlp.c_fc.weight", ("mlp", "wi", "kernel"), "C1"),
    ("mlp.c_fc.bias", ("mlp", "wi", "bias"), "same"),
    ("mlp.c_proj.weight", ("mlp", "wo", "kernel"), "C1"),
    ("mlp.c_proj.bias", ("mlp", "wo", "bias"), "same"),
    ("ln_2.weight", ("mlp_ln", "scale"), "same"),
    ("ln_2.bias", ("mlp_ln", "bias"), "same"),
]
_TOP = [
    ("transformer.tokens_embed.weight", ("word_embeddings", "embedding"), "same"),
    ("transformer.positions_embed.weight", ("position_embeddings", "embedding"), "same"),
]


def hf_config(cfg) -> dict:
  if cfg.num_heads * layers.head_dim(cfg) != cfg.d_model or cfg.d_ff != 4 * cfg.d_model:
    raise ValueError("HF OpenAIGPT needs num_heads * head_dim == d_model and d_ff == 4 * d_model, got "
                     f"{cfg.num_heads} * {layers.head_dim(cfg)}, d_model {cfg.d_model}, d_ff {cfg.d_ff}")
  if cfg.activation not in _ACT_TO_HF:
    raise ValueError(f"HF OpenAIGPT has no activation {cfg.activation!r}; use one of {', '.join(_ACT_TO_HF)}")
  return {
      "architectures": ["OpenAIGPTLMHeadModel"], "model_type": "openai-gpt",
      "vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions, "n_embd": cfg.d_model,
      "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "afn": _ACT_TO_HF[cfg.activation],
      "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
      "layer_norm_epsilon": cfg.layer_norm_eps, "initializer_range": cfg.initializer_range,
      "tie_word_embeddings": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  if hf["afn"] not in _ACT_FROM_HF:
    raise ValueError(f"unsupported OpenAIGPT afn {hf['afn']!r}; known: {', '.join(_ACT_FROM_HF)}")
  m = defaults.model_defaults("gpt")
  m.vocab_size, m.max_positions, m.d_model = hf["vocab_size"], hf["n_positions"], hf["n_embd"]
  m.num_layers, m.num_heads, m.d_ff = hf["n_layer"], hf["n_head"], 4 * hf["n_embd"]
  m.activation = _ACT_FROM_HF[hf["afn"]]
  m.dropout_rate, m.attention_dropout_rate = hf["resid_pdrop"], hf["attn_pdrop"]
  m.layer_norm_eps, m.initializer_range = hf["layer_norm_epsilon"], hf.get("initializer_range", 0.02)
  return m


def to_hf(cfg, params: dict) -> dict:
  out = layers.tree_to_hf(params, _TOP)
  for i, layer in enumerate(layers.get_layers(params, cfg.num_layers)):
    t = layers.tree_to_hf(layer, _LAYER, f"transformer.h.{i}.")
    for part in ("weight", "bias"):
      pieces = [t.pop(f"transformer.h.{i}.attn.{n}.{part}") for n in _QKV]
      t[f"transformer.h.{i}.attn.c_attn.{part}"] = np.concatenate(pieces, axis=-1)
    out |= t
  return out


def from_hf(cfg, tensors: dict) -> dict:
  from lm_jax import models
  shapes = models.abstract_params(layers.replace(cfg, scan_layers=False))
  tensors = dict(tensors)
  for i in range(cfg.num_layers):
    for part in ("weight", "bias"):
      fused = tensors.pop(f"transformer.h.{i}.attn.c_attn.{part}")
      for n, piece in zip(_QKV, np.split(fused, 3, axis=-1)):
        tensors[f"transformer.h.{i}.attn.{n}.{part}"] = piece
  params = layers.tree_from_hf(tensors, _TOP, shapes)
  per_layer = [layers.tree_from_hf(tensors, _LAYER, shapes[f"layers_{i}"], f"transformer.h.{i}.")
               for i in range(cfg.num_layers)]
  params |= layers.put_layers(per_layer, cfg.scan_layers)
  pdt = layers.dtype(cfg.param_dtype)
  return jax.tree.map(lambda a: jnp.asarray(a, pdt), params)

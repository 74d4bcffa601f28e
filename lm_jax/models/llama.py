"""Llama (Touvron et al. 2023; HF LlamaForCausalLM): a pre-norm causal decoder of today's parts.

Token embeddings only (positions are rotary, applied to queries and keys in every layer), blocks.PreLNBlock with
RMSNorm, grouped-query attention (model.num_kv_heads), rotary positions (model.rope_theta) and a SwiGLU MLP (silu
+ gated_ffn) without biases, a final RMSNorm, and an LM head tied to the embeddings or its own ('lm_head',
model.tie_embeddings=False). Qwen3 (lm_jax/models/qwen3.py) is this Model with QK-norm and a free head_dim.
GPT-1's batch, cache and outputs (lm_jax/models/gpt.py: packed rows, left-padded decoding, the 'classifier'
head with num_labels > 0); the KV cache holds the kv heads only. Of the shared fields, Llama's are activation
'silu', gated_ffn True, layer_norm_eps 1e-6 (HF rms_norm_eps) and no dropout: configs/llama.py and hf/llama.py
set them.
"""
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from lm_jax.models import blocks, costs, gpt, layers, mup
from lm_jax.models.registry import Family

HEADS = gpt.HEADS

FIELDS = {                  # its own model config fields beyond the shared ones, with HF LlamaConfig's defaults
    "max_positions": 2048,  # the context it is trained for (rotary positions set no hard limit)
    "num_kv_heads": 0,      # 0 = num_heads; fewer: grouped-query attention, 1: multi-query
    "rope_theta": 10000.0,  # rotary base
    "qk_norm": False,       # an RMSNorm over each query / key head (Qwen3)
    "norm": "rmsnorm",      # or "layernorm"
    "use_bias": False,
    "tie_embeddings": False,  # the LM head is the token embedding table
    "mup_base_width": 0,    # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}


class Model(nn.Module):
  """gpt.Model's batch, cache and outputs (logits, hidden, scores with num_labels > 0)."""
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False, cache: dict | None = None) -> dict:
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    init = nn.initializers.normal(cfg.initializer_range)
    positions, mask, layer_cache, index, key_mask = gpt.causal_inputs(batch, cache)
    embed = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="word_embeddings", **kw)
    x = layers.Dropout(cfg.dropout_rate, deterministic=not train)(embed(batch["input_ids"]))
    x = layers.constrain(x, ("batch", "length", "embed"))
    x, layer_cache = blocks.stack(blocks.PreLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                                  cfg=cfg, deterministic=not train, kernel_init=init)(x, layer_cache, mask, index,
                                                                                      positions)
    x = layers.norm(cfg, name="final_ln", **kw)(x)
    if cfg.tie_embeddings:
      logits = embed.attend(mup.readout(cfg, x))
    else:
      logits = layers.Dense((cfg.vocab_size,), ("embed", "vocab"), use_bias=False, kernel_init=init, name="lm_head",
                            **kw)(mup.readout(cfg, x))
    out = {"logits": layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32), "hidden": x}
    if cfg.get("num_labels", 0):
      out["scores"] = layers.Dense((cfg.num_labels,), ("embed", None), kernel_init=init, name="classifier",
                                   **kw)(mup.readout(cfg, x)).astype(jnp.float32)
    if cache is not None:
      out["cache"] = {"layers": layer_cache, "mask": key_mask, "index": index + batch["input_ids"].shape[1]}
    return out


def check_config(cfg) -> None:
  """Beyond the generic checks (models.validate: heads, kv heads): the rotary and norm fields."""
  gpt.check_config(cfg)
  if layers.head_dim(cfg) % 2:
    raise ValueError(f"rotary positions need an even head_dim (model.head_dim or d_model / num_heads), got "
                     f"{layers.head_dim(cfg)}")
  if not cfg.get("rope_theta", 0) > 0:
    raise ValueError(f"model.rope_theta must be positive, got {cfg.get('rope_theta')!r}")
  if cfg.get("norm") not in layers.NORMS:
    raise ValueError(f"unknown model.norm {cfg.get('norm')!r}; known: {', '.join(layers.NORMS)}")


def init_cache(cfg, params: dict, batch: dict, max_length: int) -> dict:
  """gpt.init_cache's cache with num_kv_heads heads: per layer {'k', 'v'} (B, num_kv_heads, max_length,
  head_dim)."""
  del params
  batch_size = batch["input_ids"].shape[0]
  shape = (batch_size, costs.kv_heads(cfg), max_length, layers.head_dim(cfg))
  zeros = lambda: jnp.zeros(shape, layers.dtype(cfg.dtype))
  return {"layers": tuple({"k": zeros(), "v": zeros()} for _ in range(cfg.num_layers)),
          "mask": jnp.zeros((batch_size, max_length), bool), "index": jnp.zeros((), jnp.int32)}


def family(name: str, fields: dict) -> Family:
  """The Family record of this Model under `name` with its FIELDS (llama; qwen3 reuses it). FLOPs are the shared
  count, which reads num_kv_heads, head_dim and gated_ffn (lm_jax/flops.py); activation bytes the shared count plus
  what a scanned stack of these layers keeps beyond it (costs.pre_norm_stack)."""
  return Family(name=name, layout="decoder", Model=Model, example_batch=gpt.example_batch,
                forward_flops=gpt.forward_flops, tokens=gpt.TOKENS, fields=fields, sizes=("max_positions",),
                check_config=check_config, heads=HEADS, kv_cache_bytes=costs.decoder_cache, init_cache=init_cache,
                activation_bytes=costs.pre_norm_stack,
                decode_step=functools.partial(gpt.decode_step, model=Model))


FAMILY = family("llama", FIELDS)

"""The transformer blocks (post-LN: BERT, GPT-1; pre-norm: GPT-2, Llama, Qwen3, composed from the config's choices;
T5 has its own) and the layer stack, scanned or looped.

Scanned params live under `<name>` with a leading 'layers' axis, looped ones under `<name>_0`, `<name>_1`, ...;
lm_jax.models.relayout converts between the two.
"""
from typing import Any, Callable

import flax.linen as nn
import jax

from lm_jax.models import attention, layers, mup


class PostLNBlock(nn.Module):
  """BERT / GPT-1 layer: x = LN(x + Drop(Attn(x))); x = LN(x + Drop(layers.MLP(x))). cfg: the model config."""
  cfg: Any
  deterministic: bool = True
  kernel_init: layers.Init = nn.initializers.normal(0.02)

  @nn.compact
  def __call__(self, x, cache, mask, cache_index=None):
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    drop = layers.Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    a, cache = attention.Attention(cfg.num_heads, layers.head_dim(cfg), dropout_rate=cfg.attention_dropout_rate,
                                   deterministic=self.deterministic, kernel_init=self.kernel_init,
                                   logit_scale=mup.attention_scale(cfg), name="attention", **kw)(
                                       x, mask=mask, cache=cache, cache_index=cache_index)
    x = layers.LayerNorm(cfg.layer_norm_eps, name="attention_ln", **kw)(x + drop(a))
    h = layers.MLP(cfg.d_ff, cfg.activation, kernel_init=self.kernel_init, name="mlp", **kw)(x)
    x = layers.LayerNorm(cfg.layer_norm_eps, name="mlp_ln", **kw)(x + drop(h))
    return layers.constrain(x, ("batch", "length", "embed")), cache


class PreLNBlock(nn.Module):
  """Pre-norm layer: x = x + Drop(Attn(Norm(x))); x = x + Drop(layers.MLP(Norm(x))). out_init: the residual
  projections' init (GPT-2 scales it by 1/sqrt(2 * layers)).

  Composed from the model config's values, each optional with the default GPT-2 has: use_bias (False drops every
  bias: nanoGPT, Llama), norm ('layernorm' | 'rmsnorm', layers.norm), num_kv_heads (0 = num_heads; GQA / MQA),
  rope_theta (> 0: rotary positions, read from the `positions` argument), qk_norm, sliding_window (0 = off; the
  caller's mask applies it), activation and gated_ffn (SwiGLU = silu + gated, GeGLU = gelu + gated).
  """
  cfg: Any
  deterministic: bool = True
  kernel_init: layers.Init = nn.initializers.normal(0.02)
  out_init: layers.Init | None = None

  @nn.compact
  def __call__(self, x, cache, mask, cache_index=None, positions=None):
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    bias = cfg.get("use_bias", True)
    drop = layers.Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    h = layers.norm(cfg, name="attention_ln", **kw)(x)
    a, cache = attention.Attention(cfg.num_heads, layers.head_dim(cfg), num_kv_heads=cfg.get("num_kv_heads", 0),
                                   qk_norm=cfg.get("qk_norm", False), qk_norm_eps=cfg.layer_norm_eps,
                                   rope_theta=cfg.get("rope_theta", 0.0), window=cfg.get("sliding_window", 0) or None,
                                   use_bias=bias, dropout_rate=cfg.attention_dropout_rate,
                                   deterministic=self.deterministic, kernel_init=self.kernel_init,
                                   out_init=self.out_init, logit_scale=mup.attention_scale(cfg), name="attention",
                                   **kw)(h, mask=mask, cache=cache, cache_index=cache_index, positions=positions)
    x = x + drop(a)
    h = layers.norm(cfg, name="mlp_ln", **kw)(x)
    x = x + drop(layers.MLP(cfg.d_ff, cfg.activation, gated=cfg.get("gated_ffn", False), use_bias=bias,
                            kernel_init=self.kernel_init, out_init=self.out_init, name="mlp", **kw)(h))
    return layers.constrain(x, ("batch", "length", "embed")), cache


def stack(block: type[nn.Module], num_layers: int, *, scan: bool, remat: str = "none", name: str = "layers",
          **block_attrs) -> Callable[..., tuple[jax.Array, Any]]:
  """`num_layers` copies of `block`, created in the calling module's compact method.

  The block is called as block(x, cache, *shared) -> (x, cache): `cache` is that layer's own cache (or None),
  `shared` (masks, biases, encoder output, cache index) is the same for every layer. Returns f(x, cache, *shared)
  -> (x, new cache), the cache a tuple with one entry per layer: each layer's buffers stay apart, so a decoding
  loop updates them in place and never slices or restacks a cache of all layers (looped layers only; decoding
  unstacks scanned params first, see unscanned).
  scan=True: nn.scan, params (and the layers.ADAPTERS and layers.QUANTISED collections) under `name` with a
  leading 'layers' axis (compile time independent of depth); False: a python loop over `name_0` ... Remat policy
  per layers.REMAT_POLICIES.
  """
  if remat not in layers.REMAT_POLICIES:
    raise ValueError(f"unknown remat_policy {remat!r}; known: {', '.join(layers.REMAT_POLICIES)}")
  if remat != "none":
    block = nn.remat(block, policy=layers.REMAT_POLICIES[remat], prevent_cse=not scan)
  if scan:
    def scanned(x, cache, *shared):
      if cache is not None:
        raise ValueError("a KV cache needs looped layers: decode with relayout.unscanned(cfg, params)")
      layer = nn.scan(block, variable_axes={"params": 0, layers.ADAPTERS: 0, layers.QUANTISED: 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=(0,) + (nn.broadcast,) * len(shared),
                      length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      return layer(name=name, **block_attrs)(x, cache, *shared)
    return scanned

  def looped(x, cache, *shared):
    new = []
    for i in range(num_layers):
      x, layer_cache = block(name=f"{name}_{i}", **block_attrs)(x, None if cache is None else cache[i], *shared)
      new.append(layer_cache)
    return x, None if cache is None else tuple(new)
  return looped

"""GPT-2 (Radford et al. 2019; HF GPT2LMHeadModel): pre-LN causal decoder.

GPT-1's inputs and outputs (lm_jax/models/gpt.py: learned positions, tied LM head, the optional 'classifier' head
with num_labels > 0, segment ids and positions of packed rows, the same KV cache) with GPT-2's changes (paper §2.3):
blocks.PreLNBlock, a final LayerNorm before the head, and the residual projections (attention out, MLP wo)
initialised N(0, initializer_range / sqrt(2 * num_layers)). model.use_bias=False drops every Dense and LayerNorm
bias (nanoGPT's bias=False).
"""
import functools
import math
from typing import Any

import flax.linen as nn

from lm_jax.models import blocks, costs, gpt, layers
from lm_jax.models.registry import Family

FIELDS = {                 # model config fields of GPT-2's own, beyond defaults.model_defaults' shared ones
    "max_positions": 512,  # learned position embeddings
    "use_bias": True,      # biases in the Dense and LayerNorm layers (nanoGPT's bias=False)
    "mup_base_width": 0,   # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}
HEADS = gpt.HEADS


class Model(nn.Module):
  """gpt.Model's batch, cache and outputs."""
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False, cache: dict | None = None) -> dict:
    cfg = self.cfg
    init = nn.initializers.normal(cfg.initializer_range)
    out_init = nn.initializers.normal(cfg.initializer_range / math.sqrt(2 * cfg.num_layers))
    positions, mask, layer_cache, index, key_mask = gpt.causal_inputs(batch, cache)
    x, embed = gpt.embed_inputs(cfg, batch["input_ids"], positions, train)
    x, layer_cache = blocks.stack(blocks.PreLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                                  cfg=cfg, deterministic=not train, kernel_init=init,
                                  out_init=out_init)(x, layer_cache, mask, index)
    x = layers.LayerNorm(cfg.layer_norm_eps, use_bias=cfg.get("use_bias", True), name="final_ln",
                         **layers.dtypes(cfg))(x)
    out = gpt.outputs(cfg, x, embed)
    if cache is not None:
      out["cache"] = {"layers": layer_cache, "mask": key_mask, "index": index + batch["input_ids"].shape[1]}
    return out


FAMILY = Family(name="gpt2", layout="decoder", Model=Model, example_batch=gpt.example_batch,
                forward_flops=gpt.forward_flops, tokens=gpt.TOKENS, fields=FIELDS, sizes=("max_positions",),
                check_config=gpt.check_config, heads=HEADS, learned_positions=True,
                kv_cache_bytes=costs.decoder_cache, init_cache=gpt.init_cache,
                decode_step=functools.partial(gpt.decode_step, model=Model))

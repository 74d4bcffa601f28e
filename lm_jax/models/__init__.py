"""Models API: init / abstract_params / logical_axes / apply / decoding, dispatched on model_cfg.family.

The family modules hold architecture only (Hugging Face conversion is lm_jax.hf). Each (bert.py, gpt.py,
t5.py) provides
  Model                 linen Module; Model(cfg)(batch, train=False) -> dict of outputs, where cfg is the
                        model config as a FrozenConfigDict (layers.frozen)
  example_batch(cfg)    a tiny batch of the family's input keys, for init / eval_shape
  check_config(cfg)     (optional) family-specific checks, run after the generic ones in validate
  HEADS                 (optional) top-level param names that are task heads (summary counts them apart)
  init_cache, decode_step   (decoders) incremental decoding with an explicit KV-cache pytree
"""
import importlib
import math

import flax.linen as nn
import jax

from lm_jax.models import layers
from lm_jax.models.variables import ADAPTERS, adapter, check_plain, of_params

FAMILIES = ("bert", "gpt", "t5")
REFERENCE = "reference"   # the params subtree of a model.frozen_reference copy


def family_name(model_cfg_or_family) -> str:
  """'bert', 'gpt' or 't5', given the name or a model config; a one-line ValueError for any other."""
  family = getattr(model_cfg_or_family, "family", model_cfg_or_family)
  if family not in FAMILIES:
    raise ValueError(f"unknown model.family {family!r}; known: {', '.join(FAMILIES)}")
  return family


def family_module(model_cfg_or_family):
  """The module of a family ('bert', 'gpt', 't5'), given its name or a model config."""
  return importlib.import_module(f"lm_jax.models.{family_name(model_cfg_or_family)}")


def validate(model_cfg) -> None:
  """One-line ValueError for a config no model can be built from."""
  family_module(model_cfg)
  get = model_cfg.get
  sizes = ["vocab_size", "d_model", "num_layers", "num_heads", "d_ff"]
  sizes += {"bert": ["max_positions", "type_vocab_size"], "gpt": ["max_positions"],
            "t5": ["relative_attention_num_buckets", "relative_attention_max_distance"]}[model_cfg.family]
  for name in sizes:
    if not isinstance(get(name), int) or get(name) <= 0:
      raise ValueError(f"model.{name} must be a positive integer, got {get(name)!r}")
  for name in ("head_dim", "num_decoder_layers"):
    if not isinstance(get(name, 0), int) or get(name, 0) < 0:
      raise ValueError(f"model.{name} must be a non-negative integer (0 = default), got {get(name)!r}")
  if not get("head_dim", 0) and model_cfg.d_model % model_cfg.num_heads:
    raise ValueError(f"model.num_heads={model_cfg.num_heads} does not divide model.d_model={model_cfg.d_model}; "
                     "change one or set model.head_dim")
  for name, known in (("activation", layers.ACTIVATIONS), ("dtype", layers.DTYPES), ("param_dtype", layers.DTYPES),
                      ("remat_policy", layers.REMAT_POLICIES)):
    if get(name) not in known:
      raise ValueError(f"unknown model.{name} {get(name)!r}; known: {', '.join(known)}")
  for name in ("dropout_rate", "attention_dropout_rate"):
    if not 0.0 <= get(name, 0.0) < 1.0:
      raise ValueError(f"model.{name} must be in [0, 1), got {get(name)!r}")
  if not get("layer_norm_eps", 1.0) > 0:
    raise ValueError(f"model.layer_norm_eps must be positive, got {get('layer_norm_eps')!r}")
  check = getattr(family_module(model_cfg), "check_config", None)
  if check:
    check(model_cfg)


def _boxed_init(model_cfg, rng):
  """With model.frozen_reference the params also hold a copy of themselves under REFERENCE (the frozen reference
  model of DPO, lm_jax/objectives/dpo.py; finetune freezes it and fills it from init_from); apply ignores it."""
  cfg = layers.frozen(model_cfg)
  mod = family_module(cfg)
  params = mod.Model(cfg).init({"params": rng}, mod.example_batch(cfg))["params"]
  return {**params, REFERENCE: params} if cfg.get("frozen_reference", False) else params


def init(model_cfg, rng: jax.Array) -> dict:
  """Random params (a plain pytree of arrays in model.param_dtype)."""
  validate(model_cfg)
  return jax.jit(lambda r: nn.meta.unbox(_boxed_init(model_cfg, r)))(rng)


def abstract_params(model_cfg) -> dict:
  """Param shapes and dtypes as ShapeDtypeStructs, allocating nothing."""
  validate(model_cfg)
  return jax.eval_shape(lambda: nn.meta.unbox(_boxed_init(model_cfg, jax.random.PRNGKey(0))))


def logical_axes(model_cfg) -> dict:
  """PartitionSpecs of logical axis names, same tree structure as the params."""
  validate(model_cfg)
  return nn.get_partition_spec(jax.eval_shape(lambda: _boxed_init(model_cfg, jax.random.PRNGKey(0))))


def apply(model_cfg, params: dict, batch: dict, *, rng: jax.Array | None = None, train: bool = False) -> dict:
  """Forward pass; dropout only when train=True (rng required then)."""
  variables = of_params(params)
  if train and rng is None:
    raise ValueError("models.apply(train=True) needs an rng for dropout")
  cfg = layers.frozen(model_cfg)
  rngs = {"dropout": rng} if train else {}
  return family_module(cfg).Model(cfg).apply(variables, batch, train=train, rngs=rngs)


def init_cache(model_cfg, params: dict, batch: dict, max_length: int) -> dict:
  """KV cache for decoding up to `max_length` positions. GPT: sized for batch['input_ids'] (params
  unused); T5: also runs the encoder on batch['input_ids'/'attention_mask'] once."""
  check_plain(params)
  return family_module(model_cfg).init_cache(layers.frozen(model_cfg), params, batch, max_length)


def decode_step(model_cfg, params: dict, input_ids: jax.Array, cache: dict,
                attention_mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Feeds the next (decoder) tokens (B,T) at cache['index'] -> (their logits (B,T,V), updated cache).
  attention_mask (B,T) marks padding among the new tokens. Jit it with model_cfg closed over."""
  check_plain(params)
  return family_module(model_cfg).decode_step(layers.frozen(model_cfg), params, input_ids, cache, attention_mask)


def count(tree) -> int:
  """Number of scalars in a param (or ShapeDtypeStruct) tree."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))

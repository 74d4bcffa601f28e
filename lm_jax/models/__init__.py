"""Models API: init / abstract_params / logical_axes / apply / decoding, dispatched on model_cfg.family.

A model family is the unit of extension: one module here holds its architecture and declares its `FAMILY` record
(lm_jax.models.registry.Family: layout, Model, example_batch, its config fields, config checks, FLOPs, activation
and KV-cache bytes, tokenizer specials, decoding),
registered below with one line; its Hugging Face conversion is lm_jax/hf/<family>.py. The rest of the code asks
`family(model_cfg)` and never compares family names.
"""
import functools
import json
import math

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import PartitionSpec as P

from lm_jax.models import attention, bert, costs, gpt, gpt2, layers, llama, modernbert, qwen3, t5
from lm_jax.models.registry import LAYOUTS, Family, family, names, register
from lm_jax.models.variables import ADAPTERS, adapter, check_plain, of_params

REFERENCE = "reference"   # the params subtree of a model.frozen_reference copy
_SIZES = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff")   # every family's positive integers


register(bert.FAMILY)
register(gpt.FAMILY)
register(t5.FAMILY)
register(gpt2.FAMILY)
register(llama.FAMILY)
register(qwen3.FAMILY)
register(modernbert.FAMILY)


def validate(model_cfg) -> None:
  """One-line ValueError for a config no model can be built from."""
  fam = family(model_cfg)
  get = model_cfg.get
  for name in _SIZES + fam.sizes:
    if not isinstance(get(name), int) or get(name) <= 0:
      raise ValueError(f"model.{name} must be a positive integer, got {get(name)!r}")
  for name in ("head_dim", "num_kv_heads"):
    if not isinstance(get(name, 0), int) or get(name, 0) < 0:
      raise ValueError(f"model.{name} must be a non-negative integer (0 = default), got {get(name)!r}")
  if not get("head_dim", 0) and model_cfg.d_model % model_cfg.num_heads:
    raise ValueError(f"model.num_heads={model_cfg.num_heads} does not divide model.d_model={model_cfg.d_model}; "
                     "change one or set model.head_dim")
  if model_cfg.num_heads % costs.kv_heads(model_cfg):
    raise ValueError(f"model.num_kv_heads={model_cfg.num_kv_heads} does not divide model.num_heads="
                     f"{model_cfg.num_heads}")
  for name, known in (("activation", layers.ACTIVATIONS), ("dtype", layers.DTYPES), ("param_dtype", layers.DTYPES),
                      ("remat_policy", layers.REMAT_POLICIES)):
    if get(name) not in known:
      raise ValueError(f"unknown model.{name} {get(name)!r}; known: {', '.join(known)}")
  if get("attention", "xla") not in attention.ATTENTION_KERNELS:
    raise ValueError(f"unknown model.attention {get('attention')!r}; known: {', '.join(attention.ATTENTION_KERNELS)}")
  if get("attention", "xla") != "xla" and get("attention_dropout_rate", 0.0) > 0:
    raise ValueError(f"model.attention={get('attention')!r} has no dropout on the attention probabilities: set "
                     "model.attention_dropout_rate=0 or model.attention='xla'")
  for name in ("dropout_rate", "attention_dropout_rate"):
    if not 0.0 <= get(name, 0.0) < 1.0:
      raise ValueError(f"model.{name} must be in [0, 1), got {get(name)!r}")
  if not get("layer_norm_eps", 1.0) > 0:
    raise ValueError(f"model.layer_norm_eps must be positive, got {get('layer_norm_eps')!r}")
  fam.check_config(model_cfg)


def _boxed_init(model_cfg, rng):
  """With model.frozen_reference the params also hold a copy of themselves under REFERENCE (the frozen reference
  model of DPO, lm_jax/objectives/dpo.py; finetune freezes it and fills it from init_from); apply ignores it."""
  cfg = layers.frozen(model_cfg)
  fam = family(cfg)
  params = fam.Model(cfg).init({"params": rng}, fam.example_batch(cfg))["params"]
  return {**params, REFERENCE: params} if cfg.get("frozen_reference", False) else params


def init(model_cfg, rng: jax.Array) -> dict:
  """Random params (a plain pytree of arrays in model.param_dtype)."""
  validate(model_cfg)
  return jax.jit(lambda r: nn.meta.unbox(_boxed_init(model_cfg, r)))(rng)


def cache_key(cfg) -> str:
  """A config as a cache key: its JSON with sorted keys, so an equal config built in another field order (a
  copy through to_dict, as layers.replace makes) finds the same entry."""
  return cfg.to_json(sort_keys=True)


@functools.lru_cache(maxsize=32)
def _boxed_shapes(model_json: str) -> dict:
  """The boxed param tree as ShapeDtypeStructs. A run asks for shapes and axes several times (setup, layout, checks,
  the params policy); tracing the model's init once per config saves a trace each time."""
  cfg = ml_collections.ConfigDict(json.loads(model_json))
  return jax.eval_shape(lambda: _boxed_init(cfg, jax.random.PRNGKey(0)))


def abstract_params(model_cfg) -> dict:
  """Param shapes and dtypes as ShapeDtypeStructs, allocating nothing."""
  validate(model_cfg)
  return jax.eval_shape(nn.meta.unbox, _boxed_shapes(cache_key(model_cfg)))   # traced: unbox may constrain sharding


def logical_axes(model_cfg) -> dict:
  """PartitionSpecs of logical axis names, same tree structure as the params."""
  validate(model_cfg)
  return nn.get_partition_spec(_boxed_shapes(cache_key(model_cfg)))


@functools.lru_cache(maxsize=16)
def _looped(model_json: str) -> tuple[dict, dict]:
  cfg = layers.replace(ml_collections.ConfigDict(json.loads(model_json)), scan_layers=False)
  flat = lambda tree: {"/".join(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, P))}
  return flat(abstract_params(cfg)), flat(logical_axes(cfg))


def looped_params(model_cfg) -> tuple[dict, dict]:
  """({looped path: ShapeDtypeStruct}, {looped path: logical PartitionSpec}) of every param, layers named as when
  looped ('layers_3/mlp/wi/kernel') whether or not the model scans them: the paths freeze patterns and adapter
  targets are written against."""
  return _looped(cache_key(model_cfg))


def apply(model_cfg, params: dict, batch: dict, *, rng: jax.Array | None = None, train: bool = False) -> dict:
  """Forward pass; dropout only when train=True (rng required then)."""
  variables = of_params(params)
  if train and rng is None:
    raise ValueError("models.apply(train=True) needs an rng for dropout")
  cfg = layers.frozen(model_cfg)
  rngs = {"dropout": rng} if train else {}
  with attention.attention_kernel(cfg.get("attention", "xla"), family(cfg).layout == "decoder"):
    return family(cfg).Model(cfg).apply(variables, batch, train=train, rngs=rngs)


def init_cache(model_cfg, params: dict, batch: dict, max_length: int) -> dict:
  """KV cache for decoding up to `max_length` positions. A decoder: sized for batch['input_ids'] (params
  unused); an encoder-decoder also runs the encoder on batch['input_ids'/'attention_mask'] once."""
  check_plain(params)
  _check_decoder(model_cfg)
  return family(model_cfg).init_cache(layers.frozen(model_cfg), params, batch, max_length)


def decode_step(model_cfg, params: dict, input_ids: jax.Array, cache: dict, attention_mask: jax.Array | None = None,
                positions: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Feeds the next (decoder) tokens (B,T) at cache['index'] -> (their logits (B,T,V), updated cache).
  attention_mask (B,T) marks padding among the new tokens; positions (B,T) (decoder-only families: left-padded
  rows count from their first token) default to the cache slots. Jit it with model_cfg closed over."""
  check_plain(params)
  _check_decoder(model_cfg)
  extra = {} if positions is None else {"positions": positions}
  return family(model_cfg).decode_step(layers.frozen(model_cfg), params, input_ids, cache, attention_mask, **extra)


def _check_decoder(model_cfg) -> None:
  if family(model_cfg).decode_step is None:
    raise ValueError(f"model.family={model_cfg.family!r} has no decoder to decode with")


def forward_flops(model_cfg, lengths) -> float:
  """Matmul FLOPs of one forward pass on one example of these flops.Lengths (the family's count)."""
  return float(family(model_cfg).forward_flops(model_cfg, lengths))


def count(tree) -> int:
  """Number of scalars in a param (or ShapeDtypeStruct) tree."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))

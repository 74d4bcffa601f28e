"""Hugging Face OpenAIGPTLMHeadModel. HF fuses the query/key/value projections into one Conv1D, c_attn; the
table names its thirds attn.<query|key|value>.* and to_hf / from_hf fuse and split them."""
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.hf import convert
from lm_jax.models import layers

_ACT_TO_HF = {"gelu_tanh": "gelu", "relu": "relu"}   # HF's openai "gelu" is the tanh form
_ACT_FROM_HF = {"gelu": "gelu_tanh", "relu": "relu"}
_QKV = ("query", "key", "value")
_FUSED = {"weight": ("kernel", "C1"), "bias": ("bias", "flat")}   # c_attn part: (our leaf, kind)

FAMILY, MODEL_TYPE, ARCHITECTURE = "gpt", "openai-gpt", "OpenAIGPTLMHeadModel"
FAN_IN_FAN_OUT = True   # Conv1D weights are (in, out): PEFT's fan_in_fan_out
BASE_PREFIX = ""        # HF module path of the base model's layers, relative to ours

LAYER = [   # c_attn is fused in HF: split into the pseudo names attn.<query|key|value>.*
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
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions, "n_embd": cfg.d_model,
      "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "afn": _ACT_TO_HF[cfg.activation],
      "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
      "layer_norm_epsilon": cfg.layer_norm_eps, "initializer_range": cfg.initializer_range,
      "tie_word_embeddings": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  if hf["afn"] not in _ACT_FROM_HF:
    raise ValueError(f"unsupported OpenAIGPT afn {hf['afn']!r}; known: {', '.join(_ACT_FROM_HF)}")
  m = defaults.model_defaults(FAMILY)
  m.vocab_size, m.max_positions, m.d_model = hf["vocab_size"], hf["n_positions"], hf["n_embd"]
  m.num_layers, m.num_heads, m.d_ff = hf["n_layer"], hf["n_head"], 4 * hf["n_embd"]
  m.activation = _ACT_FROM_HF[hf["afn"]]
  m.dropout_rate, m.attention_dropout_rate = hf["resid_pdrop"], hf["attn_pdrop"]
  m.layer_norm_eps, m.initializer_range = hf["layer_norm_epsilon"], hf.get("initializer_range", 0.02)
  return m


def layers_to_hf(cfg, params: dict) -> dict:
  """The tensors of the layer stack under transformer.h.<i>., c_attn fused (GPT-1 and GPT-2 share them)."""
  out = convert.stack_to_hf(params, cfg.num_layers, LAYER, "transformer.h.{i}.")
  for i in range(cfg.num_layers):
    for part in _FUSED:
      pieces = [out.pop(f"transformer.h.{i}.attn.{n}.{part}") for n in _QKV]
      out[f"transformer.h.{i}.attn.c_attn.{part}"] = np.concatenate(pieces, axis=-1)
  return out


def layers_from_hf(cfg, tensors: dict, shapes: dict) -> dict:
  """Inverse of layers_to_hf: the layer stack's params (in cfg.scan_layers' layout) given the looped `shapes`."""
  tensors = dict(tensors)
  for i in range(cfg.num_layers):
    for part, (leaf, kind) in _FUSED.items():
      *lead, width = convert.hf_shape(shapes[f"layers_{i}"]["attention"]["query"][leaf].shape, kind)
      name = f"transformer.h.{i}.attn.c_attn.{part}"
      fused = convert.checked_tensor(tensors, name, (*lead, 3 * width))
      for n, piece in zip(_QKV, np.split(fused, 3, axis=-1)):
        tensors[f"transformer.h.{i}.attn.{n}.{part}"] = piece
  return convert.stack_from_hf(tensors, LAYER, shapes, cfg.num_layers, "transformer.h.{i}.", cfg.scan_layers)


def to_hf(cfg, params: dict) -> dict:
  return convert.tree_to_hf(params, _TOP) | layers_to_hf(cfg, params)


def from_hf(cfg, tensors: dict) -> dict:
  shapes = convert.looped_shapes(cfg)
  params = convert.tree_from_hf(tensors, _TOP, shapes) | layers_from_hf(cfg, tensors, shapes)
  return convert.as_params(cfg, params)


def table(cfg) -> list:
  """(HF name, looped param path, kind) of every tensor, c_attn's thirds under their pseudo names attn.<query|...>."""
  return _TOP + [(f"transformer.h.{i}.{hf}", (f"layers_{i}", *path), kind)
                 for i in range(cfg.num_layers) for hf, path, kind in LAYER]

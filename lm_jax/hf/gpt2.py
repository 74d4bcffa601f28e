"""Hugging Face GPT2LMHeadModel. The layers are GPT-1's tensors (lm_jax/hf/gpt.py: Conv1D weights (in, out), fused
c_attn), ln_1 / ln_2 in front of attention / MLP; the embeddings are wte / wpe, the final LayerNorm ln_f, and the
LM head is tied to wte (not stored)."""
import ml_collections

from lm_jax import defaults
from lm_jax.hf import convert, gpt
from lm_jax.models import layers

FAMILY, MODEL_TYPE, ARCHITECTURE = "gpt2", "gpt2", "GPT2LMHeadModel"
FAN_IN_FAN_OUT = True   # Conv1D weights are (in, out): PEFT's fan_in_fan_out
BASE_PREFIX = ""        # HF module path of the base model's layers, relative to ours

_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_TOP = [
    ("transformer.wte.weight", ("word_embeddings", "embedding"), "same"),
    ("transformer.wpe.weight", ("position_embeddings", "embedding"), "same"),
    ("transformer.ln_f.weight", ("final_ln", "scale"), "same"),
    ("transformer.ln_f.bias", ("final_ln", "bias"), "same"),
]


def hf_config(cfg) -> dict:
  if cfg.num_heads * layers.head_dim(cfg) != cfg.d_model:
    raise ValueError(f"HF GPT2 needs num_heads * head_dim == d_model, got {cfg.num_heads} * {layers.head_dim(cfg)} "
                     f"!= {cfg.d_model}")
  if cfg.activation not in _ACT_TO_HF:
    raise ValueError(f"HF GPT2 has no activation {cfg.activation!r}; use one of {', '.join(_ACT_TO_HF)}")
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
      "vocab_size": cfg.vocab_size, "n_positions": cfg.max_positions, "n_embd": cfg.d_model,
      "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.d_ff,
      "activation_function": _ACT_TO_HF[cfg.activation],
      "resid_pdrop": cfg.dropout_rate, "embd_pdrop": cfg.dropout_rate, "attn_pdrop": cfg.attention_dropout_rate,
      "layer_norm_epsilon": cfg.layer_norm_eps, "initializer_range": cfg.initializer_range,
      "tie_word_embeddings": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  if hf["activation_function"] not in _ACT_FROM_HF:
    raise ValueError(f"unsupported GPT2 activation_function {hf['activation_function']!r}; known: "
                     f"{', '.join(_ACT_FROM_HF)}")
  if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx") or hf.get(
      "reorder_and_upcast_attn"):
    raise ValueError("GPT2 attention variants (scale_attn_weights=False, scale_attn_by_inverse_layer_idx, "
                     "reorder_and_upcast_attn) are not supported")
  m = defaults.model_defaults(FAMILY)
  m.vocab_size, m.max_positions, m.d_model = hf["vocab_size"], hf["n_positions"], hf["n_embd"]
  m.num_layers, m.num_heads = hf["n_layer"], hf["n_head"]
  m.d_ff = hf.get("n_inner") or 4 * hf["n_embd"]
  m.activation = _ACT_FROM_HF[hf["activation_function"]]
  m.dropout_rate, m.attention_dropout_rate = hf["resid_pdrop"], hf["attn_pdrop"]
  m.layer_norm_eps, m.initializer_range = hf["layer_norm_epsilon"], hf.get("initializer_range", 0.02)
  return m


def to_hf(cfg, params: dict) -> dict:
  return convert.tree_to_hf(params, _TOP) | gpt.layers_to_hf(cfg, params)


def from_hf(cfg, tensors: dict) -> dict:
  shapes = convert.looped_shapes(cfg)
  params = convert.tree_from_hf(tensors, _TOP, shapes) | gpt.layers_from_hf(cfg, tensors, shapes)
  return convert.as_params(cfg, params)


def table(cfg) -> list:
  """(HF name, looped param path, kind) of every tensor, c_attn's thirds under their pseudo names attn.<query|...>."""
  return _TOP + [(f"transformer.h.{i}.{hf}", (f"layers_{i}", *path), kind)
                 for i in range(cfg.num_layers) for hf, path, kind in gpt.LAYER]

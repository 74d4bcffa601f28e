"""Hugging Face LlamaForCausalLM: model.embed_tokens, per layer self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj
as torch Linear weights (out, in), input_layernorm / post_attention_layernorm (RMSNorm weights), model.norm, and
lm_head unless tie_word_embeddings. Rotary positions use the same rotate-half layout (lm_jax/models/rope.py), so the
query / key weights need no permutation. Qwen3ForCausalLM (lm_jax/hf/qwen3.py) is these tensors plus
self_attn.{q,k}_norm, written by the same functions.
"""
import ml_collections

from lm_jax import defaults
from lm_jax.hf import convert
from lm_jax.models import costs, layers

FAMILY, MODEL_TYPE, ARCHITECTURE = "llama", "llama", "LlamaForCausalLM"
FAN_IN_FAN_OUT = False   # torch Linear weights (out, in)
BASE_PREFIX = "model."   # HF module path of the base model's layers, relative to ours

_PROJ = {"q_proj": "query", "k_proj": "key", "v_proj": "value"}
_MLP = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}


def layer_table(cfg) -> list:
  """(HF name, path, kind) of one layer's tensors (a model config with qk_norm adds Qwen3's q_norm / k_norm)."""
  rows = [(f"self_attn.{hf}.weight", ("attention", ours, "kernel"), "T1") for hf, ours in _PROJ.items()]
  rows.append(("self_attn.o_proj.weight", ("attention", "out", "kernel"), "T2"))
  if cfg.qk_norm:
    rows += [(f"self_attn.{hf}_norm.weight", ("attention", f"{ours}_norm", "scale"), "same")
             for hf, ours in (("q", "query"), ("k", "key"))]
  rows += [(f"mlp.{hf}.weight", ("mlp", ours, "kernel"), "T1") for hf, ours in _MLP.items()]
  return rows + [("input_layernorm.weight", ("attention_ln", "scale"), "same"),
                 ("post_attention_layernorm.weight", ("mlp_ln", "scale"), "same")]


def top_table(cfg) -> list:
  rows = [("model.embed_tokens.weight", ("word_embeddings", "embedding"), "same"),
          ("model.norm.weight", ("final_ln", "scale"), "same")]
  return rows if cfg.tie_embeddings else rows + [("lm_head.weight", ("lm_head", "kernel"), "T1")]


def hf_config(cfg, model_type: str = MODEL_TYPE, architecture: str = ARCHITECTURE) -> dict:
  if cfg.norm != "rmsnorm" or cfg.activation != "silu" or not cfg.gated_ffn:
    raise ValueError(f"HF {architecture} needs model.norm='rmsnorm', activation='silu', gated_ffn=True, got "
                     f"{cfg.norm!r}, {cfg.activation!r}, {cfg.gated_ffn}")
  if cfg.use_bias:
    raise ValueError(f"HF {architecture} is written without biases here: set model.use_bias=False")
  if cfg.qk_norm != (model_type == "qwen3"):
    raise ValueError(f"HF {architecture} {'needs' if model_type == 'qwen3' else 'has no'} model.qk_norm")
  config = {
      "architectures": [architecture], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": costs.kv_heads(cfg), "head_dim": layers.head_dim(cfg), "hidden_act": "silu",
      "max_position_embeddings": cfg.max_positions, "rms_norm_eps": cfg.layer_norm_eps,
      "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
      "attention_bias": False, "attention_dropout": cfg.attention_dropout_rate,
      "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_embeddings,
  }
  return config | ({} if model_type == "qwen3" else {"mlp_bias": False})


def config_from_hf(hf: dict, family: str = FAMILY) -> ml_collections.ConfigDict:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"unsupported rope scaling {rope!r}: only the default rotary positions are implemented")
  if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias") or hf.get("attention_bias"):
    raise ValueError("only hidden_act='silu' without mlp_bias / attention_bias is supported")
  if hf.get("use_sliding_window") or hf.get("pretraining_tp", 1) != 1:
    raise ValueError("sliding-window attention and pretraining_tp > 1 are not supported")
  m = defaults.model_defaults(family)
  m.activation, m.gated_ffn, m.dropout_rate = "silu", True, 0.0
  m.vocab_size, m.d_model, m.d_ff = hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"]
  m.num_layers, m.num_heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  m.num_kv_heads = hf.get("num_key_value_heads") or m.num_heads
  m.head_dim = hf.get("head_dim") or m.d_model // m.num_heads
  m.max_positions = hf.get("max_position_embeddings", 2048)
  m.layer_norm_eps = hf.get("rms_norm_eps", 1e-6)
  m.rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  m.attention_dropout_rate = hf.get("attention_dropout", 0.0)
  m.initializer_range = hf.get("initializer_range", 0.02)
  m.tie_embeddings = hf.get("tie_word_embeddings", False)
  m.qk_norm = family == "qwen3"
  return m


def to_hf(cfg, params: dict) -> dict:
  return convert.tree_to_hf(params, top_table(cfg)) | convert.stack_to_hf(params, cfg.num_layers, layer_table(cfg),
                                                                          "model.layers.{i}.")


def from_hf(cfg, tensors: dict) -> dict:
  shapes = convert.looped_shapes(cfg)
  params = convert.tree_from_hf(tensors, top_table(cfg), shapes) | convert.stack_from_hf(
      tensors, layer_table(cfg), shapes, cfg.num_layers, "model.layers.{i}.", cfg.scan_layers)
  return convert.as_params(cfg, params)


def table(cfg) -> list:
  return top_table(cfg) + [(f"model.layers.{i}.{hf}", (f"layers_{i}", *path), kind)
                           for i in range(cfg.num_layers) for hf, path, kind in layer_table(cfg)]

"""Hugging Face T5ForConditionalGeneration (v1.0 and v1.1), including transformers>=5's form of the config."""
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.hf import convert
from lm_jax.models import layers
from lm_jax.models.t5 import num_decoder_layers

FAMILY, MODEL_TYPE, ARCHITECTURE = "t5", "t5", "T5ForConditionalGeneration"
FAN_IN_FAN_OUT = False   # nn.Linear weights are (out, in)
BASE_PREFIX = ""         # HF module path of the base model's layers, relative to ours

_ACT_TO_HF = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
_ACT_FROM_HF = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
_RELATIVE_BIAS = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"   # HF keeps it in layer 0
_IGNORED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",   # copies of shared.weight
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")   # unused by HF too


def _attention(ours: str, theirs: str, norm: str) -> list:
  return [*[(f"{theirs}.{b}.weight", (ours, a, "kernel"), "T1") for a, b in
            (("query", "q"), ("key", "k"), ("value", "v"))],
          (f"{theirs}.o.weight", (ours, "out", "kernel"), "T2"),
          (f"{norm}.weight", (f"{ours}_norm", "scale"), "same")]


def _layer_table(cfg, decoder: bool) -> list:
  """(HF name under <stack>.block.<i>., our path in that layer, kind) rows, as in convert.tree_to_hf."""
  table = _attention("self_attention", "layer.0.SelfAttention", "layer.0.layer_norm")
  if decoder:
    table += _attention("cross_attention", "layer.1.EncDecAttention", "layer.1.layer_norm")
  ff = f"layer.{2 if decoder else 1}"
  table += [(f"{ff}.DenseReluDense.{w}.weight", ("mlp", w, "kernel"), "T1")
            for w in (("wi_0", "wi_1") if cfg.gated_ffn else ("wi",)) + ("wo",)]
  return table + [(f"{ff}.layer_norm.weight", ("mlp_norm", "scale"), "same")]


def _stack_table(stack: str) -> list:
  return [(f"{stack}.final_layer_norm.weight", (stack, "final_norm", "scale"), "same"),
          (f"{stack}.{_RELATIVE_BIAS}", (stack, "relative_bias", "table", "embedding"), "same")]


def _top_table(cfg) -> list:
  table = [("shared.weight", ("shared", "embedding"), "same")] + _stack_table("encoder") + _stack_table("decoder")
  return table if cfg.tie_embeddings else table + [("lm_head.weight", ("lm_head", "kernel"), "T1")]


def hf_config(cfg) -> dict:
  """T5Config fields (config.json of T5ForConditionalGeneration)."""
  if cfg.gated_ffn and cfg.activation == "gelu":
    raise ValueError("HF T5 has no gated exact-erf GELU ('gated-gelu' is the tanh form); use activation 'gelu_tanh'")
  act = _ACT_TO_HF[cfg.activation]
  proj = ("gated-gelu" if act == "gelu_new" else f"gated-{act}") if cfg.gated_ffn else act
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "is_encoder_decoder": True,
      "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": layers.head_dim(cfg), "d_ff": cfg.d_ff,
      "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "num_decoder_layers": num_decoder_layers(cfg),
      "feed_forward_proj": proj, "tie_word_embeddings": bool(cfg.tie_embeddings),
      "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
      "relative_attention_max_distance": cfg.relative_attention_max_distance,
      "dropout_rate": cfg.dropout_rate, "layer_norm_epsilon": cfg.layer_norm_eps, "initializer_factor": 1.0,
      "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id,
      "decoder_start_token_id": cfg.decoder_start_token_id, "use_cache": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  """Model config from a T5Config dict: v1.0, v1.1, and transformers>=5's form (tie_word_embeddings always
  true, the d_model**-0.5 output scaling in scale_decoder_outputs)."""
  proj = hf.get("feed_forward_proj", "relu")
  parts = proj.split("-")
  act = "gelu_new" if proj == "gated-gelu" else parts[-1]
  if act not in _ACT_FROM_HF or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
    raise ValueError(f"unsupported T5 feed_forward_proj {proj!r}; known: relu, gelu, gelu_new, gated-<one of these>")
  m = defaults.model_defaults(FAMILY)
  m.activation, m.gated_ffn = _ACT_FROM_HF[act], len(parts) == 2
  m.vocab_size, m.d_model, m.d_ff = hf["vocab_size"], hf["d_model"], hf["d_ff"]
  m.num_heads, m.head_dim, m.num_layers = hf["num_heads"], hf["d_kv"], hf["num_layers"]
  m.num_decoder_layers = hf.get("num_decoder_layers") or hf["num_layers"]
  m.relative_attention_num_buckets = hf.get("relative_attention_num_buckets", 32)
  m.relative_attention_max_distance = hf.get("relative_attention_max_distance", 128)
  m.dropout_rate = m.attention_dropout_rate = hf.get("dropout_rate", 0.1)
  m.layer_norm_eps = hf.get("layer_norm_epsilon", 1e-6)
  m.tie_embeddings = bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)))
  for field, default in (("pad_token_id", 0), ("eos_token_id", 1), ("decoder_start_token_id", 0)):
    value = hf.get(field)
    m[field] = default if value is None else value[0] if isinstance(value, list) else value
  return m



def _stacks(cfg) -> tuple:
  """(stack, layer count, HF prefix, HF layer table) of the encoder and the decoder."""
  return tuple((stack, n, f"{stack}.block.{{i}}.", _layer_table(cfg, stack == "decoder"))
               for stack, n in (("encoder", cfg.num_layers), ("decoder", num_decoder_layers(cfg))))


def to_hf(cfg, params: dict) -> dict:
  out = convert.tree_to_hf(params, _top_table(cfg))
  for stack, n, prefix, table in _stacks(cfg):
    out |= convert.stack_to_hf(params[stack], n, table, prefix)
  return out


def from_hf(cfg, tensors: dict) -> dict:
  """Params from T5ForConditionalGeneration tensors. An untied config without lm_head.weight (how
  transformers>=5 saves v1.1 models it initialised itself) takes the head from shared.weight."""
  tensors = dict(tensors)
  if not cfg.tie_embeddings and "lm_head.weight" not in tensors and "shared.weight" in tensors:
    tensors["lm_head.weight"] = tensors["shared.weight"]
  if cfg.tie_embeddings and "lm_head.weight" in tensors:
    if "shared.weight" in tensors and not np.array_equal(tensors["lm_head.weight"], tensors["shared.weight"]):
      raise convert.TensorError("lm_head.weight", "differs from 'shared.weight' but the config ties them "
                                "(tie_word_embeddings / scale_decoder_outputs)")
    tensors.pop("lm_head.weight")
  shapes = convert.looped_shapes(cfg)
  table = _top_table(cfg)
  params = convert.tree_from_hf(tensors, table, shapes)
  used = {hf for hf, _, _ in table} | set(_IGNORED)
  for stack, n, prefix, layer_table in _stacks(cfg):
    params[stack] |= convert.stack_from_hf(tensors, layer_table, shapes[stack], n, prefix, cfg.scan_layers)
    used |= {prefix.format(i=i) + hf for i in range(n) for hf, _, _ in layer_table}
  unused = sorted(set(tensors) - used)
  if unused:
    raise convert.TensorError(unused[0], f"is not used by the config ({len(unused)} tensors are not)")
  return convert.as_params(cfg, params)


def table(cfg) -> list:
  """(HF name, looped param path, kind) of every tensor to_hf writes."""
  out = list(_top_table(cfg))
  for stack, n, prefix, layer_table in _stacks(cfg):
    out += [(prefix.format(i=i) + hf, (stack, f"layers_{i}", *path), kind)
            for i in range(n) for hf, path, kind in layer_table]
  return out

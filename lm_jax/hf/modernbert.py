"""Hugging Face ModernBERT: ModernBertForMaskedLM (what save_hf writes) and ModernBertForSequenceClassification (a
model config with num_labels > 0). HF fuses the query, key and value projections into one Wqkv (rows q, k, v) and
GeGLU's two input projections into one Wi (rows: the activated half, then the gate); the table below names the
parts (attn.Wqkv.query, ...: PEFT's adapters of them fuse into one of Wqkv, lm_jax/peft/peft_format.py), split and
fused here. The decoder weight is tied to the word embeddings and not written."""
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.hf import convert
from lm_jax.models import layers, modernbert, relayout

FAMILY, MODEL_TYPE, ARCHITECTURE = "modernbert", "modernbert", "ModernBertForMaskedLM"
FAN_IN_FAN_OUT = False   # nn.Linear weights are (out, in)
BASE_PREFIX = "model."   # HF module path of the base model's layers in the heads' models, relative to ours

_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_FUSED = {"attn.Wqkv.weight": ("attn.Wqkv.query.weight", "attn.Wqkv.key.weight", "attn.Wqkv.value.weight"),
          "mlp.Wi.weight": ("mlp.Wi_0.weight", "mlp.Wi_1.weight")}

_LAYER = [   # under model.layers.{i}.; the parts of a fused tensor by their names in _FUSED
    ("attn_norm.weight", ("attention_ln", "scale"), "same"),
    *[(f"attn.Wqkv.{n}.weight", ("attention", n, "kernel"), "T1") for n in ("query", "key", "value")],
    ("attn.Wo.weight", ("attention", "out", "kernel"), "T2"),
    ("mlp_norm.weight", ("mlp_ln", "scale"), "same"),
    ("mlp.Wi_0.weight", ("mlp", "wi_0", "kernel"), "T1"),
    ("mlp.Wi_1.weight", ("mlp", "wi_1", "kernel"), "T1"),
    ("mlp.Wo.weight", ("mlp", "wo", "kernel"), "T1"),
]
_BODY = [   # under model.
    ("embeddings.tok_embeddings.weight", ("word_embeddings", "embedding"), "same"),
    ("embeddings.norm.weight", ("embeddings_ln", "scale"), "same"),
    ("final_norm.weight", ("final_ln", "scale"), "same"),
]
_HEAD = [("head.dense.weight", ("head", "dense", "kernel"), "T1"),   # ModernBertPredictionHead, at the top
         ("head.norm.weight", ("head", "ln", "scale"), "same")]
_MLM = [("decoder.bias", ("decoder",), "same")]
_CLASSIFIER = [("classifier.weight", ("classifier", "kernel"), "T1"),
               ("classifier.bias", ("classifier", "bias"), "same")]


def _layer(i: int) -> list:
  """Layer i's rows (layer 0 has no attn_norm)."""
  return _LAYER[1:] if i == 0 else _LAYER


def _heads(cfg) -> list:
  return _HEAD + (_CLASSIFIER if cfg.get("num_labels", 0) else _MLM)


def hf_config(cfg) -> dict:
  if cfg.num_heads * layers.head_dim(cfg) != cfg.d_model:
    raise ValueError(f"HF ModernBERT needs num_heads * head_dim == d_model, got {cfg.num_heads} * "
                     f"{layers.head_dim(cfg)} != {cfg.d_model}")
  if not cfg.gated_ffn:
    raise ValueError("HF ModernBERT has a gated MLP (GeGLU): needs model.gated_ffn=True")
  labels = cfg.get("num_labels", 0)
  task = {}
  if labels:
    names = [f"LABEL_{i}" for i in range(labels)]
    task = {"architectures": ["ModernBertForSequenceClassification"], "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
            "problem_type": "regression" if labels == 1 else "single_label_classification"}
  act = _ACT_TO_HF[cfg.activation]
  return {
      "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "intermediate_size": cfg.d_ff, "hidden_activation": act, "classifier_activation": act,
      "max_position_embeddings": cfg.max_positions, "initializer_range": cfg.initializer_range,
      "norm_eps": cfg.layer_norm_eps, "norm_bias": False, "attention_bias": False, "mlp_bias": False,
      "classifier_bias": False, "decoder_bias": True, "tie_word_embeddings": True,
      "embedding_dropout": cfg.dropout_rate, "mlp_dropout": cfg.dropout_rate, "classifier_dropout": cfg.dropout_rate,
      "attention_dropout": cfg.attention_dropout_rate, "global_attn_every_n_layers": cfg.global_every,
      "local_attention": 2 * cfg.sliding_window, "global_rope_theta": cfg.rope_theta,
      "local_rope_theta": cfg.local_rope_theta, "classifier_pooling": cfg.classifier_pooling,
      "pad_token_id": cfg.pad_token_id, **task,   # the tokenizer files give [CLS] / [SEP]; HF's defaults lie outside
      **dict.fromkeys(("bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")),   # small vocabularies
  }


def _rope_theta(hf: dict, kind: str, old: str, default: float) -> float:
  """A rotary theta from transformers 5's rope_parameters[kind] or the released configs' field `old`."""
  return float(((hf.get("rope_parameters") or {}).get(kind) or {}).get("rope_theta") or hf.get(old) or default)


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  for act in ("hidden_activation", "classifier_activation"):
    if hf.get(act, "gelu") not in _ACT_FROM_HF:
      raise ValueError(f"unsupported ModernBERT {act} {hf[act]!r}; known: {', '.join(_ACT_FROM_HF)}")
  if hf.get("hidden_activation", "gelu") != hf.get("classifier_activation", "gelu"):
    raise ValueError("ModernBERT hidden_activation and classifier_activation differ; lm_jax has one activation")
  for field in ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias"):
    if hf.get(field):
      raise ValueError(f"ModernBERT {field}=true is not supported (no biases)")
  if not hf.get("decoder_bias", True) or not hf.get("tie_word_embeddings", True):
    raise ValueError("ModernBERT needs decoder_bias=true and tie_word_embeddings=true")
  every = hf.get("global_attn_every_n_layers", 3)
  types = hf.get("layer_types")
  if types and types != ["sliding_attention" if i % every else "full_attention" for i in range(len(types))]:
    raise ValueError(f"ModernBERT layer_types must be global every global_attn_every_n_layers={every} layers")
  m = defaults.model_defaults(FAMILY)
  m.vocab_size, m.d_model, m.num_layers = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
  m.num_heads, m.d_ff = hf["num_attention_heads"], hf["intermediate_size"]
  m.activation, m.gated_ffn = _ACT_FROM_HF[hf.get("hidden_activation", "gelu")], True
  m.dropout_rate = float(hf.get("mlp_dropout", 0.0))
  m.attention_dropout_rate = float(hf.get("attention_dropout", 0.0))
  m.max_positions = hf.get("max_position_embeddings", 8192)
  m.initializer_range, m.layer_norm_eps = hf.get("initializer_range", 0.02), hf.get("norm_eps", 1e-5)
  m.global_every, m.sliding_window = every, hf.get("local_attention", 128) // 2
  m.rope_theta = _rope_theta(hf, "full_attention", "global_rope_theta", 160_000.0)
  m.local_rope_theta = _rope_theta(hf, "sliding_attention", "local_rope_theta", 10_000.0)
  m.classifier_pooling = hf.get("classifier_pooling", "cls")
  m.pad_token_id = hf.get("pad_token_id") or 0
  if any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or ()):
    m.num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2   # transformers' default: 2
  return m


def to_hf(cfg, params: dict) -> dict:
  out = convert.tree_to_hf(params, _BODY, BASE_PREFIX) | convert.tree_to_hf(params, _heads(cfg))
  for i, layer in enumerate(relayout.get_layers(modernbert.ungrouped(cfg, params), cfg.num_layers)):
    prefix = f"{BASE_PREFIX}layers.{i}."
    parts = convert.tree_to_hf(layer, _layer(i), prefix)
    for name, names in _FUSED.items():
      out[prefix + name] = np.concatenate([parts.pop(prefix + n) for n in names])
    out |= parts
  return out


def from_hf(cfg, tensors: dict) -> dict:
  """Params (in cfg.scan_layers' layout) from ModernBertForMaskedLM or ModernBertForSequenceClassification
  tensors."""
  shapes = convert.looped_shapes(cfg)
  params = convert.tree_from_hf(tensors, _BODY, shapes, BASE_PREFIX) | convert.tree_from_hf(tensors, _heads(cfg),
                                                                                              shapes)
  per_layer = []
  for i in range(cfg.num_layers):
    prefix, parts = f"{BASE_PREFIX}layers.{i}.", {}
    for name, names in _FUSED.items():
      rows = sum(convert.hf_shape(convert.get_path(shapes[f"layers_{i}"], path).shape, kind)[0]
                 for hf, path, kind in _LAYER if hf in names)
      fused = convert.checked_tensor(tensors, prefix + name, (rows, cfg.d_model))
      parts |= {prefix + n: t for n, t in zip(names, np.split(fused, len(names)))}
    per_layer.append(convert.tree_from_hf({**tensors, **parts}, _layer(i), shapes[f"layers_{i}"], prefix))
  return convert.as_params(cfg, modernbert.grouped(cfg, params | relayout.put_layers(per_layer, scan=False)))


def table(cfg) -> list:
  """(HF name, looped param path, kind) of every tensor to_hf writes, a fused tensor's parts by their names in
  _FUSED."""
  return ([(BASE_PREFIX + hf, path, kind) for hf, path, kind in _BODY] + _heads(cfg)
          + [(f"{BASE_PREFIX}layers.{i}.{hf}", (f"layers_{i}", *path), kind)
             for i in range(cfg.num_layers) for hf, path, kind in _layer(i)])

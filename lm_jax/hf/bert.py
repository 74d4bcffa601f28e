"""Hugging Face BERT: BertForPreTraining (what save_hf writes; BertForMaskedLM loads it too, leaving the pooler and
NSP head aside, as it does bert-base-uncased), BertForSequenceClassification (a model config with num_labels > 0)
and encoder-only BertModel checkpoints, which load with the pooler and heads initialised randomly, as transformers
does."""
import logging

import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.hf import convert
from lm_jax.models import bert, layers

FAMILY, MODEL_TYPE, ARCHITECTURE = "bert", "bert", "BertForPreTraining"
FAN_IN_FAN_OUT = False   # nn.Linear weights are (out, in)
BASE_PREFIX = "bert."    # HF module path of the base model's layers in the heads' models, relative to ours
_RANDOM_IF_MISSING = ("pooler", *bert.HEADS)   # absent from encoder-only checkpoints

_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

_LAYER = [
    *[(f"attention.self.{n}.weight", ("attention", n, "kernel"), "T1") for n in ("query", "key", "value")],
    *[(f"attention.self.{n}.bias", ("attention", n, "bias"), "flat") for n in ("query", "key", "value")],
    ("attention.output.dense.weight", ("attention", "out", "kernel"), "T2"),
    ("attention.output.dense.bias", ("attention", "out", "bias"), "same"),
    ("attention.output.LayerNorm.weight", ("attention_ln", "scale"), "same"),
    ("attention.output.LayerNorm.bias", ("attention_ln", "bias"), "same"),
    ("intermediate.dense.weight", ("mlp", "wi", "kernel"), "T1"),
    ("intermediate.dense.bias", ("mlp", "wi", "bias"), "same"),
    ("output.dense.weight", ("mlp", "wo", "kernel"), "T1"),
    ("output.dense.bias", ("mlp", "wo", "bias"), "same"),
    ("output.LayerNorm.weight", ("mlp_ln", "scale"), "same"),
    ("output.LayerNorm.bias", ("mlp_ln", "bias"), "same"),
]
_BODY = [   # under "bert." in BertForPreTraining, at the top in BertModel
    ("embeddings.word_embeddings.weight", ("word_embeddings", "embedding"), "same"),
    ("embeddings.position_embeddings.weight", ("position_embeddings", "embedding"), "same"),
    ("embeddings.token_type_embeddings.weight", ("token_type_embeddings", "embedding"), "same"),
    ("embeddings.LayerNorm.weight", ("embeddings_ln", "scale"), "same"),
    ("embeddings.LayerNorm.bias", ("embeddings_ln", "bias"), "same"),
    ("pooler.dense.weight", ("pooler", "kernel"), "T1"),
    ("pooler.dense.bias", ("pooler", "bias"), "same"),
]
_HEADS = [  # under "cls."
    ("predictions.transform.dense.weight", ("mlm", "dense", "kernel"), "T1"),
    ("predictions.transform.dense.bias", ("mlm", "dense", "bias"), "same"),
    ("predictions.transform.LayerNorm.weight", ("mlm", "ln", "scale"), "same"),
    ("predictions.transform.LayerNorm.bias", ("mlm", "ln", "bias"), "same"),
    ("predictions.bias", ("mlm", "bias"), "same"),
    ("seq_relationship.weight", ("nsp", "kernel"), "T1"),
    ("seq_relationship.bias", ("nsp", "bias"), "same"),
]
_CLASSIFIER = [   # BertForSequenceClassification, at the top
    ("classifier.weight", ("classifier", "kernel"), "T1"),
    ("classifier.bias", ("classifier", "bias"), "same"),
]


def _heads(cfg):
  """(table, prefix) of the heads a model config has."""
  return (_CLASSIFIER, "") if cfg.get("num_labels", 0) else (_HEADS, "cls.")



def hf_config(cfg) -> dict:
  if cfg.num_heads * layers.head_dim(cfg) != cfg.d_model:
    raise ValueError(f"HF BERT needs num_heads * head_dim == d_model, got {cfg.num_heads} * "
                     f"{layers.head_dim(cfg)} != {cfg.d_model}")
  labels = cfg.get("num_labels", 0)
  task = {}
  if labels:
    names = [f"LABEL_{i}" for i in range(labels)]
    task = {"architectures": ["BertForSequenceClassification"], "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
            "problem_type": "regression" if labels == 1 else "single_label_classification"}
  return {
      "architectures": ["BertForMaskedLM", "BertForPreTraining"], "model_type": MODEL_TYPE,   # fill-mask first
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.d_ff,
      "hidden_act": _ACT_TO_HF[cfg.activation], "hidden_dropout_prob": cfg.dropout_rate,
      "attention_probs_dropout_prob": cfg.attention_dropout_rate, "max_position_embeddings": cfg.max_positions,
      "type_vocab_size": cfg.type_vocab_size, "initializer_range": cfg.initializer_range,
      "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": cfg.pad_token_id,
      "position_embedding_type": "absolute", "tie_word_embeddings": True, **task,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r} is not supported (absolute only)")
  if hf["hidden_act"] not in _ACT_FROM_HF:
    raise ValueError(f"unsupported BERT hidden_act {hf['hidden_act']!r}; known: {', '.join(_ACT_FROM_HF)}")
  m = defaults.model_defaults(FAMILY)
  m.vocab_size, m.d_model, m.num_layers = hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"]
  m.num_heads, m.d_ff = hf["num_attention_heads"], hf["intermediate_size"]
  m.activation = _ACT_FROM_HF[hf["hidden_act"]]
  m.dropout_rate, m.attention_dropout_rate = hf["hidden_dropout_prob"], hf["attention_probs_dropout_prob"]
  m.max_positions, m.type_vocab_size = hf["max_position_embeddings"], hf["type_vocab_size"]
  m.initializer_range, m.layer_norm_eps = hf.get("initializer_range", 0.02), hf["layer_norm_eps"]
  m.pad_token_id = hf.get("pad_token_id") or 0
  if any(a.endswith("ForSequenceClassification") for a in hf.get("architectures") or ()):
    m.num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2   # transformers' default: 2
  return m



def to_hf(cfg, params: dict) -> dict:
  return (convert.tree_to_hf(params, _BODY, "bert.") | convert.tree_to_hf(params, *_heads(cfg))
          | convert.stack_to_hf(params, cfg.num_layers, _LAYER, "bert.encoder.layer.{i}."))


def from_hf(cfg, tensors: dict) -> dict:
  """Params from BertForPreTraining, BertForSequenceClassification or BertModel tensors. What an encoder-only
  checkpoint lacks (pooler, MLM / NSP heads or classifier) is initialised randomly (numpy seed 0) as transformers
  would, with a warning."""
  prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""
  if "cls.predictions.bias" not in tensors and "cls.predictions.decoder.bias" in tensors:   # older exports
    tensors = {**tensors, "cls.predictions.bias": tensors["cls.predictions.decoder.bias"]}
  shapes = convert.looped_shapes(cfg)
  params, missing = {}, []
  for table, pre in ((_BODY, prefix), _heads(cfg)):
    for hf, path, kind in table:
      if pre + hf not in tensors and path[0] in _RANDOM_IF_MISSING:
        missing.append((pre + hf, path))
      else:
        convert.set_path(params, path, convert.param_from_hf(tensors, pre + hf, kind,
                                                             convert.get_path(shapes, path).shape))
  if missing:   # transformers' _init_weights: N(0, initializer_range) kernels, LN 1 / 0, zero biases
    logging.warning("BERT checkpoint lacks %s: initialised randomly", ", ".join(name for name, _ in missing))
    rng = np.random.default_rng(0)
    for _, path in missing:
      shape = convert.get_path(shapes, path).shape
      if path[-1] == "kernel":
        convert.set_path(params, path, rng.normal(0.0, cfg.initializer_range, shape))
      else:
        convert.set_path(params, path, np.ones(shape) if path[-1] == "scale" else np.zeros(shape))
  params |= convert.stack_from_hf(tensors, _LAYER, shapes, cfg.num_layers, prefix + "encoder.layer.{i}.",
                                  cfg.scan_layers)
  return convert.as_params(cfg, params)


def table(cfg) -> list:
  """(HF name, looped param path, kind) of every tensor to_hf writes."""
  heads, prefix = _heads(cfg)
  return ([("bert." + hf, path, kind) for hf, path, kind in _BODY]
          + [(prefix + hf, path, kind) for hf, path, kind in heads]
          + [(f"bert.encoder.layer.{i}.{hf}", (f"layers_{i}", *path), kind)
             for i in range(cfg.num_layers) for hf, path, kind in _LAYER])

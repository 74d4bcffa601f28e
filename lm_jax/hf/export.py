"""Hugging Face files: config.json + model.safetensors, as transformers' from_pretrained reads them.

save_hf writes the layout of BertForPreTraining, OpenAIGPTLMHeadModel or T5ForConditionalGeneration
(scanned layers are unstacked, float32). load_hf reads safetensors only, never pickles; it also takes
encoder-only BertModel checkpoints (missing pooler / MLM / NSP heads are initialised randomly with a
warning, like transformers does). A missing, unreadable or unfitting file is a one-line error that names
the file, and the tensor where one is at fault.
"""
import glob
import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lm_jax import hf, models
from lm_jax.hf import convert

MODEL_TYPES = {"bert": "bert", "openai-gpt": "gpt", "t5": "t5"}   # HF model_type -> family


def save_hf(model_cfg, params, out_dir: str) -> None:
  mod = hf.family_module(model_cfg)
  config = mod.hf_config(model_cfg)
  tensors = mod.to_hf(model_cfg, params)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_hf(path: str, **overrides):
  """-> (model_cfg, params) from a directory with config.json and *.safetensors (shards too).
  `overrides` set model config fields that do not change the weights, e.g. scan_layers=True."""
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found")
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path} (pickle checkpoints such as pytorch_model.bin are not read)")
  model_cfg = _read_config(config_path)
  model_cfg.update(overrides)
  models.validate(model_cfg)
  tensors, sources = {}, {}
  for file in files:
    read = _read_float32(file)
    tensors |= read
    sources |= dict.fromkeys(read, file)
  try:
    return model_cfg, hf.family_module(model_cfg).from_hf(model_cfg, tensors)
  except convert.TensorError as e:   # a missing tensor is in no file: name the directory
    raise ValueError(f"{sources.get(e.tensor, path)}: {e}") from None


def _read_config(config_path: str):
  """Our model config from an HF config.json; errors name the file."""
  try:
    with open(config_path, encoding="utf-8") as f:
      fields = json.load(f)
  except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{config_path}: not valid JSON ({e})") from None
  if not isinstance(fields, dict):
    raise ValueError(f"{config_path}: expected a JSON object, got {type(fields).__name__}")
  family = MODEL_TYPES.get(fields.get("model_type"))
  if family is None:
    raise ValueError(f"{config_path}: unsupported model_type {fields.get('model_type')!r}; known: "
                     f"{', '.join(MODEL_TYPES)}")
  try:
    model_cfg = hf.family_module(family).config_from_hf(fields)
    models.validate(model_cfg)
  except KeyError as e:
    raise ValueError(f"{config_path}: no field {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{config_path}: {e}") from None
  return model_cfg


def _read_float32(file: str) -> dict:
  """Tensors of one safetensors file as float32 numpy. Read through JAX because released checkpoints
  are often bfloat16, which safetensors' numpy reader rejects."""
  try:
    with safe_open(file, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}
  except SafetensorError as e:
    raise ValueError(f"{file}: not a readable safetensors file ({e})") from None

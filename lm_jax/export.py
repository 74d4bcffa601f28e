"""Hugging Face format: config.json + model.safetensors, as transformers' from_pretrained reads them.

save_hf writes the layout of BertForPreTraining, OpenAIGPTLMHeadModel or T5ForConditionalGeneration
(scanned layers are unstacked, float32). load_hf reads safetensors only, never pickles; it also takes
encoder-only BertModel checkpoints (missing pooler / MLM / NSP heads are initialised randomly with a
warning, like transformers does). The tensor mapping lives in each family module.
"""
import glob
import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from lm_jax import models

MODEL_TYPES = {"bert": "bert", "openai-gpt": "gpt", "t5": "t5"}   # HF model_type -> family


def save_hf(model_cfg, params, out_dir: str) -> None:
  mod = models.family_module(model_cfg)
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
  with open(config_path) as f:
    hf = json.load(f)
  family = MODEL_TYPES.get(hf.get("model_type"))
  if family is None:
    raise ValueError(f"{config_path}: unsupported model_type {hf.get('model_type')!r}; known: {', '.join(MODEL_TYPES)}")
  mod = models.family_module(family)
  model_cfg = mod.config_from_hf(hf)
  model_cfg.update(overrides)
  models.validate(model_cfg)
  tensors = {}
  for file in files:
    tensors |= _read_float32(file)
  return model_cfg, mod.from_hf(model_cfg, tensors)


def _read_float32(file: str) -> dict:
  """Tensors of one safetensors file as float32 numpy. Read through JAX because released checkpoints
  are often bfloat16, which safetensors' numpy reader rejects."""
  with safe_open(file, framework="flax") as f:
    return {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}

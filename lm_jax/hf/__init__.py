"""Hugging Face format: conversion between our params / model configs and transformers' checkpoints.

export.py reads and writes the files (save_hf / load_hf), tokenizer.py the tokenizer files of an export;
convert.py holds the table-driven tensor mapping the families share. Each family's module here (bert.py, gpt.py,
gpt2.py, t5.py), registered below with one line, provides
  FAMILY, MODEL_TYPE, ARCHITECTURE  our family name, HF's model_type and the HF class save_hf writes
  FAN_IN_FAN_OUT, BASE_PREFIX       PEFT's fan_in_fan_out (HF weights stored (in, out)); the HF module path of the
                                    base model's layers in a model with heads, relative to ours
  hf_config(cfg) -> dict            config.json fields of the HF class save_hf writes
  config_from_hf(hf) -> ConfigDict  our model config from an HF config.json dict
  to_hf(cfg, params) -> dict        {HF tensor name: float32 numpy array}
  from_hf(cfg, tensors) -> dict     params (in cfg.scan_layers' layout) from HF tensors
  table(cfg) -> list                (HF name, looped param path, kind) of every tensor
"""
from types import ModuleType

from lm_jax import models
from lm_jax.hf import bert, gpt, gpt2, llama, modernbert, qwen3, t5

_FAMILIES: dict[str, ModuleType] = {}


def register(module: ModuleType) -> ModuleType:
  _FAMILIES[module.FAMILY] = module
  return module


register(bert)
register(gpt)
register(t5)
register(gpt2)
register(llama)
register(qwen3)
register(modernbert)


def family_module(model_cfg_or_family) -> ModuleType:
  """The HF conversion module of a family, given its name or a model config."""
  name = models.family(model_cfg_or_family).name
  if name not in _FAMILIES:
    raise ValueError(f"model.family {name!r} has no Hugging Face conversion")
  return _FAMILIES[name]


def by_model_type(model_type: str) -> ModuleType | None:
  """The HF conversion module of an HF config.json's model_type, or None."""
  return next((m for m in _FAMILIES.values() if m.MODEL_TYPE == model_type), None)


def model_types() -> list[str]:
  return sorted(m.MODEL_TYPE for m in _FAMILIES.values())

"""Hugging Face format: conversion between our params / model configs and transformers' checkpoints.

export.py reads and writes the files (save_hf / load_hf), tokenizer.py the tokenizer files of an export;
convert.py holds the table-driven tensor mapping the families share. Each family module (bert.py, gpt.py,
t5.py) provides
  hf_config(cfg) -> dict            config.json fields of the HF class save_hf writes
  config_from_hf(hf) -> ConfigDict  our model config from an HF config.json dict
  to_hf(cfg, params) -> dict        {HF tensor name: float32 numpy array}
  from_hf(cfg, tensors) -> dict     params (in cfg.scan_layers' layout) from HF tensors
"""
import importlib

from lm_jax import models


def family_module(model_cfg_or_family):
  """The HF conversion module of a family ('bert', 'gpt', 't5'), given its name or a model config."""
  return importlib.import_module(f"lm_jax.hf.{models.family_name(model_cfg_or_family)}")

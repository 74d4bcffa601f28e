"""Adapters in the Hugging Face PEFT format: adapter_config.json + adapter_model.safetensors, what
peft.PeftModel.from_pretrained(model, dir) loads onto the model lm_jax.hf.export.save_hf writes, and what PEFT's
save_pretrained writes. What every method shares is here: the file I/O, the HF module names (the family's HF table,
lm_jax/hf/*.py `table`; OpenAIGPT's fused c_attn) and modules_to_save, saved as base_model.model.<HF name> as PEFT
saves them. Each method's own tensors are in its module (lora.py, ia3.py).
"""
import json
import os
import re

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lm_jax import hf, models, storage
from lm_jax.hf import convert
from lm_jax.peft import targets

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
_QKV = ("query", "key", "value")


def table(model_cfg) -> dict:
  """{looped param path string: (HF name, kind)}."""
  return {"/".join(path): (name, kind) for name, path, kind in hf.family_module(model_cfg).table(model_cfg)}


def fan_in_fan_out(model_cfg) -> bool:
  """PEFT's fan_in_fan_out: whether the family's HF layers store their weights (in, out) (GPT's Conv1D)."""
  return hf.family_module(model_cfg).FAN_IN_FAN_OUT


def fused(name: str):
  """(fused module, part index) of a pseudo name of one part of a fused query / key / value projection, else None:
  GPT's 'transformer.h.<i>.attn.<query|key|value>.weight' (module attn.c_attn), ModernBERT's
  'model.layers.<i>.attn.Wqkv.<query|key|value>.weight' (module attn.Wqkv)."""
  m = re.fullmatch(r"(.*\.attn)(\.Wqkv)?\.(query|key|value)\.weight", name)
  return (m.group(1) + (m.group(2) or ".c_attn"), _QKV.index(m.group(3))) if m else None


# ------------------------------------------------------------------------------------------------------- export
def write(out_dir: str, adapter_config: dict, tensors: dict):
  """adapter_config.json and adapter_model.safetensors (tensors keyed by their full PEFT names) in out_dir."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(adapter_config, f, indent=2, sort_keys=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(out_dir, WEIGHTS_FILE),
            metadata={"format": "pt"})


def saved_tensors(config, name: str, params: dict) -> dict:
  """{HF name: tensor} of the params config.<name>.modules_to_save trains (PEFT saves them under their names)."""
  names, m = table(config.model), config.model
  plain = {k: v for k, v in params.items() if k != name}
  mask = _paths(targets.saved_mask(config, name, plain))
  saved = {}
  for path, value in _paths(plain).items():
    if mask.get(path):
      targets.put(saved, tuple(path.split("/")), value)
  looped = _paths(models.family(m).relaid(m, saved, scan=False))   # one per layer of a scanned stack
  return {names[p][0]: convert.to_hf_array(np.asarray(v), names[p][1]) for p, v in looped.items() if p in names}


def _paths(tree: dict, prefix: str = "") -> dict:
  """{'/'-joined path: leaf} of a nested dict (params, or a mask over them)."""
  out = {}
  for k, v in tree.items():
    out.update(_paths(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
  return out


# ------------------------------------------------------------------------------------------------------- import
def read_config(path: str, peft_type: str) -> dict:
  """adapter_config.json of a PEFT directory of `peft_type` ('LORA', 'IA3'), local or remote (gs://); one-line
  errors name the file and field."""
  file = _join(path, CONFIG_FILE)
  if not storage.isfile(file) or not storage.isfile(_join(path, WEIGHTS_FILE)):
    raise FileNotFoundError(f"config.{peft_type.lower()}.init_from={path!r}: no {CONFIG_FILE} + {WEIGHTS_FILE} (a "
                            "PEFT adapter directory)")
  with storage.open(file, "r", encoding="utf-8") as f:
    try:
      fields = json.load(f)
    except ValueError as e:
      raise ValueError(f"{file}: not valid JSON ({e})") from None
  if fields.get("peft_type", peft_type) != peft_type:
    raise ValueError(f"{file}: peft_type={fields['peft_type']!r} is not supported here (needs {peft_type!r})")
  for field, ok in (("use_dora", False), ("bias", "none"), ("lora_bias", False)):
    if fields.get(field, ok) != ok:
      raise ValueError(f"{file}: {field}={fields[field]!r} is not supported (LoRA needs {ok!r})")
  return fields


def read_tensors(path: str, model_cfg) -> dict:
  """{HF name (PEFT's prefix removed): float32 array} of the PEFT directory `path`; the adapters of a bare base model
  (BertModel) get the prefix of the models lm_jax exports ('bert.')."""
  tensors = {k.removeprefix(PREFIX): v for k, v in _read(_join(path, WEIGHTS_FILE)).items()}
  base = hf.family_module(model_cfg).BASE_PREFIX
  if base and not any(k.startswith(base) for k in tensors):   # adapters of a bare base model (BertModel)
    tensors = {(base + k if not k.startswith("classifier.") else k): v for k, v in tensors.items()}
  return tensors


def saved_params(config, name: str, tensors: dict) -> dict:
  """Looped params tree of config.<name>.modules_to_save from `tensors` (HF names), as PEFT saves them."""
  shapes, _ = models.looped_params(config.model)
  params = {}
  for looped, (hf_name, kind) in table(config.model).items():
    if hf_name in tensors and targets.trains_fully(config[name], looped):
      targets.put(params, tuple(looped.split("/")), convert.param_from_hf(tensors, hf_name, kind, shapes[looped].shape))
  return params


def _join(folder: str, name: str) -> str:
  return f"{folder.rstrip('/')}/{name}" if storage.is_remote(folder) else os.path.join(folder, name)


def _read(file: str) -> dict:
  try:
    with safe_open(storage.local_file(file), framework="flax") as f:   # safe_open maps a local file   # through JAX: bfloat16 adapters too
      return {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}
  except SafetensorError as e:
    raise ValueError(f"{file}: not a readable safetensors file ({e})") from None

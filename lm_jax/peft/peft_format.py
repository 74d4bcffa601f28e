"""Adapters in the Hugging Face PEFT format: adapter_config.json + adapter_model.safetensors, what
peft.PeftModel.from_pretrained(model, dir) loads onto the model lm_jax.hf.export.save_hf writes, and what PEFT's
save_pretrained writes. The file I/O, the HF module names and modules_to_save are shared; LoRA's tensors are here,
each other method's in its own module (lm_jax/peft/ia3.py).

Keys are base_model.model.<HF module>.lora_A.weight (r, in) and .lora_B.weight (out, r), the module names those of
the family's HF table (lm_jax/hf/*.py `table`); params trained fully (config.lora.modules_to_save) are saved as
base_model.model.<HF name>, as PEFT saves its modules_to_save. The scale is PEFT's: lora_alpha / r (use_rslora:
/ sqrt(r)), per module through rank_pattern / alpha_pattern.

OpenAIGPT fuses query, key and value into one Conv1D, c_attn (fan_in_fan_out): k adapted parts of rank r become
one c_attn adapter of rank k·r, A the k A's side by side and B block-diagonal (zero rows for a part not adapted),
with rank_pattern / alpha_pattern keeping the scale; any subset of query / key / value maps exactly. Importing a
c_attn adapter splits it back: a rank-k·r block-diagonal one into its blocks, a rank-r one (PEFT-trained) into
parts sharing A.
"""
import json
import math
import os
import re

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lm_jax import hf
from lm_jax.hf import convert
from lm_jax.models import layers
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
  """(c_attn module, part index) of a GPT pseudo name 'transformer.h.<i>.attn.<query|key|value>.weight', else None."""
  m = re.fullmatch(r"(.*\.attn)\.(query|key|value)\.weight", name)
  return (m.group(1) + ".c_attn", _QKV.index(m.group(2))) if m else None


def _flat(tree, prefix=()) -> dict:
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) and set(v) != {"a", "b"} else {prefix + (k,): v})
  return out


# ------------------------------------------------------------------------------------------------------- export
def save_lora(config, params: dict, out_dir: str, s: float) -> None:
  """Writes the LoRA adapters (and modules_to_save) of the run's host params to out_dir in the PEFT format; s is
  the run's scale."""
  m, c = config.model, config.lora
  names = table(m)
  adapters = {"/".join(k) + "/kernel": v for k, v in _flat(layers.relayout(params["lora"], scan=False)).items()}
  tensors, modules, qkv = {}, set(), {}
  for path, node in adapters.items():
    name, _ = names[path]
    a = np.asarray(node["a"], np.float32).reshape(-1, c.rank)
    b = np.asarray(node["b"], np.float32).reshape(c.rank, -1)
    if fused(name):
      module, part = fused(name)
      qkv.setdefault(module, {})[part] = (a, b)
      continue
    module = name.removesuffix(".weight")
    modules.add(module)
    tensors[f"{PREFIX}{module}.lora_A.weight"] = a.T
    tensors[f"{PREFIX}{module}.lora_B.weight"] = b.T
  rank_pattern, alpha_pattern = {}, {}
  for module, parts in qkv.items():
    order = sorted(parts)
    width = parts[order[0]][1].shape[1]
    k = len(order)
    b = np.zeros((3 * width, k * c.rank), np.float32)
    for j, part in enumerate(order):
      b[part * width:(part + 1) * width, j * c.rank:(j + 1) * c.rank] = parts[part][1].T
    modules.add(module)
    tensors[f"{PREFIX}{module}.lora_A.weight"] = np.concatenate([parts[p][0].T for p in order])
    tensors[f"{PREFIX}{module}.lora_B.weight"] = b
    if k > 1:   # keep PEFT's scale alpha' / r' (or / sqrt(r')) at s with r' = k r
      rank_pattern[_escape(module)] = k * c.rank
      alpha_pattern[_escape(module)] = s * (math.sqrt(k * c.rank) if c.rslora else k * c.rank)
  trained = saved_tensors(config, "lora", params)
  tensors |= {PREFIX + name: t for name, t in trained.items()}
  adapter_config = {
      "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
      "r": c.rank, "lora_alpha": c.alpha, "lora_dropout": c.dropout, "use_rslora": bool(c.rslora),
      "target_modules": sorted(modules), "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
      "modules_to_save": sorted({n.rsplit(".", 1)[0] for n in trained}) or None,
      "fan_in_fan_out": fan_in_fan_out(m), "bias": "none", "init_lora_weights": True, "use_dora": False}
  write(out_dir, adapter_config, tensors)


def write(out_dir: str, adapter_config: dict, tensors: dict):
  """adapter_config.json and adapter_model.safetensors (tensors keyed by their full PEFT names) in out_dir."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(adapter_config, f, indent=2, sort_keys=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(out_dir, WEIGHTS_FILE),
            metadata={"format": "pt"})


def saved_tensors(config, name: str, params: dict) -> dict:
  """{HF name: tensor} of the params config.<name>.modules_to_save trains (PEFT saves them under their names)."""
  names, trained = table(config.model), {}
  plain = {k: v for k, v in params.items() if k != name}
  mask = _paths(targets.saved_mask(config, name, plain))
  for path, value in _paths(plain).items():
    if mask.get(path):
      for looped, array in _looped_names(path, value):
        if looped in names:
          hf_name, kind = names[looped]
          trained[hf_name] = convert.to_hf_array(array, kind)
  return trained


def _escape(module: str) -> str:
  """A rank_pattern key matching exactly this module (PEFT matches keys as regexes on the module name)."""
  return "^" + re.escape(module) + "$"


def _paths(tree: dict, prefix: str = "") -> dict:
  """{'/'-joined path: leaf} of a nested dict (params, or a mask over them)."""
  out = {}
  for k, v in tree.items():
    out.update(_paths(v, f"{prefix}{k}/") if isinstance(v, dict) else {prefix + k: v})
  return out


def _looped_names(path: str, value) -> list[tuple[str, np.ndarray]]:
  """(looped path, value) of a run-layout param: one per layer of a scanned stack."""
  keys = path.split("/")
  if "layers" not in keys:
    return [(path, np.asarray(value))]
  i = keys.index("layers")
  return [("/".join(keys[:i] + [f"layers_{n}"] + keys[i + 1:]), np.asarray(value)[n]) for n in range(len(value))]


# ------------------------------------------------------------------------------------------------------- import
def read_config(path: str, peft_type: str) -> dict:
  """adapter_config.json of a PEFT directory of `peft_type` ('LORA', 'IA3'); one-line errors name the file and
  field."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
    raise FileNotFoundError(f"config.{peft_type.lower()}.init_from={path!r}: no {CONFIG_FILE} + {WEIGHTS_FILE} (a "
                            "PEFT adapter directory)")
  with open(file, encoding="utf-8") as f:
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


def _peft_scale(fields: dict, module: str, rank: int) -> float:
  """PEFT's scale of `module`: alpha (alpha_pattern's first matching key, else lora_alpha) / rank (or sqrt)."""
  alpha = fields.get("lora_alpha", 8)
  for key, value in (fields.get("alpha_pattern") or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      alpha = value
      break
  return alpha / math.sqrt(rank) if fields.get("use_rslora") else alpha / rank


def read_tensors(path: str, model_cfg) -> dict:
  """{HF name (PEFT's prefix removed): float32 array} of the PEFT directory `path`; the adapters of a bare base model
  (BertModel) get the prefix of the models lm_jax exports ('bert.')."""
  tensors = {k.removeprefix(PREFIX): v for k, v in _read(os.path.join(path, WEIGHTS_FILE)).items()}
  base = hf.family_module(model_cfg).BASE_PREFIX
  if base and not any(k.startswith(base) for k in tensors):   # adapters of a bare base model (BertModel)
    tensors = {(base + k if not k.startswith("classifier.") else k): v for k, v in tensors.items()}
  return tensors


def saved_params(config, name: str, tensors: dict) -> dict:
  """Looped params tree of config.<name>.modules_to_save from `tensors` (HF names), as PEFT saves them."""
  shapes, _ = targets.looped_params(config)
  params = {}
  for looped, (hf_name, kind) in table(config.model).items():
    if hf_name in tensors and targets.trains_fully(config[name], looped):
      targets.put(params, tuple(looped.split("/")), convert.param_from_hf(tensors, hf_name, kind, shapes[looped].shape))
  return params


def _read(file: str) -> dict:
  try:
    with safe_open(file, framework="flax") as f:   # through JAX: bfloat16 adapters too
      return {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}
  except SafetensorError as e:
    raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def load_lora(config, path: str, s: float) -> dict:
  """{'lora': adapters, modules_to_save params} in the run's layout from the PEFT directory `path`. The adapters
  must be those config.lora.targets / rank describe: a missing, extra or misshapen one is a one-line error naming
  the tensor. PEFT's per-module scale is folded into B, so the run's scale s gives the same W + s·A·B."""
  fields, m, r = read_config(path, "LORA"), config.model, config.lora.rank
  file = os.path.join(path, WEIGHTS_FILE)
  tensors, names = read_tensors(path, m), table(m)
  by_module = {}
  for looped, (name, _) in names.items():
    if looped.endswith("/kernel"):
      module, part = fused(name) or (name.removesuffix(".weight"), None)
      by_module.setdefault(module, []).append((looped, part))
  wanted = set(targets.kernels(config, config.lora))
  adapters, used = {}, set()
  for module, members in by_module.items():
    a_name, b_name = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
    if a_name not in tensors:
      continue
    used |= {a_name, b_name}
    if b_name not in tensors:
      raise ValueError(f"{file}: {PREFIX}{b_name} is missing")
    a, b = tensors[a_name], tensors[b_name]
    rank = a.shape[0]
    b = b * (_peft_scale(fields, module, rank) / s)
    if members[0][1] is None:
      adapters[members[0][0]] = (a.T, b.T)
    else:
      adapters |= _split_fused(file, module, members, a, b, wanted, r)
  unused = sorted(set(k for k in tensors if ".lora_" in k) - used)
  if unused:
    raise ValueError(f"{file}: {PREFIX}{unused[0]} names no module of this {m.family} model")
  for looped in sorted(wanted | set(adapters)):
    name = names[looped][0]
    if looped not in adapters:
      raise ValueError(f"{file}: no adapter for {name} (config.lora.targets matches {looped})")
    if looped not in wanted:
      raise ValueError(f"{file}: adapter of {name} ({looped}) is not in config.lora.targets="
                       f"{tuple(config.lora.targets)}")
  shapes, specs = targets.looped_params(config)
  out = {}
  for looped, (a, b) in adapters.items():
    kernel, n = shapes[looped].shape, targets.n_in(specs[looped])
    if a.shape != (math.prod(kernel[:n]), r) or b.shape != (r, math.prod(kernel[n:])):
      module = names[looped][0].removesuffix(".weight")
      raise ValueError(f"{file}: the adapter of {module} has A {a.shape[::-1]}, B {b.shape[::-1]}; config.lora.rank="
                       f"{r} and the model need A {(r, math.prod(kernel[:n]))}, B {(math.prod(kernel[n:]), r)}")
    targets.put(out, tuple(looped.split("/")[:-1]), {"a": a.reshape(*kernel[:n], r), "b": b.reshape(r, *kernel[n:])})
  return layers.relayout({"lora": out, **saved_params(config, "lora", tensors)}, m.scan_layers)


def _split_fused(file, module, members, a, b, wanted, r) -> dict:
  """Per-part adapters {looped kernel path: (A (in, r), B (r, out))} of a fused c_attn adapter A (R, in), B (3d, R)."""
  parts = sorted((part, looped) for looped, part in members)
  targeted = [(part, looped) for part, looped in parts if looped in wanted]
  width, rank = b.shape[0] // 3, a.shape[0]
  rows = lambda part: slice(part * width, (part + 1) * width)
  out = {}
  if rank == len(targeted) * r:   # block-diagonal, as save() writes it
    for j, (part, looped) in enumerate(targeted):
      cols = slice(j * r, (j + 1) * r)
      out[looped] = (a[cols].T, b[rows(part), cols].T)
    expected = np.zeros_like(b)
    for j, (part, _) in enumerate(targeted):
      expected[rows(part), j * r:(j + 1) * r] = b[rows(part), j * r:(j + 1) * r]
  elif rank == r:                 # PEFT-trained: the parts share A
    for part, looped in targeted:
      out[looped] = (a.T, b[rows(part)].T)
    expected = b.copy()
    for part, _ in parts:
      if all(part != p for p, _ in targeted):
        expected[rows(part)] = 0
  else:
    raise ValueError(f"{file}: {PREFIX}{module}.lora_A.weight has rank {rank}; with config.lora.rank={r} and "
                     f"{len(targeted)} of query/key/value targeted it must be {r} or {len(targeted) * r}")
  if not np.array_equal(expected, b):
    raise ValueError(f"{file}: {PREFIX}{module}.lora_B.weight changes a part of query/key/value that "
                     "config.lora.targets does not adapt (or is not block-diagonal over them)")
  return out

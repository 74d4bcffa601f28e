"""LoRA (Hu et al. 2022) and QLoRA (Dettmers et al. 2023) as a transformation of the parameter tree, not of the
models (docs/lora.md): one adapter method behind lm_jax.params (the functions of lm_jax/peft/methods.py).

config.lora.rank > 0 adds adapters under the top-level params key 'lora', mirroring the path of each targeted
Dense kernel W: {'a': (*in, r), 'b': (r, *out)} (a leading layer axis in a scanned stack), i.e. PEFT's lora_A /
lora_B of the HF Linear whose weight is W flattened to (in, out), transposed. s = alpha / r (alpha / sqrt(r) with
rslora). Training runs them unmerged (`hook`: each adapted Dense adds s·(dropout(x)·A)·B to x·W, the frozen W gets
no weight gradient, config.lora.dropout drops the adapter's input as PEFT's lora_dropout does); eval and decoding
run plain params with each adapted kernel W + s·A·B (`fold`), so a KV-cache decode step costs what the base
model's does. With config.lora.qlora the frozen Dense kernels are stored as NF4 with double quantisation
(lm_jax.models.nf4), a scanned stack's layer by layer; the models dequantise each inside its matmul.

Init as PEFT: A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros, so the adapted model
starts equal to the base. Each looped layer draws from its own key, so scanned and looped runs start identical.
"""
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lm_jax import models
from lm_jax.models import layers, nf4
from lm_jax.peft import peft_format, targets

NAME = KEY = "lora"      # the config group, and the adapters' top-level key in the params tree
TITLE = "LoRA"
SWITCH = "rank"   # on when config.lora.rank is set (> 0; a negative rank is check's error)


def enabled(config) -> bool:
  group = config.get(NAME)
  return group is not None and group.rank > 0


def qlora(config) -> bool:
  return enabled(config) and config.lora.get("qlora", False)


def scale(config) -> float:
  """s in W + s·A·B: alpha / r, or alpha / sqrt(r) with rslora (Kalajdzievski 2023)."""
  r, alpha = config.lora.rank, config.lora.alpha
  return alpha / math.sqrt(r) if config.lora.rslora else alpha / r


def check(config):
  """One-line ValueError naming the config.lora field that cannot apply to config.model."""
  c = config.lora
  if not isinstance(c.rank, int) or c.rank < 0:   # before enabled(): a negative rank must not turn LoRA off
    raise ValueError(f"config.lora.rank must be a non-negative integer (0 = off), got {c.rank!r}")
  if not enabled(config):
    if c.get("qlora", False):
      raise ValueError("config.lora.qlora needs LoRA adapters: set config.lora.rank > 0")
    return
  if not c.alpha > 0:
    raise ValueError(f"config.lora.alpha must be positive, got {c.alpha!r}")
  if not 0.0 <= c.dropout < 1.0:
    raise ValueError(f"config.lora.dropout must be in [0, 1), got {c.dropout!r}")
  targets.check(config, NAME)
  if c.init_from:
    peft_format.read_config(c.init_from, "LORA")


# ----------------------------------------------------------------------------------------------- layout, init
def _shapes(config) -> dict:
  """{run-layout kernel path: ((a shape, a spec), (b shape, b spec))}."""
  shapes, specs = models.looped_params(config.model)
  r, out = config.lora.rank, {}
  for run_path, group in targets.groups(config, config.lora).items():
    shape, spec = shapes[group[0]].shape, tuple(specs[group[0]])
    n = targets.n_in(spec)
    lead, lead_spec = targets.lead(run_path, group)
    out[run_path] = ((lead + shape[:n] + (r,), P(*lead_spec, *spec[:n], None)),
                     (lead + (r,) + shape[n:], P(*lead_spec, None, *spec[n:])))
  return out


def adapted(config) -> list[tuple[str, ...]]:
  return targets.adapted(config, config.lora)


def _tree(config, leaf) -> dict:
  """Nested {..., module: {'a': leaf(path, 'a', shape, spec), 'b': ...}}."""
  tree = {}
  for run_path, (a, b) in _shapes(config).items():
    targets.put(tree, run_path[:-1], {"a": leaf(run_path, "a", *a), "b": leaf(run_path, "b", *b)})
  return tree


def init(config, rng: jax.Array) -> dict:
  """The adapters tree (without the 'lora' key): A ~ U(-1/sqrt(in), 1/sqrt(in)) per looped layer, B = 0."""
  index = {p: i for i, p in enumerate(targets.kernels(config, config.lora))}
  groups = targets.groups(config, config.lora)

  def leaf(run_path, name, shape, spec):
    if name == "b":
      return jnp.zeros(shape, jnp.float32)
    group = groups[run_path]
    per_layer = shape[1:] if "layers" in run_path else shape
    bound = 1.0 / math.sqrt(math.prod(per_layer[:-1]))
    draws = [jax.random.uniform(jax.random.fold_in(rng, index[p]), per_layer, jnp.float32, -bound, bound)
             for p in group]
    return jnp.stack(draws) if "layers" in run_path else draws[0]
  return _tree(config, leaf)


def logical_axes(config) -> dict:
  """Logical specs of the adapters: A takes the kernel's input axes, B its output axes, the rank axis unsharded."""
  return _tree(config, lambda path, name, shape, spec: spec)


# ---------------------------------------------------------------------------------------------------- storage
def _quantize_patterns(config) -> tuple[list[str], list[str]]:
  """QLoRA: the frozen Dense kernels of the run's layout, and those of them in a scanned stack, as regexes of
  nf4.quantize_tree."""
  frozen = sorted({targets.run_path(config, p) for p in models.looped_params(config.model)[0]
                   if p.endswith("/kernel") and not targets.trains_fully(config.lora, p)})
  regex = lambda path: "^" + re.escape("/".join(path)) + "$"
  return [regex(p) for p in frozen], [regex(p) for p in frozen if config.model.scan_layers and "layers" in p]


def quantize(config, base: dict) -> dict:
  """Base params (no adapters) in the run's storage: NF4 frozen kernels with config.lora.qlora (a scanned stack's
  layer by layer), else as they are."""
  return nf4.quantize_tree(base, *_quantize_patterns(config)) if qlora(config) else base


def dequantize(config, base: dict, dtype) -> dict:
  """Inverse of quantize: NF4 kernels dequantised to `dtype`."""
  return nf4.dequantize_tree(base, dtype) if qlora(config) else base


# ------------------------------------------------------------------------------------------------ merge, apply
def _delta(kernel_shape, a: jax.Array, b: jax.Array) -> jax.Array:
  """A·B as a kernel of `kernel_shape`; a (*lead, *in, r), b (*lead, r, *out)."""
  n_lead = a.ndim + b.ndim - 2 - len(kernel_shape)
  lead, r = a.shape[:n_lead], a.shape[-1]
  a2 = a.reshape(*lead, -1, r).astype(jnp.float32)
  b2 = b.reshape(*lead, r, -1).astype(jnp.float32)
  return jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST).reshape(kernel_shape)


def _apply(params: dict, adapters: dict, s: float) -> dict:
  out = dict(params)
  for k, v in adapters.items():
    if set(v) == {"a", "b"}:
      w = params[k]["kernel"]
      out[k] = {**params[k], "kernel": (w.astype(jnp.float32) + s * _delta(w.shape, v["a"], v["b"])).astype(w.dtype)}
    else:
      out[k] = _apply(params[k], v, s)
  return out


def fold(config, plain: dict, adapters: dict) -> dict:
  """Plain params with the adapters merged into their kernels."""
  return _apply(plain, adapters, scale(config))


def hook(config, *, train: bool):
  """The models.adapter function: x·W + s·(dropout(x)·A)·B, dropout (config.lora.dropout, rng stream 'dropout')
  only when `train`."""
  s, rate = scale(config), config.lora.dropout if train else 0.0

  def adapt(module, x, dense):
    a, b = module.get_variable(layers.ADAPTERS, "a"), module.get_variable(layers.ADAPTERS, "b")
    y = dense(x)
    if rate:
      x = layers.dropout(x, rate, module.make_rng("dropout"))
    h = jnp.tensordot(x.astype(module.dtype), a.astype(module.dtype), a.ndim - 1) * s
    return y + jnp.tensordot(h, b.astype(module.dtype), 1)
  return adapt


# ----------------------------------------------------------------------------------------------------- the format
def save(config, params: dict, out_dir: str):
  """The adapters and modules_to_save of the run's host params, in the PEFT format.

  Keys are base_model.model.<HF module>.lora_A.weight (r, in) and .lora_B.weight (out, r), the module names those of
  the family's HF table (lm_jax/hf/*.py `table`). The scale is PEFT's: lora_alpha / r (use_rslora: / sqrt(r)), per
  module through rank_pattern / alpha_pattern. OpenAIGPT fuses query, key and value into one Conv1D, c_attn
  (fan_in_fan_out): k adapted parts of rank r become one c_attn adapter of rank k·r, A the k A's side by side and B
  block-diagonal (zero rows for a part not adapted), with rank_pattern / alpha_pattern keeping the scale; any subset
  of query / key / value maps exactly."""
  m, c, s = config.model, config.lora, scale(config)
  names = peft_format.table(m)
  looped = models.family(m).relaid(m, params[KEY], scan=False)
  adapters = {"/".join(k) + "/kernel": v for k, v in _flat(looped).items()}
  tensors, modules, qkv = {}, set(), {}
  for path, node in adapters.items():
    name, _ = names[path]
    a = np.asarray(node["a"], np.float32).reshape(-1, c.rank)
    b = np.asarray(node["b"], np.float32).reshape(c.rank, -1)
    if peft_format.fused(name):
      module, part = peft_format.fused(name)
      qkv.setdefault(module, {})[part] = (a, b)
      continue
    module = name.removesuffix(".weight")
    modules.add(module)
    tensors[f"{peft_format.PREFIX}{module}.lora_A.weight"] = a.T
    tensors[f"{peft_format.PREFIX}{module}.lora_B.weight"] = b.T
  rank_pattern, alpha_pattern = {}, {}
  for module, parts in qkv.items():
    order = sorted(parts)
    width = parts[order[0]][1].shape[1]
    k = len(order)
    b = np.zeros((3 * width, k * c.rank), np.float32)
    for j, part in enumerate(order):
      b[part * width:(part + 1) * width, j * c.rank:(j + 1) * c.rank] = parts[part][1].T
    modules.add(module)
    tensors[f"{peft_format.PREFIX}{module}.lora_A.weight"] = np.concatenate([parts[p][0].T for p in order])
    tensors[f"{peft_format.PREFIX}{module}.lora_B.weight"] = b
    if k > 1:   # keep PEFT's scale alpha' / r' (or / sqrt(r')) at s with r' = k r
      rank_pattern[_escape(module)] = k * c.rank
      alpha_pattern[_escape(module)] = s * (math.sqrt(k * c.rank) if c.rslora else k * c.rank)
  trained = peft_format.saved_tensors(config, NAME, params)
  tensors |= {peft_format.PREFIX + name: t for name, t in trained.items()}
  adapter_config = {
      "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
      "r": c.rank, "lora_alpha": c.alpha, "lora_dropout": c.dropout, "use_rslora": bool(c.rslora),
      "target_modules": sorted(modules), "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
      "modules_to_save": sorted({n.rsplit(".", 1)[0] for n in trained}) or None,
      "fan_in_fan_out": peft_format.fan_in_fan_out(m), "bias": "none", "init_lora_weights": True, "use_dora": False}
  peft_format.write(out_dir, adapter_config, tensors)


def load(config, path: str) -> dict:
  """{'lora': adapters, modules_to_save params} in the run's layout from the PEFT directory `path`. The adapters
  must be those config.lora.targets / rank describe: a missing, extra or misshapen one is a one-line error naming
  the tensor. PEFT's per-module scale is folded into B, so the run's scale s gives the same W + s·A·B. A c_attn
  adapter splits back: a rank-k·r block-diagonal one into its blocks, a rank-r one (PEFT-trained) into parts sharing
  A."""
  fields, m, r, s = peft_format.read_config(path, "LORA"), config.model, config.lora.rank, scale(config)
  file = os.path.join(path, peft_format.WEIGHTS_FILE)
  tensors, names = peft_format.read_tensors(path, m), peft_format.table(m)
  by_module = {}
  for looped, (name, _) in names.items():
    if looped.endswith("/kernel"):
      module, part = peft_format.fused(name) or (name.removesuffix(".weight"), None)
      by_module.setdefault(module, []).append((looped, part))
  wanted = set(targets.kernels(config, config.lora))
  adapters, used = {}, set()
  for module, members in by_module.items():
    a_name, b_name = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
    if a_name not in tensors:
      continue
    used |= {a_name, b_name}
    if b_name not in tensors:
      raise ValueError(f"{file}: {peft_format.PREFIX}{b_name} is missing")
    a, b = tensors[a_name], tensors[b_name]
    rank = a.shape[0]
    b = b * (_peft_scale(fields, module, rank) / s)
    if members[0][1] is None:
      adapters[members[0][0]] = (a.T, b.T)
    else:
      adapters |= _split_fused(file, module, members, a, b, wanted, r)
  unused = sorted(set(k for k in tensors if ".lora_" in k) - used)
  if unused:
    raise ValueError(f"{file}: {peft_format.PREFIX}{unused[0]} names no module of this {m.family} model")
  for looped in sorted(wanted | set(adapters)):
    name = names[looped][0]
    if looped not in adapters:
      raise ValueError(f"{file}: no adapter for {name} (config.lora.targets matches {looped})")
    if looped not in wanted:
      raise ValueError(f"{file}: adapter of {name} ({looped}) is not in config.lora.targets="
                       f"{tuple(config.lora.targets)}")
  shapes, specs = models.looped_params(config.model)
  out = {}
  for looped, (a, b) in adapters.items():
    kernel, n = shapes[looped].shape, targets.n_in(specs[looped])
    if a.shape != (math.prod(kernel[:n]), r) or b.shape != (r, math.prod(kernel[n:])):
      module = names[looped][0].removesuffix(".weight")
      raise ValueError(f"{file}: the adapter of {module} has A {a.shape[::-1]}, B {b.shape[::-1]}; config.lora.rank="
                       f"{r} and the model need A {(r, math.prod(kernel[:n]))}, B {(math.prod(kernel[n:]), r)}")
    targets.put(out, tuple(looped.split("/")[:-1]), {"a": a.reshape(*kernel[:n], r), "b": b.reshape(r, *kernel[n:])})
  return models.family(m).relaid(m, {KEY: out, **peft_format.saved_params(config, NAME, tensors)}, scan=True)


def _flat(tree, prefix=()) -> dict:
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) and set(v) != {"a", "b"} else {prefix + (k,): v})
  return out


def _escape(module: str) -> str:
  """A rank_pattern key matching exactly this module (PEFT matches keys as regexes on the module name)."""
  return "^" + re.escape(module) + "$"


def _peft_scale(fields: dict, module: str, rank: int) -> float:
  """PEFT's scale of `module`: alpha (alpha_pattern's first matching key, else lora_alpha) / rank (or sqrt)."""
  alpha = fields.get("lora_alpha", 8)
  for key, value in (fields.get("alpha_pattern") or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      alpha = value
      break
  return alpha / math.sqrt(rank) if fields.get("use_rslora") else alpha / rank


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
    raise ValueError(f"{file}: {peft_format.PREFIX}{module}.lora_A.weight has rank {rank}; with config.lora.rank={r} "
                     f"and {len(targeted)} of query/key/value targeted it must be {r} or {len(targeted) * r}")
  if not np.array_equal(expected, b):
    raise ValueError(f"{file}: {peft_format.PREFIX}{module}.lora_B.weight changes a part of query/key/value that "
                     "config.lora.targets does not adapt (or is not block-diagonal over them)")
  return out

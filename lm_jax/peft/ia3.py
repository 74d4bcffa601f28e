"""IA³ (Liu et al. 2022, "Few-Shot Parameter-Efficient Fine-Tuning is Better and Cheaper than In-Context
Learning") as a transformation of the parameter tree: one adapter method behind lm_jax.params (the functions of
lm_jax/peft/methods.py), as PEFT's IA3Config / IA3Model define it.

Each Dense kernel config.ia3.targets matches gets a learned vector, initialised to ones, under the top-level params
key 'ia3' at the kernel's module path: {'l_out': (*out,)} scales the Dense's output (bias included), or, for the
kernels config.ia3.feedforward matches too, {'l_in': (*in,)} scales its input (PEFT's feedforward_modules); a
scanned stack's vectors get a leading layer axis. Training applies them through models.adapter (`hook`); eval and
decoding fold them into the kernels (and the output-scaled biases), exactly. The vectors and
config.ia3.modules_to_save train, nothing else. The method is on when config.ia3.targets is non-empty.

The PEFT format: base_model.model.<HF module>.ia3_l, (out, 1) for an output vector and (1, in) for an input one;
OpenAIGPT's fused c_attn takes the query / key / value output vectors side by side (ones for a part not targeted).
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lm_jax import models
from lm_jax.models import layers
from lm_jax.peft import peft_format, targets

NAME = KEY = "ia3"       # the config group, and the vectors' top-level key in the params tree
TITLE = "IA³"
SWITCH = "targets"   # on when config.ia3.targets names kernels


def enabled(config) -> bool:
  group = config.get(NAME)
  return group is not None and bool(group.targets)


def _feedforward(config, looped: str) -> bool:
  return any(re.search(rx, looped) for rx in config.ia3.feedforward)


def check(config):
  """One-line ValueError naming the config.ia3 field that cannot apply to config.model."""
  if not enabled(config):
    return
  c = config.ia3
  for rx in c.feedforward:
    try:
      re.compile(rx)
    except re.error as e:
      raise ValueError(f"config.ia3.feedforward: {rx!r} is not a regular expression ({e})") from None
  targets.check(config, NAME)
  kernels = targets.kernels(config, c)
  for rx in c.feedforward:
    if not any(re.search(rx, p) for p in kernels):
      raise ValueError(f"config.ia3.feedforward: {rx!r} matches no kernel of config.ia3.targets (PEFT's "
                       "feedforward_modules must be a subset of its target_modules)")
  if c.init_from:
    peft_format.read_config(c.init_from, "IA3")


# ----------------------------------------------------------------------------------------------- layout, init
def _vectors(config) -> dict:
  """{run-layout kernel path: (name 'l_in' | 'l_out', shape, logical spec)}."""
  shapes, specs = models.looped_params(config.model)
  out = {}
  for run_path, group in targets.groups(config, config.ia3).items():
    shape, spec = shapes[group[0]].shape, tuple(specs[group[0]])
    n = targets.n_in(spec)
    lead, lead_spec = targets.lead(run_path, group)
    ff = _feedforward(config, group[0])
    dims, dims_spec = (shape[:n], spec[:n]) if ff else (shape[n:], spec[n:])
    out[run_path] = ("l_in" if ff else "l_out", lead + dims, P(*lead_spec, *dims_spec))
  return out


def adapted(config) -> list[tuple[str, ...]]:
  return targets.adapted(config, config.ia3)


def _tree(config, leaf) -> dict:
  tree = {}
  for run_path, (name, shape, spec) in _vectors(config).items():
    targets.put(tree, run_path[:-1], {name: leaf(shape, spec)})
  return tree


def init(config, rng: jax.Array) -> dict:
  """The vectors (without the 'ia3' key): ones, so the adapted model starts equal to the base (rng unused)."""
  del rng
  return _tree(config, lambda shape, spec: jnp.ones(shape, jnp.float32))


def logical_axes(config) -> dict:
  """Logical specs of the vectors: those of the kernel dims they scale."""
  return _tree(config, lambda shape, spec: spec)


def quantize(config, base: dict) -> dict:
  """IA³ keeps the base as it is."""
  return base


def dequantize(config, base: dict, dtype) -> dict:
  """IA³ keeps the base as it is."""
  return base


# ------------------------------------------------------------------------------------------------ fold, apply
def _fold(params: dict, vectors: dict, lead: int = 0) -> dict:
  """params with each adapted kernel (and output-scaled bias) times its vector; `lead` layer axes (a scanned stack)
  come first in both."""
  out = dict(params)
  for k, v in vectors.items():
    if "l_in" not in v and "l_out" not in v:
      out[k] = _fold(params[k], v, lead + (k == "layers"))
      continue
    node = dict(params[k])
    w = node["kernel"]
    if "l_in" in v:     # (*lead, *in): broadcast over the out dims
      l = v["l_in"]
      node["kernel"] = (w * l.reshape(l.shape + (1,) * (w.ndim - l.ndim))).astype(w.dtype)
    else:               # (*lead, *out): broadcast over the in dims, and scale the bias
      l = v["l_out"]
      node["kernel"] = (w * l.reshape(l.shape[:lead] + (1,) * (w.ndim - l.ndim) + l.shape[lead:])).astype(w.dtype)
      if "bias" in node:
        node["bias"] = (node["bias"] * l).astype(node["bias"].dtype)
    out[k] = node
  return out


def fold(config, plain: dict, vectors: dict) -> dict:
  """Plain params with the vectors folded into their kernels: the model the adapted one computes."""
  return _fold(plain, vectors)


def hook(config, *, train: bool):
  """The models.adapter function: dense(x · l_in) or dense(x) · l_out, as PEFT's IA3 Linear.forward."""
  del config, train

  def adapt(module, x, dense):
    if module.has_variable(layers.ADAPTERS, "l_in"):
      return dense(x * module.get_variable(layers.ADAPTERS, "l_in").astype(module.dtype))
    return dense(x) * module.get_variable(layers.ADAPTERS, "l_out").astype(module.dtype)
  return adapt


# ----------------------------------------------------------------------------------------------------- the format
def _looped_vectors(config, params: dict) -> dict:
  """{looped kernel path: (name, float32 vector flat in the kernel's dims' row-major order)}."""
  flat, groups = {}, targets.groups(config, config.ia3)
  for run_path, (name, _, _) in _vectors(config).items():
    node = params[KEY]
    for k in run_path[:-1]:
      node = node[k]
    value = np.asarray(node[name], np.float32)
    for i, path in enumerate(groups[run_path]):
      flat[path] = (name, (value[i] if "layers" in run_path else value).reshape(-1))
  return flat


def save(config, params: dict, directory: str):
  """The vectors and modules_to_save of the run's host params, in the PEFT format."""
  names = peft_format.table(config.model)
  tensors, modules, feedforward, qkv = {}, set(), set(), {}
  for looped, (name, l) in _looped_vectors(config, params).items():
    hf_name = names[looped][0]
    if peft_format.fused(hf_name):
      module, part = peft_format.fused(hf_name)
      if name == "l_in":
        raise ValueError(f"config.ia3.feedforward matches {looped}: the input of OpenAIGPT's fused {module} is shared "
                         "by query, key and value, so PEFT cannot hold its vector; scale their outputs instead")
      qkv.setdefault(module, {})[part] = l
      continue
    module = hf_name.removesuffix(".weight")
    modules.add(module)
    if name == "l_in":
      feedforward.add(module)
    tensors[f"{peft_format.PREFIX}{module}.ia3_l"] = l[None, :] if name == "l_in" else l[:, None]
  for module, parts in qkv.items():
    width = len(next(iter(parts.values())))
    modules.add(module)
    tensors[f"{peft_format.PREFIX}{module}.ia3_l"] = np.concatenate(
        [parts.get(i, np.ones(width, np.float32)) for i in range(3)])[:, None]
  trained = peft_format.saved_tensors(config, NAME, params)
  tensors |= {peft_format.PREFIX + n: t for n, t in trained.items()}
  peft_format.write(directory, {
      "peft_type": "IA3", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
      "target_modules": sorted(modules), "feedforward_modules": sorted(feedforward),
      "modules_to_save": sorted({n.rsplit(".", 1)[0] for n in trained}) or None,
      "fan_in_fan_out": peft_format.fan_in_fan_out(config.model), "init_ia3_weights": True}, tensors)


def load(config, directory: str) -> dict:
  """{'ia3': vectors, modules_to_save params} in the run's layout from a PEFT IA3 directory. The vectors must be
  those config.ia3.targets / feedforward describe: a missing, extra or misshapen one is a one-line error naming the
  tensor."""
  peft_format.read_config(directory, "IA3")
  file = f"{directory}/{peft_format.WEIGHTS_FILE}"
  tensors, names = peft_format.read_tensors(directory, config.model), peft_format.table(config.model)
  shapes, specs = models.looped_params(config.model)
  vectors, used, fused_parts = {}, set(), {}
  for looped in targets.kernels(config, config.ia3):
    kernel, n = shapes[looped].shape, targets.n_in(specs[looped])
    name = "l_in" if _feedforward(config, looped) else "l_out"
    dims = kernel[:n] if name == "l_in" else kernel[n:]
    hf_name = names[looped][0]
    module, part = peft_format.fused(hf_name) or (hf_name.removesuffix(".weight"), None)
    key = f"{module}.ia3_l"
    if key not in tensors:
      raise ValueError(f"{file}: no {peft_format.PREFIX}{key} (config.ia3.targets matches {looped})")
    used.add(key)
    t = tensors[key]
    want = (1, math.prod(dims)) if name == "l_in" else ((3 if part is not None else 1) * math.prod(dims), 1)
    if t.shape != want:
      raise ValueError(f"{file}: {peft_format.PREFIX}{key} has shape {t.shape}; config.ia3 and the model need "
                       f"{want} ({'input' if name == 'l_in' else 'output'} scaling)")
    l = t.reshape(-1)
    if part is not None:
      fused_parts.setdefault(key, set()).add(part)
      l = l[part * len(l) // 3:(part + 1) * len(l) // 3]
    targets.put(vectors, tuple(looped.split("/")[:-1]), {name: l.reshape(dims)})
  for key, parts in fused_parts.items():   # a part the run does not target must be PEFT's identity
    rest = np.delete(tensors[key].reshape(3, -1), sorted(parts), axis=0)
    if not np.all(rest == 1):
      raise ValueError(f"{file}: {peft_format.PREFIX}{key} scales a part of query/key/value that config.ia3.targets "
                       "does not target")
  unused = sorted(k for k in tensors if k.endswith(".ia3_l") and k not in used)
  if unused:
    raise ValueError(f"{file}: {peft_format.PREFIX}{unused[0]} is not in config.ia3.targets="
                     f"{tuple(config.ia3.targets)}")
  params = {KEY: vectors, **peft_format.saved_params(config, NAME, tensors)}
  return models.family(config.model).relaid(config.model, params, scan=True)

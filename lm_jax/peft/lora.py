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
import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lm_jax.models import layers, nf4
from lm_jax.peft import peft_format, targets

NAME = KEY = "lora"      # the config group, and the adapters' top-level key in the params tree
TITLE = "LoRA"


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
  if not enabled(config):
    if c.get("qlora", False):
      raise ValueError("config.lora.qlora needs LoRA adapters: set config.lora.rank > 0")
    return
  if not isinstance(c.rank, int) or c.rank < 0:
    raise ValueError(f"config.lora.rank must be a non-negative integer (0 = off), got {c.rank!r}")
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
  shapes, specs = targets.looped_params(config)
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
  frozen = sorted({targets.run_path(config, p) for p in targets.looped_params(config)[0]
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
def save(config, params: dict, directory: str):
  """The adapters and modules_to_save of the run's host params, in the PEFT format."""
  peft_format.save_lora(config, params, directory, scale(config))


def load(config, directory: str) -> dict:
  """{'lora': adapters, modules_to_save params} in the run's layout from a PEFT LoRA directory."""
  return peft_format.load_lora(config, directory, scale(config))

"""LoRA (Hu et al. 2022) and QLoRA (Dettmers et al. 2023) as a transformation of the parameter tree, not of the
models (docs/lora.md).

config.lora.rank > 0 adds adapters under the top-level params key 'lora', mirroring the path of each targeted
Dense kernel W: {'a': (*in, r), 'b': (r, *out)} (a leading layer axis in a scanned stack), i.e. PEFT's lora_A /
lora_B of the HF Linear whose weight is W flattened to (in, out), transposed. s = alpha / r (alpha / sqrt(r) with
rslora). Two equivalent ways to run them:
  unmerged     training: inside `with unmerged(config, train=True)` the models run params that hold adapters, and
               each adapted Dense adds s·(dropout(x)·A)·B to x·W (lm_jax.models.adapter). The frozen W gets no
               weight gradient, and config.lora.dropout drops the adapter's input as PEFT's lora_dropout does.
  materialize  eval and decoding: plain params with each adapted kernel W + s·A·B, so a KV-cache decode step costs
               what the base model's does.
models.apply refuses params that still hold adapters outside `unmerged`, and `unmerged` fails when an adapter was
never applied, so no path can silently run without them.

Only the adapters and the params matched by config.lora.modules_to_save (PEFT's name; the task head by default)
train: finetune.trainable_mask gives the step and the optimizer that split, so the base gets no gradients and no
optimizer state. With config.qlora the frozen Dense kernels are stored as NF4 with double quantisation
(lm_jax.models.nf4), a scanned stack's layer by layer; the models dequantise each inside its matmul
(layers.Dense, nf4.matmul), so a step holds one float kernel at a time, not a float copy of the model.

Init as PEFT: A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros, so the adapted model
starts equal to the base. Each looped layer draws from its own key, so scanned and looped runs start identical.
"""
import contextlib
import dataclasses
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from lm_jax import models
from lm_jax.models import layers
from lm_jax.models import nf4

KEY = models.ADAPTERS                 # the adapters' top-level key in the params tree
_LAYER = re.compile(r"layers_(\d+)")


def enabled(config) -> bool:
  group = config.get("lora")
  return group is not None and group.rank > 0


def scale(config) -> float:
  """s in W + s·A·B: alpha / r, or alpha / sqrt(r) with rslora (Kalajdzievski 2023)."""
  r, alpha = config.lora.rank, config.lora.alpha
  return alpha / math.sqrt(r) if config.lora.rslora else alpha / r


# ----------------------------------------------------------------------------------------------------- targets
@functools.lru_cache(maxsize=16)
def _looped(model_json: str) -> tuple[dict, dict]:
  """({looped path string: ShapeDtypeStruct}, {same: logical PartitionSpec}) of every param."""
  cfg = layers.replace(ml_collections.ConfigDict(json.loads(model_json)), scan_layers=False)
  flat = lambda tree: {"/".join(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, P))}
  return flat(models.abstract_params(cfg)), flat(models.logical_axes(cfg))


def _looped_params(config):
  return _looped(config.model.to_json())


def _n_in(spec) -> int:
  """Input dims of a Dense kernel: the attention output projection contracts (heads, kv); every other one dim."""
  return 2 if tuple(spec[:2]) == ("heads", "kv") else 1


def targets(config) -> list[str]:
  """Looped paths of the Dense kernels config.lora.targets matches, e.g. 'layers_0/attention/query/kernel'."""
  shapes, _ = _looped_params(config)
  return [p for p in shapes if p.endswith("/kernel") and not _trains_fully(config, p)
          and any(re.search(rx, p) for rx in config.lora.targets)]


def _trains_fully(config, path: str) -> bool:
  return any(re.search(rx, path) for rx in config.lora.modules_to_save)


def _run_path(config, looped: str) -> tuple[str, ...]:
  """Path in the run's layout: a scanned stack keeps all its layers under 'layers'."""
  keys = tuple(looped.split("/"))
  return tuple("layers" if config.model.scan_layers and _LAYER.fullmatch(k) else k for k in keys)


def _groups(config) -> dict:
  """{run-layout kernel path: [looped kernel paths, in layer order]}."""
  out = {}
  for p in targets(config):
    out.setdefault(_run_path(config, p), []).append(p)
  return out


def check(config):
  """One-line ValueError naming the config.lora / config.qlora field that cannot apply to config.model."""
  qlora = config.get("qlora", False)
  if not enabled(config):
    if qlora:
      raise ValueError("config.qlora needs LoRA adapters: set config.lora.rank > 0")
    return
  c = config.lora
  if not isinstance(c.rank, int) or c.rank < 0:
    raise ValueError(f"config.lora.rank must be a non-negative integer (0 = off), got {c.rank!r}")
  if not c.alpha > 0:
    raise ValueError(f"config.lora.alpha must be positive, got {c.alpha!r}")
  if not 0.0 <= c.dropout < 1.0:
    raise ValueError(f"config.lora.dropout must be in [0, 1), got {c.dropout!r}")
  if config.finetune.freeze:
    raise ValueError("config.finetune.freeze and config.lora.rank > 0 exclude each other: with LoRA only the "
                     "adapters and config.lora.modules_to_save train")
  for field in ("targets", "modules_to_save"):
    for rx in c[field]:
      try:
        re.compile(rx)
      except re.error as e:
        raise ValueError(f"config.lora.{field}: {rx!r} is not a regular expression ({e})") from None
  shapes, _ = _looped_params(config)
  kernels = [p for p in shapes if p.endswith("/kernel")]
  for rx in c.targets:
    if not any(re.search(rx, p) for p in kernels):
      raise ValueError(f"config.lora.targets: {rx!r} matches no Dense kernel (paths look like {kernels[0]!r}, "
                       f"{next((p for p in kernels if 'layers_' in p), kernels[-1])!r})")
  if not c.targets:
    raise ValueError("config.lora.targets is empty: name the kernels to adapt, e.g. ('attention/(query|value)/',)")
  for run_path, group in _groups(config).items():
    if config.model.scan_layers and "layers" in run_path:
      stack = [p for p in kernels if _run_path(config, p) == run_path]
      if len(group) != len(stack):
        raise ValueError(f"config.lora.targets={tuple(c.targets)!r} adapts some layers of a scanned stack "
                         f"({'/'.join(run_path)}); set config.model.scan_layers=False")
  if c.init_from:
    from lm_jax.peft import peft_format
    peft_format.read_config(c.init_from)


# ----------------------------------------------------------------------------------------------- layout, init
def _adapter_shapes(config) -> dict:
  """{run-layout kernel path: ((a shape, a spec), (b shape, b spec))}."""
  shapes, specs = _looped_params(config)
  r, out = config.lora.rank, {}
  for run_path, group in _groups(config).items():
    shape, spec = shapes[group[0]].shape, tuple(specs[group[0]])
    n = _n_in(spec)
    lead, lead_spec = ((len(group),), ("layers",)) if "layers" in run_path else ((), ())
    out[run_path] = ((lead + shape[:n] + (r,), P(*lead_spec, *spec[:n], None)),
                     (lead + (r,) + shape[n:], P(*lead_spec, None, *spec[n:])))
  return out


def _set(tree: dict, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _adapter_tree(config, leaf) -> dict:
  """{'lora': nested {..., module: {'a': leaf(path, 'a', shape, spec), 'b': ...}}}."""
  tree = {}
  for run_path, (a, b) in _adapter_shapes(config).items():
    _set(tree, run_path[:-1], {"a": leaf(run_path, "a", *a), "b": leaf(run_path, "b", *b)})
  return tree


def init_adapters(config, rng: jax.Array) -> dict:
  """The adapters tree (without the 'lora' key): A ~ U(-1/sqrt(in), 1/sqrt(in)) per looped layer, B = 0."""
  index = {p: i for i, p in enumerate(targets(config))}
  groups = _groups(config)

  def leaf(run_path, name, shape, spec):
    if name == "b":
      return jnp.zeros(shape, jnp.float32)
    group = groups[run_path]
    per_layer = shape[1:] if "layers" in run_path else shape
    bound = 1.0 / math.sqrt(math.prod(per_layer[:-1]))
    draws = [jax.random.uniform(jax.random.fold_in(rng, index[p]), per_layer, jnp.float32, -bound, bound)
             for p in group]
    return jnp.stack(draws) if "layers" in run_path else draws[0]
  return _adapter_tree(config, leaf)


def _quantize_patterns(config) -> tuple[list[str], list[str]]:
  """QLoRA: the frozen Dense kernels of the run's layout, and those of them in a scanned stack, as regexes of
  nf4.quantize_tree."""
  frozen = sorted({_run_path(config, p) for p in _looped_params(config)[0]
                   if p.endswith("/kernel") and not _trains_fully(config, p)})
  regex = lambda path: "^" + re.escape("/".join(path)) + "$"
  return [regex(p) for p in frozen], [regex(p) for p in frozen if config.model.scan_layers and "layers" in p]


def quantize(config, base: dict) -> dict:
  """Base params (no adapters) in the run's storage: NF4 frozen kernels with config.qlora (a scanned stack's layer
  by layer), else as they are."""
  if not config.get("qlora", False):
    return base
  return nf4.quantize_tree(base, *_quantize_patterns(config))


def init_params(config, rng: jax.Array) -> dict:
  """Fresh params of the run: models.init(config.model) (quantised with qlora) plus fresh adapters."""
  if not enabled(config):
    return models.init(config.model, rng)
  targets(config)   # outside the trace: validates config.model, caches the target list
  return jax.jit(lambda r: {**quantize(config, models.init(config.model, r)),
                            KEY: init_adapters(config, jax.random.fold_in(r, 1))})(rng)


def abstract_params(config) -> dict:
  """ShapeDtypeStructs of the run's params (models.abstract_params without LoRA)."""
  return jax.eval_shape(lambda: init_params(config, jax.random.key(0))) if enabled(config) else \
      models.abstract_params(config.model)


def _nf4_specs(q, spec: P):
  """Logical specs of an NF4 kernel's parts: the 4-bit codes and 8-bit absmax, flat in row-major order, split as
  the kernel's first input axis is (whole rows per shard, as the float kernel's would be); the few statistics
  left replicated. A scanned stack's leading layer axis stays one."""
  lead = tuple(spec[:len(nf4.layers(q))])
  first = spec[len(lead)]
  return dataclasses.replace(q, codes=P(*lead, first), absmax=P(*lead, first),
                             absmax_scale=None if q.absmax_scale is None else P(*lead, None),
                             absmax_mean=None if q.absmax_mean is None else P(*lead))


def _specs_like(abstract, specs):
  """`specs` (the plain model's) with each NF4-quantised kernel's spec made the specs of its parts."""
  if isinstance(specs, P):
    return specs if isinstance(abstract, jax.ShapeDtypeStruct) else _nf4_specs(abstract, specs)
  return {k: _specs_like(abstract[k], v) for k, v in specs.items()}


def logical_axes(config) -> dict:
  """Logical PartitionSpecs of the run's params: A takes the kernel's input axes, B its output axes, the rank
  axis is unsharded."""
  specs = models.logical_axes(config.model)
  if not enabled(config):
    return specs
  base = {k: v for k, v in abstract_params(config).items() if k != KEY}
  return {**_specs_like(base, specs), KEY: _adapter_tree(config, lambda path, name, shape, spec: spec)}


def trainable_mask(config) -> dict:
  """Bool tree over the run's params: True for the adapters and config.lora.modules_to_save."""
  def walk(tree, path):
    if not isinstance(tree, dict):
      return path[0] == KEY or _trains(path)
    return {k: walk(v, path + (k,)) for k, v in tree.items()}

  def _trains(path):
    if "layers" not in path:
      return _trains_fully(config, "/".join(path))
    looped = [p for p in _looped_params(config)[0] if _run_path(config, p)[:len(path)] == path]
    found = {_trains_fully(config, p) for p in looped}
    if len(found) > 1:
      raise ValueError(f"config.lora.modules_to_save={tuple(config.lora.modules_to_save)!r} trains some layers of "
                       f"a scanned stack ({'/'.join(path)}); set config.model.scan_layers=False")
    return found.pop()
  return walk(abstract_params(config), ())


def count(config) -> tuple[int, int]:
  """(trainable, total) parameters: the adapters plus modules_to_save, of the model plus its adapters."""
  shapes, _ = _looped_params(config)
  saved = sum(math.prod(a.shape) for p, a in shapes.items() if _trains_fully(config, p))
  adapters = models.count(jax.eval_shape(lambda: init_adapters(config, jax.random.key(0))))
  return adapters + saved, models.count(models.abstract_params(config.model)) + adapters


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


def merge(params: dict, adapters: dict, s: float) -> dict:
  """Plain params (no 'lora' key) with each adapted kernel W + s·A·B; `adapters` is params['lora'], s = scale()."""
  return _apply({k: v for k, v in params.items() if k != KEY}, adapters, s)


def unmerge(merged: dict, adapters: dict, s: float) -> dict:
  """Inverse of merge: the base params again, within float32 rounding."""
  return _apply(merged, adapters, -s)


def base(config, params: dict) -> dict:
  """The base model's plain params: adapters dropped, NF4 kernels dequantised to model.param_dtype."""
  plain = {k: v for k, v in params.items() if k != KEY}
  if enabled(config) and config.get("qlora", False):
    plain = nf4.dequantize_tree(plain, layers.dtype(config.model.param_dtype))
  return plain


def merged(config, params: dict) -> dict:
  """The model a run trained, as plain params in model.param_dtype: `base` with the adapters merged in (what
  --export_merged writes and a next stage's init_from reads); params as they are without LoRA."""
  plain = base(config, params)
  return merge(plain, params[KEY], scale(config)) if enabled(config) else plain


def materialize(config, params: dict) -> dict:
  """Plain params for eval and decoding: adapters merged into their kernels, NF4 kernels dequantised to
  model.dtype; params as they are without LoRA. Jittable."""
  if not enabled(config):
    return params
  plain = {k: v for k, v in params.items() if k != KEY}
  if config.get("qlora", False):
    plain = nf4.dequantize_tree(plain, layers.dtype(config.model.dtype))
  return _apply(plain, params[KEY], scale(config))


@contextlib.contextmanager
def unmerged(config, *, train: bool):
  """Within it (inside a traced function), models.apply runs params holding adapters (and NF4 kernels with
  qlora): each adapted Dense returns x·W + s·(dropout(x)·A)·B, dropout (config.lora.dropout, rng stream 'dropout')
  only when `train`. On exit, a ValueError if some adapter of the run was never applied."""
  if not enabled(config):
    yield
    return
  s, rate = scale(config), config.lora.dropout if train else 0.0
  applied = set()

  def adapt(module, x, y):
    a, b = module.get_variable(KEY, "a"), module.get_variable(KEY, "b")
    applied.add(module.path)
    if rate:
      x = layers.dropout(x, rate, module.make_rng("dropout"))
    n_in = a.ndim - 1
    h = jnp.tensordot(x.astype(module.dtype), a.astype(module.dtype), n_in) * s
    return y + jnp.tensordot(h, b.astype(module.dtype), 1)

  with models.adapter(adapt):
    yield
  missing = sorted("/".join(p[:-1]) for p in _adapter_shapes(config) if p[:-1] not in applied)
  if missing:
    raise ValueError(f"LoRA adapters of {', '.join(missing)} were never applied: the model ran no Dense there")


def prepare(config, pretrained: dict, fill: bool = False) -> dict:
  """Pre-trained plain params in the run's storage (NF4 with qlora) with the adapters and modules_to_save of the
  PEFT directory config.lora.init_from; with `fill`, fresh adapters (seed config.seed) when there is none."""
  if not enabled(config):
    return pretrained
  params = jax.jit(lambda p: quantize(config, p))(pretrained)
  if config.lora.init_from:
    from lm_jax.peft import peft_format
    loaded = peft_format.load(config, config.lora.init_from)
    params = _overlay(params, loaded)
  elif fill:
    params[KEY] = init_adapters(config, jax.random.fold_in(jax.random.key(config.seed), 1))
  return params


def _overlay(tree: dict, new: dict) -> dict:
  out = dict(tree)
  for k, v in new.items():
    out[k] = _overlay(tree[k], v) if isinstance(v, dict) and k in tree else v
  return out

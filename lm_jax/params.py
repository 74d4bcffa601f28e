"""The run's params policy: what its params are and what of them trains, whichever adapter method is on.

- What the params are: the model's (models.init), plus, with an adapter method (config.lora, config.ia3:
  lm_jax/peft/methods.py), its adapters under the method's params key, and the frozen base in the method's storage
  (QLoRA's NF4). init / abstract / logical_axes give them; `from_pretrained` puts pre-trained plain params in that
  form.
- What trains (Policy.trainable, split / join): with a method, its adapters and config.<method>.modules_to_save;
  else all but the params config.finetune.freeze matches (regexes over '/'-joined paths, layers named as when
  looped: 'word_embeddings/embedding', 'layers_3/mlp/wi/kernel') and DPO's frozen reference copy
  (model.frozen_reference). The step differentiates only the trainable part and the optimizer keeps state only for
  it, while checkpoints hold every parameter.
- The layer-wise lr: finetune.layer_decay < 1 gives layer i lr * decay^(num_layers - i) (optim.layer_lr_scales).
- How they run: the step runs the adapters unmerged inside `running`; eval and decoding read plain params in the
  compute dtype (for_inference), export and a next stage's init_from in the stored dtype (folded, base). save_adapter
  writes the adapters in the PEFT format.
The policy is resolved from the config once (`resolve`: which method is on, what trains, the dtypes) and held by the
run's layout; every function here takes that Policy as `run` (a config is resolved on the spot, for one-off callers).
The step, the trainer, PPO and DPO call this module and never a method by name.
"""
import contextlib
import dataclasses
import functools
import math
import re

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from lm_jax import defaults, models
from lm_jax.models import layers, mup, nf4
from lm_jax.peft import methods, targets


ADAPTER_GROUPS = tuple(methods.METHODS)   # the config groups of the adapter methods ('lora', 'ia3')


def _active(config):
  """The adapter method config turns on (its group's SWITCH field is set), or None; a one-line ValueError when
  it turns on two. Asked of the methods' declared data, so a run without adapters calls nothing in peft/."""
  on = [name for name, m in methods.METHODS.items() if config.get(name) is not None and config[name][m.SWITCH]]
  if len(on) > 1:
    raise ValueError(f"config.{on[0]} and config.{on[1]} are both on: one adapter method at a time")
  return methods.METHODS[on[0]] if on else None


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
  """A run's params policy, resolved from its config once (`resolve`) and held by its layout (lm_jax.layout)."""
  config: object        # the run's config: the model and the method group the method's functions read
  adapter: object       # the adapter method module that is on (lm_jax/peft/methods.py), or None for plain params
  layer_decay: float    # config.finetune.layer_decay (1.0 = every layer at the same lr)
  param_dtype: object   # model.param_dtype: what `base` and `folded` give (export, a next stage)
  compute_dtype: object   # model.dtype: what `for_inference` gives (eval, decoding)

  @property
  def method(self) -> str | None:
    """The config group of the adapter method that is on ('lora', 'ia3'), or None."""
    return None if self.adapter is None else self.adapter.NAME

  @functools.cached_property
  def trainable(self) -> dict | None:
    """Bool tree over the run's params (in its layout): True for those that train; None when all do. Built at its
    first use (layout.build asks), then held."""
    return _trainable_mask(self)


def resolve(run) -> Policy:
  """The Policy of a config (`run` a Policy: itself)."""
  if isinstance(run, Policy):
    return run
  return Policy(run, _active(run), _layer_decay(run), layers.dtype(run.model.param_dtype),
                layers.dtype(run.model.dtype))


def method(run) -> str | None:
  """The config group of the adapter method that is on ('lora', 'ia3'), or None."""
  return resolve(run).method


def without_adapters(run, params: dict) -> dict:
  """The run's params without the method's adapters, the base in its storage (DPO's reference): no copy, no
  dequantising."""
  m = resolve(run).adapter
  return params if m is None else {k: v for k, v in params.items() if k != m.KEY}


# ----------------------------------------------------------------------------------------------- what they are
def init(run, rng: jax.Array) -> dict:
  """Fresh params of the run: models.init(config.model), with a method its adapters and the base in its storage."""
  p = resolve(run)
  config, m = p.config, p.adapter
  if m is None:
    return _model_init(config.model, rng)
  targets.kernels(config, config[m.NAME])   # outside the trace: validates config.model, caches the targets
  return jax.jit(lambda r: {**m.quantize(config, _model_init(config.model, r)),
                            m.KEY: m.init(config, jax.random.fold_in(r, 1))})(rng)


def _model_init(model_cfg, rng: jax.Array) -> dict:
  """models.init with µP's init scales when model.mup_base_width is set (lm_jax.models.mup)."""
  params = models.init(model_cfg, rng)
  if mup.width_mult(model_cfg) == 1.0:
    return params
  return mup.rescale_init(model_cfg, params, models.logical_axes(model_cfg))


_ABSTRACT = {}   # (model json, method, method group json) -> abstract params: start-up asks for them several times


def abstract(run) -> dict:
  """ShapeDtypeStructs of the run's params (shared: do not mutate)."""
  p = resolve(run)
  if p.adapter is None:
    return models.abstract_params(p.config.model)
  key = (models.cache_key(p.config.model), p.method, models.cache_key(p.config[p.method]))
  if key not in _ABSTRACT:
    if len(_ABSTRACT) >= 16:
      _ABSTRACT.pop(next(iter(_ABSTRACT)))
    _ABSTRACT[key] = jax.eval_shape(lambda: init(p, jax.random.key(0)))
  return _ABSTRACT[key]


def _storage_axes(abstract_tree, specs):
  """`specs` (the plain model's) with each NF4-quantised kernel's spec made the specs of its parts."""
  if isinstance(specs, P):
    return nf4.logical_axes(abstract_tree, specs) if nf4.is_nf4(abstract_tree) else specs
  return {k: _storage_axes(abstract_tree[k], v) for k, v in specs.items()}


def logical_axes(run) -> dict:
  """Logical PartitionSpecs of the run's params, the adapters' included."""
  p = resolve(run)
  specs = models.logical_axes(p.config.model)
  if p.adapter is None:
    return specs
  return {**_storage_axes(without_adapters(p, abstract(p)), specs), p.adapter.KEY: p.adapter.logical_axes(p.config)}


def from_pretrained(run, pretrained: dict, fill: bool = False) -> dict:
  """Pre-trained plain params put in the run's storage (NF4 for QLoRA), with the adapters and modules_to_save of
  the method's PEFT directory (config.<method>.init_from); with `fill`, fresh adapters (seed config.seed) when there
  is none. Plain params as they are without a method."""
  p = resolve(run)
  config, m = p.config, p.adapter
  if m is None:
    return pretrained
  params = jax.jit(lambda t: m.quantize(config, t))(pretrained)
  if config[m.NAME].init_from:
    params = targets.overlay(params, m.load(config, config[m.NAME].init_from))
  elif fill:
    params[m.KEY] = m.init(config, jax.random.fold_in(jax.random.key(config.seed), 1))
  return params


# -------------------------------------------------------------------------------------------------- how they run
@contextlib.contextmanager
def running(run, *, train: bool):
  """Within it (inside a traced function), models.apply runs the run's params as they are: adapters unmerged
  beside their frozen kernels (NF4 ones dequantised in their matmuls), the method's dropout only when `train`. On
  exit, a ValueError if an adapter of the run was never applied."""
  p = resolve(run)
  m = p.adapter
  if m is None:
    yield
    return
  fn, applied = m.hook(p.config, train=train), set()

  def adapt(module, x, dense):
    applied.add(module.path)
    return fn(module, x, dense)

  with models.adapter(adapt, m.KEY):
    yield
  missing = sorted("/".join(a) for a in m.adapted(p.config) if a not in applied)
  if missing:
    raise ValueError(f"{m.NAME} adapters of {', '.join(missing)} were never applied: the model ran no Dense there")


def base(run, params: dict) -> dict:
  """The base model's plain params: adapters dropped, NF4 kernels dequantised to model.param_dtype."""
  p = resolve(run)
  return params if p.adapter is None else p.adapter.dequantize(p.config, without_adapters(p, params), p.param_dtype)


def folded(run, params: dict) -> dict:
  """The model a run trained, as plain params in model.param_dtype: `base` with the adapters folded into their
  kernels (what --export_merged writes and a next stage's init_from reads); params as they are without a method."""
  p = resolve(run)
  return params if p.adapter is None else p.adapter.fold(p.config, base(p, params), params[p.adapter.KEY])


def for_inference(run, params: dict) -> dict:
  """Plain params for eval and decoding: the adapters folded into their kernels, NF4 kernels dequantised to the
  compute dtype model.dtype; params as they are without a method. Jittable."""
  p = resolve(run)
  if p.adapter is None:
    return params
  plain = p.adapter.dequantize(p.config, without_adapters(p, params), p.compute_dtype)
  return p.adapter.fold(p.config, plain, params[p.adapter.KEY])


def save_adapter(run, params: dict, directory: str):
  """The adapters and modules_to_save of host params in the PEFT format in `directory`; nothing without a method."""
  p = resolve(run)
  if p.adapter is not None:
    p.adapter.save(p.config, params, directory)


# ------------------------------------------------------------------------------------------------- what trains
def _patterns(config) -> tuple:
  """finetune.freeze, and the reference copy of model.frozen_reference."""
  group = config.get("finetune")
  reference = (f"^{models.REFERENCE}/",) if config.model.get("frozen_reference", False) else ()
  return (tuple(group.get("freeze", ())) if group is not None else ()) + reference


def _layer_decay(config) -> float:
  """config.finetune.layer_decay (1.0 = every layer at the same lr), 1.0 for configs without the field."""
  group = config.get("finetune")
  return float(group.get("layer_decay", 1.0)) if group is not None else 1.0


def stacked_layers(model_cfg, path) -> np.ndarray:
  """The looped layer indices that a scanned stack's param at `path` (run-layout keys from 'layers') holds, in the
  order of its leading axis (Family.place_layer)."""
  place_layer, keys = models.family(model_cfg).place_layer, tuple(path)
  placed = [(where[1], i) for i in range(model_cfg.num_layers)
            if (where := place_layer(model_cfg, i)) and keys[:len(where[0])] == where[0]]
  return np.array([i for _, i in sorted(placed)])


def _frozen_looped(config, patterns) -> dict:
  """{looped path string: frozen?} of every parameter of config.model."""
  return {p: any(re.search(rx, p) for rx in patterns) for p in models.looped_params(config.model)[0]}


def _layer_stacks(config) -> set:
  """The paths above each layer stack ('layers_<i>' keys) among the parameters that train: {()} for one stack at
  the top (BERT, GPT), {('encoder',), ('decoder',)} for an encoder and a decoder (T5)."""
  frozen = _frozen_looped(config, _patterns(config))
  stacks = set()
  for path, is_frozen in frozen.items():
    keys = path.split("/")
    stacks |= {tuple(keys[:i]) for i, k in enumerate(keys) if layers.LOOPED.fullmatch(k) and not is_frozen}
  return stacks


def check(config):
  """One-line ValueError naming the config.finetune / config.lora / config.ia3 field that cannot apply to
  config.model."""
  m = resolve(config).adapter
  plain = defaults.base_config()
  for name, method in methods.METHODS.items():   # a group left at its defaults has nothing to check
    if method is m or (name in config and config[name].to_dict() != plain[name].to_dict()):
      method.check(config)
  patterns = _patterns(config)
  if m is not None and config.finetune.freeze:
    raise ValueError(f"config.finetune.freeze and config.{m.NAME} exclude each other: with an adapter method only "
                     f"the adapters and config.{m.NAME}.modules_to_save train")
  decay = _layer_decay(config)
  if not 0 < decay <= 1:
    raise ValueError(f"config.finetune.layer_decay must be in (0, 1] (1 = off), got {decay}")
  nested = sorted("/".join(p) for p in _layer_stacks(config) if p)
  if decay != 1 and nested:
    raise ValueError(f"config.finetune.layer_decay needs the trained layers in one stack at the top of the params "
                     f"(lm_jax.optim.layer_lr_scales); this {config.model.family} model has layers under "
                     f"{', '.join(nested)}")
  for rx in patterns:
    try:
      re.compile(rx)
    except re.error as e:
      raise ValueError(f"config.finetune.freeze: {rx!r} is not a regular expression ({e})") from None
  if patterns:
    frozen = _frozen_looped(config, patterns)
    for rx in patterns:
      if not any(re.search(rx, p) for p in frozen):
        raise ValueError(f"config.finetune.freeze: {rx!r} matches no parameter (paths look like "
                         f"{next(iter(frozen))!r}, {next(p for p in frozen if p.startswith('layers_'))!r})")
    if all(frozen.values()):
      raise ValueError(f"config.finetune.freeze={patterns!r} freezes every parameter")
    _trainable_mask(resolve(config))


def trainable_mask(run) -> dict | None:
  """Bool tree over the run's params (in its layout): True for those that train; None when all do."""
  return resolve(run).trainable


def _trainable_mask(p: Policy) -> dict | None:
  config, m = p.config, p.adapter
  if m is not None:
    tree = abstract(p)
    adapters = jax.tree.map(lambda _: True, tree[m.KEY])
    return {**targets.saved_mask(config, m.NAME, without_adapters(p, tree)), m.KEY: adapters}
  patterns = _patterns(config)
  if not patterns:
    return None
  mask = {}
  for path, is_frozen in _frozen_looped(config, patterns).items():
    keys = targets.run_path(config, path)
    node = mask
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    if node.get(keys[-1], not is_frozen) != (not is_frozen):
      raise ValueError(f"config.finetune.freeze={patterns!r} freezes some layers of a scanned stack "
                       f"({'/'.join(keys)}); set config.model.scan_layers=False")
    node[keys[-1]] = not is_frozen
  return mask


def check_fresh(run, fresh: set):
  """One-line ValueError when a parameter that starts at its fresh init (`fresh`: paths in the run's params, e.g. a
  new task head that config.init_from's model lacks) would not train: it would stay random for the whole run."""
  policy = resolve(run)
  config, mask = policy.config, policy.trainable
  frozen = sorted("/".join(p) for p in fresh if mask is not None and not _trains(mask, p))
  if frozen:
    m, keys = policy.adapter, sorted({p.split("/")[0] for p in frozen})
    field = f"config.{m.NAME}.modules_to_save" if m else "config.finetune.freeze"
    fix = (f"add {', '.join(f'^{k}/' for k in keys)!r} to it" if m else "leave them out of it")
    raise ValueError(f"{', '.join(frozen)} start at a fresh init (config.init_from={config.init_from!r} has no such "
                     f"parameter) but {field} leaves them frozen, so they would never train: {fix}")


def _trains(mask, path: tuple) -> bool:
  for k in path:
    if not isinstance(mask, dict):
      break
    mask = mask[k]
  return any(jax.tree.leaves(mask))


def split(tree: dict, mask: dict | None) -> tuple[dict, dict]:
  """(trainable, frozen) parts of a params-shaped nested dict; with mask None, (tree, {})."""
  if mask is None:
    return tree, {}
  trainable, frozen = {}, {}
  for k, v in tree.items():
    if isinstance(v, dict):
      a, b = split(v, mask[k])
      trainable.update({k: a} if a else {})
      frozen.update({k: b} if b else {})
    else:
      (trainable if mask[k] else frozen)[k] = v
  return trainable, frozen


def join(a: dict, b: dict) -> dict:
  """The union of two disjoint nested dicts: split's (trainable, frozen) parts joined back into one tree."""
  out = dict(a)
  for k, v in b.items():
    out[k] = join(out[k], v) if k in out else v
  return out


def count(run) -> tuple[int, int]:
  """(trainable, total) parameters of the run: with a method, its adapters plus modules_to_save, of the model
  plus its adapters."""
  p = resolve(run)
  config, m = p.config, p.adapter
  model = models.abstract_params(config.model)
  if m is None:
    return models.count(split(model, p.trainable)[0]), models.count(model)
  saved = sum(math.prod(a.shape) for p, a in models.looped_params(config.model)[0].items()
              if targets.trains_fully(config[m.NAME], p))
  adapters = models.count(jax.eval_shape(lambda: m.init(config, jax.random.key(0))))
  return adapters + saved, models.count(model) + adapters

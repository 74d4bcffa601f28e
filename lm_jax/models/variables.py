"""The flax variables a model runs on: plain params, NF4-quantised kernels (QLoRA) in layers.QUANTISED, and
adapters in ADAPTERS applied by an interceptor on layers.Dense (`adapter`), so models know nothing of PEFT."""
import contextlib
import contextvars

import flax.linen as nn

from lm_jax.models import layers, nf4

_ADAPTER = contextvars.ContextVar("lm_jax_adapter", default=None)
ADAPTERS = layers.ADAPTERS   # the variable collection of adapters, mirroring the paths of their Dense modules
# The top-level params keys adapters live under, one per PEFT method, with the method's name: params holding one are
# refused outside `adapter`, where the model would ignore them. lm_jax/peft/methods.py registers its methods here,
# so a new method is one entry there and models/ never imports peft/.
ADAPTER_KEYS: dict[str, str] = {}


def register_adapter(key: str, title: str) -> None:
  ADAPTER_KEYS[key] = title


@contextlib.contextmanager
def adapter(fn, key: str):
  """Within it, `apply` runs params holding adapters under params[key]: they become the ADAPTERS collection
  (scanned with their layers) and each layers.Dense that has some returns fn(module, x, dense) instead of
  dense(x), its plain output; `module.get_variable(ADAPTERS, name)` reads its adapters. So a method adds to the
  output (LoRA's x·W + s·x·A·B), scales it, or scales the input (IA³) without a model that knows about it."""
  if key not in ADAPTER_KEYS:
    raise ValueError(f"models.adapter: {key!r} is not one of the adapter keys {tuple(ADAPTER_KEYS)}")

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(module, layers.Dense) \
        and ADAPTERS in module.variables:
      return fn(module, args[0], lambda x: next_fun(x, *args[1:], **kwargs))
    return next_fun(*args, **kwargs)

  if _ADAPTER.get() is not None:
    raise ValueError("models.adapter contexts do not nest: the adapters would be applied twice")
  token = _ADAPTER.set(key)
  try:
    with nn.intercept_methods(intercept):
      yield
  finally:
    _ADAPTER.reset(token)


def check_plain(params: dict) -> None:
  """Params still holding adapters would run without them: refuse them."""
  held = [k for k in ADAPTER_KEYS if k in params]
  if held:
    raise ValueError(f"params hold {ADAPTER_KEYS[held[0]]} adapters (params[{held[0]!r}]), which the model would "
                     "ignore; pass "
                     "lm_jax.params.for_inference(config, params) or run under lm_jax.params.running(config)")


def _split_nf4(tree: dict) -> tuple[dict, dict]:
  """(tree without its NF4 leaves, the NF4 leaves at the same paths): the collection layers.Dense reads."""
  plain, quantised = {}, {}
  for k, v in tree.items():
    if isinstance(v, dict):
      plain[k], q = _split_nf4(v)
      if q:
        quantised[k] = q
    elif nf4.is_nf4(v):
      quantised[k] = v
    else:
      plain[k] = v
  return plain, quantised


def of_params(params: dict) -> dict:
  """Flax variables of run params: NF4 kernels (QLoRA) in layers.QUANTISED, adapters (under `adapter`) in
  ADAPTERS."""
  key = _ADAPTER.get()
  if key is not None and key in params:
    adapters, params = params[key], {k: v for k, v in params.items() if k != key}
  else:
    adapters = None
  check_plain(params)
  params, quantised = _split_nf4(params)
  return {"params": params, **({layers.QUANTISED: quantised} if quantised else {}),
          **({ADAPTERS: adapters} if adapters else {})}

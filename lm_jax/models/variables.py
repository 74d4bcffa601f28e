"""The flax variables a model runs on: plain params, NF4-quantised kernels (QLoRA) in layers.QUANTISED, and
adapters in ADAPTERS applied by an interceptor on layers.Dense (`adapter`), so models know nothing of PEFT."""
import contextlib
import contextvars

import flax.linen as nn

from lm_jax.models import layers, nf4

_ADAPTER = contextvars.ContextVar("lm_jax_adapter", default=None)
ADAPTERS = layers.ADAPTERS   # the params key (and variable collection) of adapters, mirroring their Dense modules


@contextlib.contextmanager
def adapter(fn):
  """Within it, `apply` runs params holding adapters under ADAPTERS: they become a variable collection (scanned
  with their layers) and each layers.Dense that has some returns fn(module, x, y) instead of its output y. This is
  how LoRA's x·A·B path (lm_jax/peft/lora.py) runs without a model that knows about it."""
  def intercept(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    module = context.module
    if context.method_name == "__call__" and isinstance(module, layers.Dense) and module.has_variable(ADAPTERS, "a"):
      return fn(module, args[0], y)
    return y

  if _ADAPTER.get() is not None:
    raise ValueError("models.adapter contexts do not nest: the adapters would be applied twice")
  token = _ADAPTER.set(fn)
  try:
    with nn.intercept_methods(intercept):
      yield
  finally:
    _ADAPTER.reset(token)


def check_plain(params: dict) -> None:
  """Params still holding adapters would run without them: refuse them."""
  if ADAPTERS in params:
    raise ValueError("params hold LoRA adapters (params['lora']), which the model would ignore; pass "
                     "lm_jax.peft.lora.materialize(config, params) or run under lm_jax.peft.lora.unmerged(config)")


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
  if ADAPTERS in params and _ADAPTER.get() is not None:
    adapters, params = params[ADAPTERS], {k: v for k, v in params.items() if k != ADAPTERS}
  else:
    check_plain(params)
    adapters = None
  params, quantised = _split_nf4(params)
  return {"params": params, **({layers.QUANTISED: quantised} if quantised else {}),
          **({ADAPTERS: adapters} if adapters else {})}

"""The adapter methods lm_jax.params runs, by config group. Each module implements the same functions:

  NAME, KEY, TITLE           its config group, its params key and its name in messages (registered with
                             models.variables.register_adapter below)
  enabled(config), check(config)
  init(config, rng), logical_axes(config)     the adapters tree (without KEY) and its logical specs
  adapted(config)            run-layout paths of the Dense modules it adapts
  quantize(config, base), dequantize(config, base, dtype)    the frozen base's storage (QLoRA's NF4)
  hook(config, train=)       the models.adapter function that runs the adapters unmerged
  fold(config, plain, adapters)               plain params with the adapters merged in
  save(config, params, dir), load(config, dir)   the PEFT format
and trains its adapters plus config.<NAME>.modules_to_save. Adding a method is its module and one entry here.
"""
from lm_jax.models import variables
from lm_jax.peft import ia3, lora

METHODS = {m.NAME: m for m in (lora, ia3)}
for _m in METHODS.values():
  variables.register_adapter(_m.KEY, _m.TITLE)


def active(config):
  """The method config turns on, or None; a one-line ValueError when it turns on two."""
  on = [name for name, m in METHODS.items() if m.enabled(config)]
  if len(on) > 1:
    raise ValueError(f"config.{on[0]} and config.{on[1]} are both on: one adapter method at a time")
  return METHODS[on[0]] if on else None

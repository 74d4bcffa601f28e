"""The adapter methods lm_jax.params runs, by config group. Each module implements the same functions:

  NAME, KEY, TITLE           its config group, its params key and its name in messages (registered with
                             models.variables.register_adapter below)
  SWITCH                     the field of its group that turns it on when set (lora.rank > 0, ia3.targets)
  check(config)
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


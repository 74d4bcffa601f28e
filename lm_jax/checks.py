"""The config checked against the devices and processes it will run on, before anything is built or compiled.

Each owner checks its own fields (objectives, models, params, init_from, checkpoint, the data mixture, profiles,
W&B); this module asks them all, adds the numeric ranges and the mesh's divisibility, and turns their plain
ValueErrors into one ConfigError naming the field. config_lib stays light (it loads a config and imports nothing
of the library but defaults); this is where the library is imported.
"""
import math

from lm_jax import checkpoint, config_lib, init_from, models, objectives, optim, params, sharding
from lm_jax.data import mixture
from lm_jax.config_lib import require
from lm_jax.obs import profiling, wandb_log


def _at_least(low):
  return f">= {low}", lambda x: x >= low


def _above(low):
  return f"> {low}", lambda x: x > low


_UNIT = "in [0, 1)", lambda x: 0 <= x < 1

# Ranges of the numeric fields of lm_jax/defaults.py that objectives.check, models.validate and
# sharding.mesh_shape do not cover. Written as what is allowed, so NaN (every comparison is False) fails.
# warmup_steps may exceed total_steps: the rsqrt schedule uses it as a constant, and short runs stay in warmup.
RANGES = {
    "total_steps": _at_least(1), "microbatches": _at_least(1), "log_every": _at_least(1),
    "checkpoint_every": _at_least(1), "batch_size": _at_least(1), "keep_checkpoints": _at_least(1),
    "storage_retry_s": _at_least(1),
    "eval_every": _at_least(0), "seed": _at_least(0), "peak_tflops": _at_least(0),
    "optimizer.lr": _above(0), "optimizer.b1": _UNIT, "optimizer.b2": _UNIT, "optimizer.eps": _above(0),
    "optimizer.weight_decay": _at_least(0), "optimizer.warmup_steps": _at_least(0),
    "optimizer.clip_norm": _at_least(0), "optimizer.cooldown_fraction": ("in [0, 1]", lambda x: 0 <= x <= 1),
    "optimizer.cooldown_start": _at_least(0), "optimizer.adam_lr": _at_least(0), "optimizer.muon_momentum": _UNIT,
    "data.target_len": _at_least(0), "data.eval_batches": _at_least(0), "data.shards": _at_least(1),
    "data.workers": _at_least(1),
    "model.initializer_range": _above(0),
}


def validate(config, num_devices: int, process_count: int = 1):
  """ConfigError (one line, naming the field) for a config that cannot train on `num_devices` devices in
  `process_count` processes: checked before anything is built or compiled."""
  try:
    _validate(config, num_devices, process_count)
  except config_lib.ConfigError:
    raise
  except ValueError as e:  # objectives, models and sharding raise plain ValueErrors naming the field
    raise config_lib.ConfigError(str(e)) from e


def _validate(config, num_devices, process_count):
  objectives.check(config)  # unknown objective, objective/family mismatch, seq_len vs positions, masking/noise
  models.validate(config.model)  # sizes, heads vs d_model, activation, dtypes, remat policy, dropout
  _check_numbers(config)
  params.check(config)  # what trains: freeze patterns, adapter methods, layer_decay
  init_from.check(config)  # reinit_top_layers
  checkpoint.check_best(config)  # best_metric
  mixture.sources(config)  # data.mixture: source fields, names, weights
  profiling.check(config)  # profile.steps
  wandb_log.check(config)  # wandb.mode; wandb installed when wandb.project is set
  m, o = config.model, config.optimizer
  require(o.name in optim.OPTIMIZERS, f"config.optimizer.name={o.name!r} unknown; use {', '.join(optim.OPTIMIZERS)}")
  require(o.schedule in optim.SCHEDULES,
           f"config.optimizer.schedule={o.schedule!r} unknown; use {', '.join(optim.SCHEDULES)}")
  require(o.cooldown_shape in optim.COOLDOWN_SHAPES, f"config.optimizer.cooldown_shape={o.cooldown_shape!r} "
           f"unknown; use {', '.join(optim.COOLDOWN_SHAPES)}")
  if o.schedule == "wsd":
    optim.cooldown_start(o, config.total_steps)   # inside [warmup_steps, total_steps]
  require(0 <= config.phase_end_step <= config.total_steps, f"config.phase_end_step={config.phase_end_step} "
           f"must be in [0, total_steps={config.total_steps}] (0 = total_steps)")
  data, fsdp, tensor = sharding.mesh_shape(config, num_devices)
  models.family(m).check_mesh(m, dict(zip(sharding.AXES, (data, fsdp, tensor))))   # heads (and kv heads) vs tensor
  require(config.batch_size % process_count == 0,
           f"config.batch_size={config.batch_size} is not divisible by the {process_count} processes")
  require(config.batch_size % config.data.shards == 0,
           f"config.batch_size={config.batch_size} is not divisible by config.data.shards={config.data.shards}")
  per_step = config.microbatches * data * fsdp
  require(config.batch_size % per_step == 0,
           f"config.batch_size={config.batch_size} is not divisible by config.microbatches * mesh.data * mesh.fsdp "
           f"= {config.microbatches}*{data}*{fsdp} = {per_step}")
  sharding.check_divisible(models.abstract_params(m), models.logical_axes(m),
                           dict(zip(sharding.AXES, (data, fsdp, tensor))), sharding.rules(config))


def _check_numbers(config):
  """Every float finite, RANGES, eval batches when evaluating, token ids inside the vocabulary."""
  fields = config_lib.fields(config)
  for path, value in fields.items():
    require(not isinstance(value, float) or math.isfinite(value), f"config.{path} must be finite, got {value}")
  for path, (rule, ok) in RANGES.items():
    require(ok(fields[path]), f"config.{path} must be {rule}, got {fields[path]!r}")
  m = config.model
  for name in [k for k in m.keys() if k.endswith("_token_id")]:   # the shared ones and the family's
    require(0 <= m[name] < m.vocab_size,
             f"config.model.{name}={m[name]} must be in [0, model.vocab_size={m.vocab_size})")

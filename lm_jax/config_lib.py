"""TEMPORARY (lead): validate moved from train.py; replaced by the config helper branch."""
from lm_jax import models, objectives, optim, sharding


def validate(config, num_devices: int, process_count: int = 1):
  """One-line ValueError / FileNotFoundError naming the field, before anything is built or compiled."""
  def require(ok, message):
    if not ok:
      raise ValueError(message)

  objectives.check(config)  # unknown objective, objective/family mismatch, seq_len vs positions, masking/noise
  models.validate(config.model)  # sizes, heads vs d_model, activation, dtypes, remat policy, dropout
  m, o = config.model, config.optimizer
  require(o.name in optim.OPTIMIZERS, f"config.optimizer.name={o.name!r} unknown; use {', '.join(optim.OPTIMIZERS)}")
  require(o.schedule in optim.SCHEDULES,
          f"config.optimizer.schedule={o.schedule!r} unknown; use {', '.join(optim.SCHEDULES)}")
  for field in ("total_steps", "microbatches", "log_every", "checkpoint_every", "batch_size"):
    require(config[field] >= 1, f"config.{field} must be >= 1, got {config[field]}")
  require(config.eval_every >= 0, f"config.eval_every must be >= 0, got {config.eval_every}")
  require(0 <= config.phase_end_step <= config.total_steps,
          f"config.phase_end_step={config.phase_end_step} must be in [0, total_steps={config.total_steps}] (0 = total_steps)")
  data, fsdp, tensor = sharding.mesh_shape(config, num_devices)
  require(m.num_heads % tensor == 0,
          f"config.model.num_heads={m.num_heads} is not divisible by config.mesh.tensor={tensor}")
  require(config.batch_size % process_count == 0,
          f"config.batch_size={config.batch_size} is not divisible by the {process_count} processes")
  shards = config.microbatches * data * fsdp
  require(config.batch_size % shards == 0,
          f"config.batch_size={config.batch_size} is not divisible by config.microbatches * mesh.data * mesh.fsdp "
          f"= {config.microbatches}*{data}*{fsdp} = {shards}")
  sharding.check_divisible(models.abstract_params(m), models.logical_axes(m),
                           dict(zip(sharding.AXES, (data, fsdp, tensor))), sharding.rules(config))



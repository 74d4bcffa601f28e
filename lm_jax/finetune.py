"""The checks of config.finetune's fields that are not the params policy: reinit_top_layers (lm_jax.init_from) and
best_metric (checkpoint.Best). What trains (finetune.freeze, finetune.layer_decay, adapters) is lm_jax.params;
where the model starts is lm_jax.init_from."""


def check(config):
  """One-line ValueError naming the config.finetune field that cannot apply to config.model (what trains:
  lm_jax.params.check)."""
  top = config.finetune.reinit_top_layers
  if not 0 <= top <= config.model.num_layers:
    raise ValueError(f"config.finetune.reinit_top_layers must be in [0, model.num_layers={config.model.num_layers}],"
                     f" got {top}")
  if top and not config.init_from:
    raise ValueError("config.finetune.reinit_top_layers needs config.init_from (the model to start from)")
  best = config.finetune.best_metric
  if best and (not best.startswith("eval_") or not config.eval_every):
    raise ValueError(f"config.finetune.best_metric={best!r} must name an eval metric (eval_accuracy, eval_loss, ...) "
                     f"and needs config.eval_every > 0, got eval_every={config.eval_every}")

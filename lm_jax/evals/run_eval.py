"""A run's model read back for the read-only modes: restore_params gives eval, predict, zeroshot, generate and export
the latest checkpoint in a workdir (or, without one, config.init_from's model) on the run's mesh, and
evaluate_checkpoint is --mode=eval on it. Dependencies: main, evals and checkpoint_export call it; it builds on
train (setup, make_evaluator) and init_from (which model, and reading it)."""
import jax
from flax import linen as nn

from lm_jax import init_from, loop, train
from lm_jax.obs import metrics_log


def restore_params(config, workdir: str):
  """(setup, params placed on the mesh, step) of init_from.eval_source: the latest checkpoint in workdir, or without
  one config.init_from's model."""
  config, source = init_from.eval_source(config, workdir)
  s = train.setup(config, workdir if init_from.is_hf(source) else source)   # a run's tokenizer lives in its workdir
  return (s, *init_from.restore_params(s, source))


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Held-out metrics of the latest checkpoint (or of config.init_from): printed first, then appended to
  workdir/metrics.jsonl."""
  s, params, latest = restore_params(config, workdir)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    record = {"step": latest, **train.make_evaluator(s)(params)}
  loop.say(metrics_log.console(record, latest))
  metrics_log.MetricsLog(workdir, resume_step=None, tensorboard=False).write(record)  # no-op off process 0
  return record

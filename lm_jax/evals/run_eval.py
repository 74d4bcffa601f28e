"""A run's model read back for the read-only modes: restore_params gives eval, predict, zeroshot, generate and export
the latest checkpoint in a workdir (or, without one, config.init_from's model) on the run's mesh, and
evaluate_checkpoint is --mode=eval on it. Dependencies: main, evals and checkpoint_export call it; it builds on
setup (the run's, as the trainer builds it), evals/evaluators (all of them) and init_from (which model, and reading
it); never on the trainers."""
import jax
from flax import linen as nn

from lm_jax import init_from, loop, setup as setup_lib
from lm_jax.evals import evaluators
from lm_jax.obs import metrics_log


def restore_params(config, workdir: str):
  """(setup, params placed on the mesh, step) of init_from.eval_source: the latest checkpoint in workdir, or without
  one config.init_from's model."""
  config, source = init_from.eval_source(config, workdir)
  s = setup_lib.setup(config, workdir if init_from.is_hf(source) else source)   # a run's tokenizer lives in its workdir
  return (s, *init_from.restore_params(s, source))


def evaluate_checkpoint(config, workdir: str) -> dict:
  """Held-out metrics of the latest checkpoint (or of config.init_from): printed first, then appended to
  workdir/metrics.jsonl."""
  s, params, latest = restore_params(config, workdir)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    record = {"step": latest, **evaluators.make(s)(params)}
  loop.say(metrics_log.console(record, latest))
  metrics_log.MetricsLog(workdir, resume_step=None, tensorboard=False).write(record)  # no-op off process 0
  return record

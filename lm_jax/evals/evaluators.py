"""The evaluators a run has, by name, each on its own schedule (big_vision's `config.evals`, over the config fields
lm_jax has always had). Each is built once per run from its setup (layout and tokenizer), so a wrong task name or
missing eval file stops a run before it trains, and maps params to metrics:

  held_out   every config.eval_every steps             the eval split's corpus metrics (and each mixture source's)
  lm_eval    every config.eval.lm_eval_every steps     config.eval.lm_eval_tasks (lm_eval_adapter); 0 = every eval

The trainer evaluates every config.eval_every steps and at its last step (lm_jax.loop); the metrics of the
evaluators due then make one eval record, so every `every` is a multiple of eval_every (lm_eval_adapter.check).
--mode=eval (evals/run_eval) runs them all. Adding an evaluator is a function here and its line in REGISTRY.
"""
import dataclasses
from typing import Callable

import jax

from lm_jax import step
from lm_jax.data import pipeline
from lm_jax.evals import lm_eval_adapter, predict


@dataclasses.dataclass(frozen=True)
class Evaluator:
  every: int     # steps between its runs (it also runs at the last step)
  run: Callable  # params -> metrics


def held_out(s) -> Evaluator:
  """Corpus metrics over the eval batches, read once (lm_jax.evals.predict), and each mixture source's own."""
  it = pipeline.make_eval_iterator(s.config, s.tokenizer, s.objective, process_index=jax.process_index(),
                                   process_count=jax.process_count())
  batches = list(it)
  eval_step = step.make_eval_step(s.policy, s.objective, s.state_sharding["params"], s.mesh)

  def run(params):
    outputs = predict.eval_outputs(eval_step, params, batches, s.mesh)
    record = predict.eval_record(s.objective, outputs, it.text_per_token)
    for name, (part, per_token) in it.sources.items():
      own = predict.eval_record(s.objective, outputs[part], per_token)
      record.update({f"eval_{name}_{k.removeprefix('eval_')}": v for k, v in own.items()})
    return record
  return Evaluator(s.config.eval_every, run)


def lm_eval(s) -> Evaluator | None:
  """config.eval.lm_eval_tasks on the params in memory; None without tasks."""
  c = s.config
  if not c.eval.lm_eval_tasks:
    return None
  return Evaluator(c.eval.lm_eval_every or c.eval_every, lm_eval_adapter.Harness(c, s.tokenizer))


REGISTRY = {"held_out": held_out, "lm_eval": lm_eval}   # name -> (setup -> Evaluator or None); their metrics in order


def make(s) -> Callable:
  """(params, step or None) -> the eval record (without step) of the evaluators due at `step` (None: all of them)."""
  built = [e for e in (build(s) for build in REGISTRY.values()) if e is not None]
  end = s.config.phase_end_step or s.config.total_steps

  def evaluate(params, i=None):
    record = {}
    for e in built:
      if i is None or i == end or i % e.every == 0:
        record.update(e.run(params))
    return record
  return evaluate

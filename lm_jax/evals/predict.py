"""Running the eval step over eval batches (the held-out evaluator and --mode=predict share it), and --mode=predict:
the predictions of a fine-tuned model for task.test_split as a TSV."""
import os
import string

import jax
import numpy as np

from lm_jax import decoding, distributed, params as params_lib, sharding, step, storage
from lm_jax.data import pipeline
from lm_jax.evals import evaluate


def eval_outputs(eval_step, params, batches: list, mesh) -> list:
  """[(metrics, denominators, per-example outputs) of each batch], on the host: step.make_eval_step's `eval_step`
  over host-local `batches`, each placed on `mesh` as one global batch."""
  batch_sh = sharding.batch_sharding(mesh)
  with jax.set_mesh(mesh):
    return jax.device_get([eval_step(params, sharding.global_batch(b, batch_sh)) for b in batches])


def predictions(outputs: list) -> dict:
  """The per-example outputs of every eval batch, concatenated: {name: numpy array over the eval set}."""
  return {k: np.concatenate([np.asarray(o[k]) for _, _, o in outputs]) for k in outputs[0][2]}


def eval_record(objective, outputs: list, text_per_token: dict | None = None) -> dict:
  """The eval metrics of eval_outputs: corpus-exact over every batch (lm_jax.evals.evaluate.summarize), and for an
  objective with predictions the metrics over the whole eval set."""
  sums = [({k: float(v) for k, v in m.items()}, {k: float(v) for k, v in d.items()}) for m, d, _ in outputs]
  record = evaluate.summarize(sums, lambda metric: objective.denominator_of(metric, sums[0][1]), text_per_token)
  if objective.predict:
    record.update(evaluate.prediction_metrics(predictions(outputs)))
  return record


def _write(path: str, lines: list[str]):
  """Written under a new name, then renamed over `path`: whole or not at all, never through a link placed there."""
  if distributed.is_lead():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = "index\tprediction\n" + "".join(line + "\n" for line in lines)
    os.replace(storage.write_new(os.path.dirname(path), ".predictions-", text.encode()), path)


def predict(s, params, workdir: str) -> tuple[str, dict]:
  """Writes workdir/predictions_<task.test_split>.tsv ('index<TAB>prediction' per example, the index its position
  in the split, the prediction a label name when task.label_names are given): the predictions of `params` (placed
  on s.mesh; s is the run's setup.Setup, as evals.run_eval.restore_params returns both). Returns (path, metrics over the
  labelled examples; {} when none has a label)."""
  if not s.objective.predict:
    raise ValueError(f"config.objective={s.config.objective!r} makes no predictions (--mode=predict)")
  c = s.config.copy_and_resolve_references()
  c.data.eval_split, c.data.eval_batches = c.task.test_split, 0
  safe = "".join(ch if ch in string.ascii_letters + string.digits + "-_" else "_" for ch in c.task.test_split)
  path = os.path.join(workdir, f"predictions_{safe}.tsv")
  texts = s.objective.predict_texts(c, params_lib.for_inference(s.policy, params), s.tokenizer, c.task.test_split,
                                    decoding.generate) if s.objective.predict_texts else None
  if texts is not None:   # decoded texts (free-form T5 targets): tabs and newlines inside them become spaces
    clean = lambda t: " ".join(t.split())
    _write(path, [f"{i}\t{clean(t)}" for i, t in zip(texts["index"], texts["prediction"])])
    scored = any(t is not None for t in texts["target"])
    return path, {"test_exact_match": texts["exact_match"]} if scored else {}
  batches = pipeline.make_eval_iterator(c, s.tokenizer, s.objective, process_index=jax.process_index(),
                                        process_count=jax.process_count())
  eval_step = step.make_eval_step(s.policy, s.objective, s.state_sharding["params"], s.mesh)
  out = eval_outputs(eval_step, params, batches, s.mesh)
  found = predictions(out)
  keep = found["index"] >= 0
  index, prediction = found["index"][keep], found["prediction"][keep]
  names = tuple(c.task.label_names)
  as_text = lambda p: names[p] if names else f"{p:.6g}" if np.issubdtype(prediction.dtype, np.floating) else str(p)
  _write(path, [f"{i}\t{as_text(p)}" for i, p in zip(index, prediction)])
  if not found["weight"][keep].any():
    return path, {}
  return path, {k.replace("eval_", "test_", 1): v for k, v in eval_record(s.objective, out).items()}

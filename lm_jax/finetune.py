"""Fine-tuning: start from any checkpoint (config.init_from), choose what trains (config.finetune), keep the best
checkpoint, write predictions.

- resolve(config): the run's model config takes the architecture of config.init_from (a Hugging Face directory's
  config.json, or the saved config of another run's workdir) and keeps its own runtime fields and num_labels; the
  tokenizer is the pre-trained one unless data.tokenizer names another. An objective's added_tokens (GPT-1's
  start / delimiter / extract) enlarge the vocabulary: model.vocab_size = pre-trained + added_tokens, recorded as
  model.added_tokens so that a run started from such a run keeps its vocabulary.
- initial_params: every parameter the run's model shares with the pre-trained one (same path and shape) starts
  from the pre-trained value, an enlarged embedding table its first rows; the rest (new task heads, the added
  tokens' rows) keeps the fresh init drawn from the run's seed; the
  pre-trained heads the run's model lacks are dropped (BERT §4: the MLM / NSP heads give way to the classifier).
  finetune.reinit_top_layers resets the top layers of every layer stack to the fresh init.
- Best: finetune.best_metric (e.g. eval_accuracy) keeps the checkpoint of the best eval in WORKDIR/best.
- predict: --mode=predict, the latest checkpoint's predictions for task.test_split as a TSV.
What trains (finetune.freeze, finetune.layer_decay, adapters) is lm_jax.params.
"""
import glob
import json
import os
import re
import string

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from lm_jax import checkpoint, models, objectives, params as params_lib, sharding
from lm_jax.models import layers

# Model fields the run chooses whatever the pre-trained model had: how it runs, and its task head.
RUN_FIELDS = (*checkpoint.RUNTIME_MODEL_FIELDS, "scan_layers", "param_dtype", "num_labels", "frozen_reference")
_LAYER = re.compile(r"layers_(\d+)")   # a looped layer's params; scanned ones are all under "layers"


def _is_hf(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "config.json"))


# ------------------------------------------------------------------------------------------ the pre-trained model
def _saved_config(path: str) -> dict:
  """The saved config of the latest checkpoint of the run in `path`."""
  mngr = checkpoint.manager(path, 1)
  latest = mngr.latest_step()
  if latest is None:
    raise FileNotFoundError(f"config.init_from={path!r}: neither a Hugging Face directory (config.json) nor a "
                            "workdir with a checkpoint")
  saved = mngr.restore(latest, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
  mngr.close()
  return saved


def source_model(path: str) -> tuple[ml_collections.ConfigDict, str]:
  """(model config, tokenizer path) of the pre-trained model in `path`."""
  if _is_hf(path):
    from lm_jax.hf import export
    return export._read_config(os.path.join(path, "config.json")), path
  saved = _saved_config(path)
  model = ml_collections.ConfigDict(saved["model"])
  tokenizer = saved["data"].get("tokenizer") or next(iter(sorted(glob.glob(
      os.path.join(path, f"tokenizer_{model.family}_*.model")))), "")
  if not tokenizer:
    raise FileNotFoundError(f"config.init_from={path!r}: the run names no data.tokenizer and has no trained "
                            "tokenizer_*.model")
  return model, tokenizer


def resolve(config):
  """config with the model architecture (and tokenizer) of config.init_from; config itself without init_from."""
  if not config.init_from:
    return config
  model, tokenizer = source_model(config.init_from)
  if model.family != config.model.family:
    raise ValueError(f"config.init_from={config.init_from!r} holds a {model.family!r} model but "
                     f"config.model.family={config.model.family!r}")
  merged = config.model.to_dict()
  merged.update({k: v for k, v in model.to_dict().items() if k not in RUN_FIELDS})
  added = objectives.get(config.objective).added_tokens
  if added and not model.get("added_tokens"):   # a run that has them already (e.g. WORKDIR/best) keeps its vocab
    merged.update(vocab_size=model.vocab_size + added, added_tokens=added)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.model = ml_collections.ConfigDict(merged)
    config.data.tokenizer = config.data.tokenizer or tokenizer
  return config


def _relayout(tree, scan: bool):
  """`tree` with every layer stack in the scanned (scan=True) or looped layout."""
  if not isinstance(tree, dict):
    return tree
  stack = [k for k in tree if k == "layers" or _LAYER.fullmatch(k)]
  rest = {k: _relayout(v, scan) for k, v in tree.items() if k not in stack}
  if not stack:
    return rest
  n = jax.tree.leaves(tree["layers"])[0].shape[0] if "layers" in tree else len(stack)
  return {**rest, **layers.put_layers(layers.get_layers(jax.device_get({k: tree[k] for k in stack}), n), scan)}


def pretrained_params(config, mesh, rules) -> dict:
  """The params of config.init_from in the layout of config.model (resolved), on the host or on `mesh`; a LoRA
  run's adapters merged into its kernels."""
  path, m = config.init_from, config.model
  if _is_hf(path):
    from lm_jax.hf import export
    _, params = export.load_hf(path, **{k: m[k] for k in RUN_FIELDS if k in m and k != "num_labels"})
    return params
  from lm_jax import step
  source = ml_collections.ConfigDict(_saved_config(path))
  _, _, abstract, shardings = step.state_layout(source, mesh, rules)
  mngr = checkpoint.manager(path, 1)
  restored = checkpoint.restore_latest(mngr, abstract, shardings, source, with_data=False)
  mngr.close()
  params = restored.state["params"]
  if params_lib.method(source):   # an adapter run's model is its merged one (NF4 kernels dequantised)
    params = jax.jit(lambda p: params_lib.merged(source, p))(params)
  return _relayout(params, m.scan_layers) if source.model.scan_layers != m.scan_layers else params


# ---------------------------------------------------------------------------------------------- initial params
def _paths(tree, prefix=()) -> dict:
  """{path tuple: leaf} of a nested dict."""
  out = {}
  for k, v in tree.items():
    out.update(_paths(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


def _unflatten(flat: dict) -> dict:
  out = {}
  for path, leaf in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf
  return out


def _reinit_top(params: dict, fresh: dict, k: int) -> dict:
  """params with the top k layers of every layer stack taken from `fresh`."""
  if not k or not isinstance(params, dict):
    return params
  out = {}
  looped = sum(1 for key in params if _LAYER.fullmatch(key))
  for key, value in params.items():
    m = _LAYER.fullmatch(key)
    if m:
      out[key] = fresh[key] if int(m.group(1)) >= looped - k else value
    elif key == "layers":
      out[key] = jax.tree.map(lambda p, f: np.concatenate([np.asarray(p)[:-k], np.asarray(f)[-k:]]), value, fresh[key])
    else:
      out[key] = _reinit_top(value, fresh[key], k)
  return out


def _extends(old, new) -> bool:
  """Whether embedding table `new` has `old`'s rows and more (a vocabulary with added tokens)."""
  return np.ndim(old) == np.ndim(new) == 2 and np.shape(old)[1] == np.shape(new)[1] and len(old) < len(new)


def initial_params(config, fresh: dict, pretrained: dict) -> tuple[dict, str]:
  """(params, a one-line report): `pretrained` wherever it has the run's parameter with the same shape (the first
  rows of an enlarged embedding table), `fresh` (the run's seeded init) elsewhere and in the top
  finetune.reinit_top_layers layers."""
  new, old = _paths(fresh), _paths(pretrained)
  if models.REFERENCE in fresh and models.REFERENCE not in pretrained:   # DPO's reference: the pre-trained model
    old.update({(models.REFERENCE, *p): jax.numpy.array(leaf, copy=True) for p, leaf in list(old.items())})
  taken = {p for p, leaf in new.items() if p in old and np.shape(old[p]) == np.shape(leaf)}
  grown = {p for p, leaf in new.items() if p in old and p[-1] == "embedding" and _extends(old[p], leaf)}

  def start(p, leaf):
    if p in grown:
      return jnp.concatenate([old[p], leaf[len(old[p]):]])   # on the devices: arrays may span hosts
    return old[p] if p in taken else leaf
  params = _unflatten({p: start(p, leaf) for p, leaf in new.items()})
  top = config.finetune.reinit_top_layers
  params = _reinit_top(params, fresh, top)
  names = lambda paths: ", ".join(sorted({p[0] for p in paths})) or "none"
  report = (f"init_from {config.init_from}: {len(taken)} of {len(new)} parameter tensors pre-trained; "
            + "".join(f"{'/'.join(p)}: {len(old[p])} pre-trained rows + {len(new[p]) - len(old[p])} fresh; "
                      for p in sorted(grown))
            + f"fresh init: {names(set(new) - taken - grown)}; dropped: {names(set(old) - set(new))}"
            + (f"; top {top} layers re-initialised" if top else ""))
  return params, report


# ------------------------------------------------------------------------------------------------------ checks
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


# -------------------------------------------------------------------------------------------------- best checkpoint
class Best:
  """The checkpoint of the best eval by config.finetune.best_metric (lower is better for losses, mse, perplexity
  and bits, higher for the rest), kept in WORKDIR/best: a workdir of its own with the run's tokenizer, so
  --init_from=WORKDIR/best evaluates, exports or predicts it. best/best.json holds its eval record, so a resumed
  run keeps comparing against it."""

  def __init__(self, workdir: str, config):
    self.metric, self.workdir = config.finetune.best_metric, epath.Path(workdir)
    self.dir = self.workdir / "best"
    self.mngr = checkpoint.manager(str(self.dir), 1)
    self._record_path = self.dir / "best.json"
    self.record = json.loads(self._record_path.read_text()) if self._record_path.exists() else None

  def _better(self, value: float) -> bool:
    if self.record is None:
      return True
    lower = any(word in self.metric for word in ("loss", "mse", "perplexity", "bits"))
    return value < self.record[self.metric] if lower else value > self.record[self.metric]

  def offer(self, record: dict, state, data_state: dict, config) -> bool:
    """Saves `state` when record (an eval record with its step) is the best so far; whether it was."""
    if self.metric not in record:
      raise ValueError(f"config.finetune.best_metric={self.metric!r} is not an eval metric of this run; it has "
                       f"{', '.join(k for k in record if k != 'step')}")
    if not self._better(record[self.metric]):
      return False
    checkpoint.save(self.mngr, record["step"], state, data_state, config)
    checkpoint.finish(self.mngr)
    if jax.process_index() == 0:
      for tokenizer in self.workdir.glob("tokenizer_*.model"):
        tokenizer.copy(self.dir / tokenizer.name, overwrite=True)
      self._record_path.write_text(json.dumps(record))
    self.record = record
    return True

  def close(self):
    self.mngr.close()


# ----------------------------------------------------------------------------------------------------- predict
def _write_predictions(path: str, lines: list[str]):
  if jax.process_index() == 0:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write("index\tprediction\n" + "".join(line + "\n" for line in lines))


def predict(config, workdir: str) -> tuple[str, dict]:
  """Writes workdir/predictions_<task.test_split>.tsv ('index<TAB>prediction' per example, the index its position
  in the split, the prediction a label name when task.label_names are given): the latest checkpoint's (or
  init_from's) predictions. Returns (path, metrics over the labelled examples; {} when none has a label)."""
  from lm_jax import evaluate, step as step_lib, train
  from lm_jax.data import pipeline
  s, params, _ = train.restore_params(config, workdir)
  if not s.objective.predict:
    raise ValueError(f"config.objective={s.config.objective!r} makes no predictions (--mode=predict)")
  c = s.config.copy_and_resolve_references()
  c.data.eval_split, c.data.eval_batches = c.task.test_split, 0
  safe = "".join(ch if ch in string.ascii_letters + string.digits + "-_" else "_" for ch in c.task.test_split)
  path = os.path.join(workdir, f"predictions_{safe}.tsv")
  texts = s.objective.predict_texts(c, params_lib.materialize(c, params), s.tokenizer, c.task.test_split) \
      if s.objective.predict_texts else None
  if texts is not None:   # decoded texts (free-form T5 targets): tabs and newlines inside them become spaces
    clean = lambda t: " ".join(t.split())
    _write_predictions(path, [f"{i}\t{clean(t)}" for i, t in zip(texts["index"], texts["prediction"])])
    scored = any(t is not None for t in texts["target"])
    return path, {"test_exact_match": texts["exact_match"]} if scored else {}
  batches = pipeline.make_eval_iterator(c, s.tokenizer, s.objective, process_index=jax.process_index(),
                                        process_count=jax.process_count())
  eval_step = step_lib.make_eval_step(c, s.objective, s.state_sharding["params"], s.mesh)
  batch_sh = sharding.batch_sharding(s.mesh)
  with jax.set_mesh(s.mesh):
    out = jax.device_get([eval_step(params, sharding.global_batch(b, batch_sh)) for b in batches])
  found = train.predictions(out)
  keep = found["index"] >= 0
  index, prediction = found["index"][keep], found["prediction"][keep]
  names = tuple(c.task.label_names)
  as_text = lambda p: names[p] if names else f"{p:.6g}" if np.issubdtype(prediction.dtype, np.floating) else str(p)
  _write_predictions(path, [f"{i}\t{as_text(p)}" for i, p in zip(index, prediction)])
  metrics = {}
  if found["weight"][keep].any():
    sums = [({k: float(v) for k, v in m.items()}, {k: float(v) for k, v in d.items()}) for m, d, _ in out]
    metrics = evaluate.summarize(sums, lambda metric: s.objective.denominator_of(metric, sums[0][1]))
    metrics.update(evaluate.prediction_metrics(found))
    metrics = {k.replace("eval_", "test_", 1): v for k, v in metrics.items()}
  return path, metrics

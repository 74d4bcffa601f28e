"""Frozen-feature probe: `python -m lm_jax.evals.probe --init_from=DIR --files='/data/sst2/{split}.tsv' --pooling=mean
[--layer=N | --last4]`.

Features of a frozen BERT (a Hugging Face directory, e.g. BertModel, or an lm_jax workdir's latest checkpoint): the
hidden states after layer N (default the last) or the last four concatenated (BERT §5.3's feature-based
approach), pooled at [CLS] or averaged over the tokens; then scikit-learn's LogisticRegression on the train split,
its C chosen on dev; accuracy on dev and test is printed last as one JSON line. Examples are read like
config.task (lm_jax/data/tasks.py) and sorted by length, so batches are only as wide as their longest example. A flag
that cannot apply exits 2 and a missing or unusable split 1 (README), before any feature is computed: every split is
read before the first forward pass.
"""
import functools
import json
import sys
import time

from lm_jax import malloc

malloc.keep_freed_memory()  # before anything starts JAX's backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from lm_jax import config_lib, defaults, init_from as init_from_lib, models, sharding  # noqa: E402
from lm_jax.data import tasks, tokenizer as tokenizer_lib  # noqa: E402
from lm_jax.models import layers  # noqa: E402
from lm_jax.objectives import classify  # noqa: E402

C_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
_WIDTH = 16                   # batches are cut to a multiple of this many positions (few shapes to compile)


def _model(init_from: str):
  """(model config in the looped layout, tokenizer path) of a BERT checkpoint: an HF directory or a workdir."""
  model, tokenizer_path = init_from_lib.source_model(init_from)
  if models.family(model).layout != "encoder":
    raise config_lib.ConfigError(f"--init_from={init_from}: the probe reads BERT hidden states; this is a "
                                 f"{model.family!r} model")
  return layers.replace(model, scan_layers=False), tokenizer_path


def _params(init_from: str, model_cfg):
  config = defaults.base_config()
  config.init_from, config.model = init_from, model_cfg
  mesh = sharding.make_mesh(config)
  with jax.set_mesh(mesh):
    return jax.device_get(init_from_lib.pretrained_params(config, mesh, sharding.rules(config)))


def load(init_from: str):
  """(model config in the looped layout, params, tokenizer) of a BERT checkpoint: an HF directory or a workdir."""
  model_cfg, tokenizer_path = _model(init_from)
  return model_cfg, _params(init_from, model_cfg), tokenizer_lib.load(tokenizer_path, models.family(model_cfg))


def _layers(model_cfg, layer: int, last4: bool) -> tuple:
  """The 0-based indices of the layers whose outputs make the features."""
  n = model_cfg.num_layers
  if last4:
    if n < 4:
      raise config_lib.ConfigError(f"--last4 needs 4 layers; the model has {n}")
    return tuple(range(n - 4, n))
  if not 0 <= layer <= n:
    raise config_lib.ConfigError(f"--layer={layer} must be in [1, {n}] (0 = the last)")
  return ((layer or n) - 1,)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _encode(cfg, params, batch, chosen, pooling):
  """Pooled outputs of the chosen layers, concatenated: (B, len(chosen) * d_model). Everything else the model
  computes (later layers, heads) is dead code that XLA drops."""
  is_block = lambda module, method: layers.LOOPED.fullmatch(module.name or "") is not None   # 'layers_<i>'
  _, state = models.family(cfg).Model(cfg).apply({"params": params}, batch, capture_intermediates=is_block,
                                                 mutable=["intermediates"])
  mask = batch["attention_mask"][..., None].astype(jnp.float32)
  pooled = []
  for i in chosen:
    h = state["intermediates"][f"layers_{i}"]["__call__"][0][0].astype(jnp.float32)
    pooled.append(h[:, 0] if pooling == "cls" else (h * mask).sum(1) / jnp.maximum(mask.sum(1), 1.0))
  return jnp.concatenate(pooled, axis=-1)


def features(model_cfg, params, tokenizer, examples: list, *, seq_len: int, chosen: tuple, pooling: str,
             batch_size: int = 64) -> np.ndarray:
  """(len(examples), features) for task examples (data.tasks.Example), in their order."""
  cfg = layers.frozen(model_cfg)
  specials = 1 + max(len(ex.segments) for ex in examples)
  order = np.argsort([sum(map(len, ex.segments)) for ex in examples], kind="stable")
  out = np.zeros((len(examples), len(chosen) * model_cfg.d_model), np.float32)
  for start in range(0, len(order), batch_size):
    idx = order[start:start + batch_size]
    rows = classify.assemble_rows([examples[i] for i in idx], batch_size, seq_len=seq_len, specials=specials,
                                  tokenizer=tokenizer, regression=False)
    width = min(seq_len, -(-int(rows["attention_mask"].sum(1).max()) // _WIDTH) * _WIDTH)
    batch = {k: jnp.asarray(rows[k][:, :width]) for k in ("input_ids", "token_type_ids", "attention_mask")}
    if not model_cfg.get("num_labels", 0):   # score the MLM head at one position only
      batch["mlm_positions"] = jnp.zeros((batch_size, 1), jnp.int32)
    out[idx] = np.asarray(_encode(cfg, params, batch, chosen, pooling))[:len(idx)]
  return out


def _examples(corpus: tasks.Examples, *, labelled: bool, limit: int = 0, seed: int = 0) -> list:
  found = [ex for ex in corpus.tokens(list(range(len(corpus)))) if ex is not None and (ex.label is not None
                                                                                           or not labelled)]
  if not found:
    raise ValueError(f"no usable examples in {corpus.path} (skipped: {corpus.stats})")
  if limit and len(found) > limit:
    found = [found[i] for i in sorted(np.random.default_rng(seed).choice(len(found), limit, replace=False))]
  return found


def logistic_regression(train, dev, test=None, grid=C_GRID) -> dict:
  """Each of (features, labels); the C of `grid` best on dev (the smallest on ties), then accuracy on dev and on
  test (None without test or its labels)."""
  from sklearn.linear_model import LogisticRegression
  from sklearn.pipeline import make_pipeline
  from sklearn.preprocessing import StandardScaler
  best = None
  for c in grid:
    model = make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000)).fit(*train)
    score = model.score(*dev)
    if best is None or score > best[0]:
      best = (score, c, model)
  score, c, model = best
  test_acc = model.score(*test) if test is not None and not any(y is None for y in test[1]) else None
  return {"dev_accuracy": float(score), "test_accuracy": None if test_acc is None else float(test_acc), "C": c}


def run(init_from: str, *, files: str = "", tfds_name: str = "", text_fields=("0",), label_field: str = "1",
        label_names=(), num_labels: int = 2, pooling: str = "mean", layer: int = 0, last4: bool = False,
        splits=("train", "dev", "test"), max_train: int = 0, seq_len: int = 128, batch_size: int = 64,
        log=print) -> dict:
  """Features -> logistic regression -> {dev_accuracy, test_accuracy, C, train_examples, features, seconds}."""
  if pooling not in ("cls", "mean"):
    raise config_lib.ConfigError(f"--pooling={pooling!r}: use cls or mean")
  if len(splits) != 3:
    raise config_lib.ConfigError(f"--splits needs three splits (train, dev, test), got {list(splits)}")
  for name, value, least in (("seq_len", seq_len, 3), ("batch_size", batch_size, 1), ("max_train", max_train, 0)):
    if value < least:
      raise config_lib.ConfigError(f"--{name}={value} must be >= {least}")
  start = time.perf_counter()
  task = defaults.base_config()
  task.model.num_labels = num_labels
  task.task.update(files=files, tfds_name=tfds_name, text_fields=tuple(text_fields), label_field=label_field,
                   label_names=tuple(label_names), test_split=splits[2])
  try:
    tasks.check(task)
  except ValueError as e:   # the flags are named as the config.task / config.model fields they set
    raise config_lib.ConfigError(str(e).replace("config.task.", "--").replace("config.model.", "--")) from None
  model_cfg, tokenizer_path = _model(init_from)
  chosen = _layers(model_cfg, layer, last4)
  if seq_len > model_cfg.max_positions:
    raise config_lib.ConfigError(f"--seq_len={seq_len} exceeds the model's max_positions={model_cfg.max_positions}")
  tokenizer = tokenizer_lib.load(tokenizer_path, models.family(model_cfg))
  corpora = [tasks.examples(task, split, tokenizer) for split in splits]   # a missing split stops here
  params = _params(init_from, model_cfg)
  data = {}
  for split, corpus, limit in zip(splits, corpora, (max_train, 0, 0)):
    examples = _examples(corpus, labelled=split != splits[2], limit=limit)
    x = features(model_cfg, params, tokenizer, examples, seq_len=seq_len, chosen=chosen, pooling=pooling,
                 batch_size=batch_size)
    data[split] = (x, [ex.label for ex in examples])
    log(f"{split}: {len(examples)} examples, features {x.shape[1]} ({time.perf_counter() - start:.0f} s)")
  result = logistic_regression(*(data[s] for s in splits))
  return {**result, "train_examples": len(data[splits[0]][1]), "features": int(data[splits[0]][0].shape[1]),
          "seconds": round(time.perf_counter() - start, 1)}


def _define_flags() -> dict:
  """The command line's flags (defined only when run as a program: lm_jax.main has an --init_from too)."""
  return dict(
      init_from=flags.DEFINE_string("init_from", None, "a Hugging Face BERT directory or an lm_jax workdir"),
      files=flags.DEFINE_string("files", "", "task files with {split}, e.g. /data/sst2/{split}.tsv (or --tfds_name)"),
      tfds_name=flags.DEFINE_string("tfds_name", "", "a TFDS task, e.g. glue/sst2 (splits train,validation,test)"),
      text_fields=flags.DEFINE_list("text_fields", ["0"], "one or two text fields (column numbers in a headerless "
                                    ".tsv)"),
      label_field=flags.DEFINE_string("label_field", "1", "the label field"),
      label_names=flags.DEFINE_list("label_names", [], "labels as written in the data, in class order"),
      num_labels=flags.DEFINE_integer("num_labels", 2, "classes (labels are 0..num_labels-1 without --label_names)"),
      pooling=flags.DEFINE_enum("pooling", "mean", ["cls", "mean"], "[CLS] state or the mean over the tokens"),
      layer=flags.DEFINE_integer("layer", 0, "the layer whose output is the feature (1..num_layers; 0 = the last)"),
      last4=flags.DEFINE_bool("last4", False, "concatenate the outputs of the last four layers"),
      splits=flags.DEFINE_list("splits", ["train", "dev", "test"], "train, dev (chooses C) and test splits"),
      max_train=flags.DEFINE_integer("max_train", 0, "a random subset of this many training examples (0 = all)"),
      seq_len=flags.DEFINE_integer("seq_len", 128, "longer examples are truncated"),
      batch_size=flags.DEFINE_integer("batch_size", 64, "examples per forward pass"))


def main(argv, defined: dict):
  f = {k: v.value for k, v in defined.items()}
  with config_lib.user_errors():
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if f["layer"] and f["last4"]:
      raise app.UsageError("--layer and --last4 exclude each other")
    result = run(f.pop("init_from"), **{**f, "splits": tuple(f["splits"])},
                 log=lambda line: print(line, file=sys.stderr, flush=True))
  print(json.dumps(result), flush=True)


def _parse_flags(argv: list[str]) -> list[str]:
  """app.run's flags_parser: a wrong flag exits 2 with one line, as lm_jax.main's do."""
  with config_lib.user_errors():
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      raise app.UsageError(str(e)) from None


if __name__ == "__main__":
  _defined = _define_flags()
  flags.mark_flags_as_required(["init_from"])
  app.run(lambda argv: main(argv, _defined), flags_parser=_parse_flags)

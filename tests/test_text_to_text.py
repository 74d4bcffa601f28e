"""T5 text-to-text fine-tuning (lm_jax/objectives/text_to_text.py, configs/finetune/t5.py): the rows hold the
prefixed input and the label word, the loss and the label-word choice equal hand computations, and a tiny T5 from
scratch learns a synthetic task (keyword classification) through train.train: eval accuracy of the label-word
choice, --mode=predict's label words, and the free-form path (greedy decoding, exact string match)."""
import csv
import random

import jax
import numpy as np
import pytest
from scipy import special

from lm_jax import checkpoint, config_lib, decoding, init_from, models, objectives, train
from lm_jax.data import pipeline, tokenizer as tokenizer_lib
from lm_jax.evals import predict, run_eval
from lm_jax.objectives import text_to_text
from conftest import run_tokenizer

WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree")
KEY = "sun"                    # the synthetic task: "find words: <4 words>" -> positive if KEY is among them
LABELS = ("negative", "positive")
DECODER_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")


def _synthetic(path):
  """train / test .tsv (words<TAB>label) of distinct 4-word inputs, and a .txt of their text."""
  rng = random.Random(0)
  inputs = sorted({" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(3000)})
  rng.shuffle(inputs)
  splits = {"train": inputs[:1200], "test": inputs[1200:1264]}
  for split, rows in splits.items():
    with open(path / f"{split}.tsv", "w") as f:
      f.write("words\tlabel\n" + "".join(f"{x}\t{LABELS[KEY in x.split()]}\n" for x in rows))
  extra = "mnli hypothesis: the cat sat premise: a dog ran entailment neutral contradiction " + " ".join(
      text_to_text.STSB_VALUES)   # for the rows test
  docs = [extra] * 200 + [f"find words: {x}\n{LABELS[KEY in x.split()]}" for x in inputs]
  (path / "text.txt").write_text("\n\n".join(docs))
  return splits


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  path = tmp_path_factory.mktemp("t2t_data")
  return path, _synthetic(path)


def tiny_config(data_dir, **overrides):
  """configs/finetune/t5.py:tiny on the synthetic task, a 1-layer d_model 32 T5."""
  values = {"task.files": str(data_dir / "{split}.tsv"), "data.files": str(data_dir / "text.txt"),
            "task.text_fields": ("words",), "task.field_names": ("words",), "task.label_field": "label",
            "task.prefix": "find", "model.vocab_size": 164, "model.d_model": 32, "model.num_heads": 2,
            "model.head_dim": 16, "model.d_ff": 64, "model.num_layers": 1, "data.seq_len": 24,
            "data.target_len": 6, "batch_size": 32, "data.eval_batches": 0, "peak_tflops": 1.0}
  return config_lib.load("configs/finetune/t5.py:tiny", {**values, **overrides})


@pytest.fixture(scope="module")
def tokenizer_path(data, tmp_path_factory):
  """A SentencePiece T5 tokenizer trained once on the synthetic text."""
  workdir = tmp_path_factory.mktemp("t2t_tokenizer")
  run_tokenizer(tiny_config(data[0]), str(workdir))
  return str(next(workdir.glob("tokenizer_t5_*.model")))


def test_rows_hold_the_prefixed_input_and_the_label_word(tmp_path, tokenizer_path):
  """A sentence pair with label words (T5's 'mnli hypothesis: ... premise: ...'), a regression target rounded
  to 0.2 (STS-B), a free-form text target and an unlabelled example; decoded back with the tokenizer."""
  (tmp_path / "dev.tsv").write_text("premise\thypothesis\tlabel\tscore\n"
                                    "the cat sat\ta dog ran\tcontradiction\t3.73\nred moon\tblue sun\t\t\n")
  tok = tokenizer_lib.load(tokenizer_path, models.family("t5"))
  nli = {"task.files": str(tmp_path / "{split}.tsv"), "task.text_fields": ("hypothesis", "premise"),
         "task.field_names": (), "task.label_field": "label", "task.prefix": "mnli", "task.label_names": (),
         "data.eval_split": "dev", "batch_size": 4, "data.seq_len": 48, "data.target_len": 16}
  cases = {"labels": ({**nli, "task.label_names": ("entailment", "neutral", "contradiction"), "model.num_labels": 3},
                      "contradiction", 2),
           "regression": ({**nli, "task.label_field": "score", "model.num_labels": 1}, "3.8", 3.73),
           "free-form": ({**nli, "task.label_names": (), "model.num_labels": 0}, "contradiction", 0)}
  for name, (overrides, target, label) in cases.items():
    c = config_lib.load("configs/finetune/t5.py:tiny", {**overrides, "data.tokenizer": tokenizer_path})
    objectives.check(c)
    (batch,) = pipeline.make_eval_iterator(c, tok, objectives.get("text_to_text"))
    text = lambda ids: tok.decode([i for i in ids if i not in (tok.pad_id, tok.eos_id)])
    ends_with_eos = lambda ids: ids[ids != tok.pad_id][-1] == tok.eos_id
    ids, targets = batch["input_ids"], batch["decoder_target_ids"]
    assert text(ids[0]) == "mnli hypothesis: a dog ran premise: the cat sat", name
    assert text(ids[1]) == "mnli hypothesis: blue sun premise: red moon", name
    assert text(targets[0]) == target and ends_with_eos(ids[0]) and ends_with_eos(targets[0]), name
    np.testing.assert_array_equal(batch["decoder_input_ids"][0], np.r_[0, targets[0, :-1]])
    assert batch["weights"][0].sum() == (targets[0] != tok.pad_id).sum() and not batch["weights"][1:].any(), name
    assert batch["labels"][0] == pytest.approx(label) and batch["label_weights"].tolist() == [1, 0, 0, 0], name
    assert batch["index"].tolist() == [0, 1, -1, -1], name
    if name == "labels":
      assert [text(row) for row in batch["choice_ids"][0]] == ["entailment", "neutral", "contradiction"]
    if name == "regression":
      assert [text(row) for row in batch["choice_ids"][0]] == list(text_to_text.STSB_VALUES)
    assert ("choice_ids" in batch) == (name != "free-form")


def test_loss_and_choice_match_a_hand_computation(data, tokenizer_path):
  """loss / token metrics / exact match from models.apply by hand; the label-word scores equal decoding.score's
  log-probabilities, and the eval accuracy and predictions are their argmax."""
  c = tiny_config(data[0], **{"data.tokenizer": tokenizer_path, "batch_size": 8, "data.eval_split": "test"})
  tok = tokenizer_lib.load(tokenizer_path, models.family("t5"))
  objective = objectives.get("text_to_text")
  batch = next(iter(pipeline.make_eval_iterator(c, tok, objective)))
  params = models.init(c.model, jax.random.key(3))
  rng = np.random.default_rng(4)   # off the init, so the candidates' scores differ (numpy: nothing to compile)
  params = jax.tree.map(lambda p: np.asarray(p) + 0.3 * rng.standard_normal(p.shape).astype(np.float32), params)

  den = {k: float(v) for k, v in objective.denominators(batch).items()}
  eval_out = jax.jit(lambda p, b: (objective.loss(c, p, b, objective.denominators(b), train=False)[1],
                                   objective.predict(c, p, b), text_to_text.choice_logprobs(c, p, b),
                                   models.apply(c.model, p, {k: b[k] for k in DECODER_KEYS})["logits"]))
  metrics, predicted, ours, logits = jax.device_get(eval_out(params, batch))
  targets, w, logits = batch["decoder_target_ids"], batch["weights"], logits.astype(np.float64)
  nll = -np.take_along_axis(special.log_softmax(logits, -1), targets[..., None], -1)[..., 0]
  right = logits.argmax(-1) == targets
  assert den == {"tokens": w.sum(), "examples": 8.0}
  assert metrics["loss"] == pytest.approx((nll * w).sum() / w.sum(), rel=1e-5)
  assert metrics["token_loss"] == pytest.approx((nll * w).sum() / w.sum(), rel=1e-5)
  assert metrics["token_accuracy"] == pytest.approx((right * w).sum() / w.sum())
  assert metrics["exact_match"] == pytest.approx(np.all(right | (w == 0), axis=1).mean())

  contexts = [row[row != tok.pad_id].tolist() for row in batch["input_ids"]]
  words = [row[row != tok.pad_id].tolist() for row in batch["choice_ids"][0]]
  scores = decoding.score(c.model, params, contexts * len(words), [word for word in words for _ in contexts])[0]
  scores = scores.reshape(len(words), len(contexts)).T
  np.testing.assert_allclose(ours, scores, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(predicted["prediction"], scores.argmax(1))
  assert metrics["accuracy"] == pytest.approx((scores.argmax(1) == batch["labels"]).mean())
  train_metrics = jax.eval_shape(lambda p, b: objective.loss(c, p, b, objective.denominators(b), train=True,
                                                             rng=jax.random.key(0))[1], params, batch)
  assert set(train_metrics) == {"loss", "token_loss", "token_accuracy", "exact_match"}   # no choice at training


def test_tiny_t5_learns_a_synthetic_task(data, tokenizer_path, tmp_path):
  """From scratch, 40 steps: on held-out inputs --mode=predict writes the right label words (>= 95%) with accuracy
  and exact match >= 95% (the eval step's metrics), and greedy decoding of the free-form variant writes them too."""
  path, splits = data
  c = tiny_config(path, **{"data.tokenizer": tokenizer_path, "total_steps": 40, "eval_every": 0,
                           "checkpoint_every": 40, "log_every": 20, "optimizer.lr": 1e-2, "finetune.best_metric": ""})
  result = train.train(c, str(tmp_path))
  assert result["train"]["loss"] < 0.5, result["train"]

  out, metrics = predict.predict(*run_eval.restore_params(c, str(tmp_path))[:2], str(tmp_path))
  with open(out) as f:
    written = list(csv.DictReader(f, delimiter="\t"))
  truth = [LABELS[KEY in x.split()] for x in splits["test"]]
  assert [int(r["index"]) for r in written] == list(range(len(truth)))
  assert np.mean([r["prediction"] == t for r, t in zip(written, truth)]) >= 0.95
  assert metrics["test_accuracy"] >= 0.95 and metrics["test_exact_match"] >= 0.95 and metrics["test_f1"] >= 0.9, metrics

  free = tiny_config(path, **{"data.tokenizer": tokenizer_path, "task.label_names": (), "model.num_labels": 0})
  tok = tokenizer_lib.load(tokenizer_path, models.family("t5"))
  got = text_to_text.generate_texts(free, jax.device_get(result["state"]["params"]), tok, "test",
                                     decoding.generate)
  assert got["target"] == truth and got["exact_match"] >= 0.95, got
  # --mode=predict of a free-form run writes its decoded texts (here after 2 steps: any texts will do)
  free.total_steps, free.checkpoint_every, free.eval_every, free.finetune.best_metric = 2, 2, 0, ""
  params = jax.device_get(train.train(free, str(tmp_path / "free"))["state"]["params"])
  out, metrics = predict.predict(*run_eval.restore_params(free, str(tmp_path / "free"))[:2], str(tmp_path / "free"))
  with open(out) as f:
    written = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
  want = text_to_text.generate_texts(free, params, tok, "test", decoding.generate)
  assert [r["prediction"] for r in written] == [" ".join(t.split()) for t in want["prediction"]]
  assert metrics == {"test_exact_match": want["exact_match"]}


@pytest.mark.parametrize("variant", ["cola", "sst2", "stsb", "mnli", "rte", "tiny"])
def test_recipes_are_the_papers_and_check(variant):
  """T5's fine-tuning: Adafactor at a constant 1e-3, batch 128 x 512 with targets of 128; T5's task inputs."""
  c = config_lib.load(f"configs/finetune/t5.py:{variant}")
  objectives.check(c)
  init_from.check(c)
  checkpoint.check_best(c)
  assert (c.optimizer.name, c.optimizer.schedule, c.optimizer.warmup_steps) == ("adafactor", "constant", 0)
  if variant != "tiny":
    assert (c.optimizer.lr, c.batch_size, c.data.seq_len, c.data.target_len) == (1e-3, 128, 512, 128)
  prefix = "sst2" if variant == "tiny" else variant
  first = {"mnli": "hypothesis", "stsb": "sentence1", "rte": "sentence1"}.get(variant, "sentence")
  assert text_to_text.input_text(c, ("a", "b")[:len(c.task.text_fields)]).startswith(f"{prefix} {first}: a")
  assert text_to_text.target_text(c, 2.5 if variant == "stsb" else 0) == {
      "cola": "unacceptable", "stsb": "2.4", "mnli": "entailment", "rte": "entailment"}.get(variant, "negative")

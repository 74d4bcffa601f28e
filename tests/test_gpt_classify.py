"""GPT-1 fine-tuning (objective gpt_classify): each input transformation's loss against a hand computation on a tiny
random model, multiple-choice probabilities, the start / delimiter / extract rows appended to a pre-trained
embedding, multiple-choice task records, and a short fine-tune of a tiny pre-trained GPT on the offline SST-2."""
import jax
import numpy as np
import pytest

from lm_jax import checkpoint, config_lib, defaults, init_from, models, objectives, optim, step, train
from lm_jax.data import records, tasks
from lm_jax.objectives import gpt_classify
from lm_jax.obs import metrics_log
from conftest import run_tokenizer

V = 40                      # the "pre-trained" vocabulary; the specials are 40, 41, 42
S, D, E = V, V + 1, V + 2
SEQ = 12
A, B = np.arange(3, 10), np.array([20, 21, 22])           # 7 and 3 tokens: [s a $ b e] cuts a to 6 at seq 12
ANSWERS = (np.array([30, 31]), np.array([32]), np.arange(10, 20))   # the last row cuts both: 5 + 4 tokens


def config_of(fmt, num_labels, **task):
  c = defaults.base_config()
  c.objective = "gpt_classify"
  m = c.model = defaults.model_defaults("gpt")
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = V + 3, 16, 1, 2, 64, 16
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.num_labels, m.added_tokens = num_labels, 3
  c.data.seq_len = SEQ
  c.task.update(format=fmt, files="unused/{split}.tsv", **task)
  return c


# format -> (config, example segments, label, the rows [s; ...; e] by hand)
CASES = {
    "classify": (config_of("classify", 3), (A,), 2, [[S, *A, E]]),
    "entailment": (config_of("entailment", 3, text_fields=("p", "h")), (A, B), 1, [[S, *A[:6], D, *B, E]]),
    "similarity": (config_of("similarity", 2, text_fields=("a", "b")), (A, B), 1,
                   [[S, *A[:6], D, *B, E], [S, *B, D, *A[:6], E]]),
    "multiple_choice": (config_of("multiple_choice", 1, choice_fields=("x", "y", "z")), (A, *ANSWERS), 2,
                        [[S, *A, D, 30, 31, E], [S, *A, D, 32, E], [S, *A[:5], D, 10, 11, 12, 13, E]]),
}


def _random_params(model_cfg, seed, std=0.2):
  """Random params of model_cfg's shapes, without compiling its init (LayerNorm scales around 1)."""
  rng = np.random.default_rng(seed)
  draw = lambda path, x: (rng.normal(0, std, x.shape) + (path[-1].key == "scale")).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, models.abstract_params(model_cfg))


def _batch(config, segments, label):
  """The example, a second one without its label, and a padding row."""
  examples = [tasks.Example(segments, label, 0), tasks.Example(segments, None, 1)]
  return gpt_classify.assemble_rows(examples, 3, fmt=config.task.format, seq_len=SEQ,
                                    rows=gpt_classify.rows_per_example(config),
                                    specials=gpt_classify.special_ids(config), pad_id=0)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def _hand(config, params, rows, label):
  """(CE of the classifier at the extract token, mean over rows of the row's mean next-token loss, task logits)
  from a direct models.apply on the rows (zeros after them: causal, so they cannot matter)."""
  ids = np.zeros((len(rows), SEQ), np.int32)
  for i, row in enumerate(rows):
    ids[i, :len(row)] = row
  out = jax.jit(lambda p, x: models.apply(config.model, p, {"input_ids": x}))(params, ids)
  states, lm = [], []
  for i, row in enumerate(rows):
    states.append(np.asarray(out["hidden"][i, len(row) - 1], np.float64))          # the extract token's state
    logp = _log_softmax(out["logits"][i, :len(row) - 1])
    lm.append(-np.mean(logp[np.arange(len(row) - 1), row[1:]]))
  kernel, bias = (np.asarray(params["classifier"][k], np.float64) for k in ("kernel", "bias"))
  if config.task.format == "multiple_choice":
    logits = np.array([h @ kernel[:, 0] + bias[0] for h in states])
  else:
    logits = sum(states) @ kernel + bias
  return -_log_softmax(logits)[label], np.mean(lm), logits


@pytest.mark.parametrize("fmt", list(CASES))
def test_loss_is_the_hand_computation(fmt):
  """loss = CE(classifier at e) + 0.5 * LM loss on [s; ...; e], over the labelled example only; the rows hold the
  special ids where the paper puts them, the longer text truncated first."""
  config, segments, label, rows = CASES[fmt]
  batch = _batch(config, segments, label)
  assert [list(r[:len(want)]) for r, want in zip(batch["input_ids"][0], rows)] == rows
  assert batch["attention_mask"][0].sum(-1).tolist() == [len(r) for r in rows] and not batch["attention_mask"][2].any()
  assert batch["weights"].tolist() == [1, 0, 0] and batch["index"].tolist() == [0, 1, -1]
  params = _random_params(config.model, 1)
  objective = objectives.get("gpt_classify")

  def run(params, batch):
    total, metrics = objective.loss(config, params, batch, objective.denominators(batch))
    return (total, metrics, objective.predict(config, params, batch)["prediction"],
            gpt_classify.probabilities(config, params, batch))
  total, metrics, prediction, probs = jax.device_get(jax.jit(run)(params, batch))
  ce, lm, logits = _hand(config, params, rows, label)
  np.testing.assert_allclose([metrics["clf_loss"], metrics["lm_loss"]], [ce, lm], rtol=1e-5)
  np.testing.assert_allclose(total, ce + 0.5 * lm, rtol=1e-5)
  assert prediction[0] == np.argmax(logits) and metrics["accuracy"] == (np.argmax(logits) == label)
  np.testing.assert_allclose(probs[0], np.exp(_log_softmax(logits)), rtol=1e-5)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)    # multiple choice: over the K answers
  assert probs.shape == (3, 3 if fmt == "multiple_choice" else config.model.num_labels)


def test_embedding_extension_keeps_pretrained_rows_and_seeds_the_new_ones():
  config = config_of("classify", 2)
  config.init_from = "pretrained"
  pre_model = config.model.copy_and_resolve_references()
  pre_model.vocab_size, pre_model.num_labels = V, 0
  pretrained, fresh = _random_params(pre_model, 3), _random_params(config.model, 4)
  params, report = init_from.initial_params(config, fresh, pretrained)
  table = np.asarray(params["word_embeddings"]["embedding"])
  assert table.shape == (V + 3, 16)
  np.testing.assert_array_equal(table[:V], pretrained["word_embeddings"]["embedding"])
  np.testing.assert_array_equal(table[V:], np.asarray(fresh["word_embeddings"]["embedding"])[V:])
  positions = lambda tree: np.asarray(tree["position_embeddings"]["embedding"])
  np.testing.assert_array_equal(positions(params), positions(pretrained))
  assert f"word_embeddings/embedding: {V} pre-trained rows + 3 fresh" in report and "fresh init: classifier" in report


def test_multiple_choice_records_and_config_errors(tmp_path):
  (tmp_path / "mc.jsonl").write_text('{"story": "s", "a": "x", "b": "y", "c": "z", "label": 2}\n'
                                     '{"story": "s", "a": "x", "b": "y", "c": "z", "label": 3}\n')
  config = config_of("multiple_choice", 1, choice_fields=("a", "b", "c"), text_fields=("story",))
  config.task.files = str(tmp_path / "{split}.jsonl")
  found = tasks.records(config, "mc")
  assert found[0] == tasks.Record(("s", "x", "y", "z"), 2) and isinstance(found[1], records.Bad)  # answer 3 of 3
  objectives.check(config)

  def error(**fields):
    c = config_of("classify", 2)
    for k, v in fields.items():
      group, name = k.split(".")
      c[group][name] = v
    with pytest.raises(ValueError) as e:
      objectives.check(c)
    return str(e.value)
  assert "set config.init_from" in error(**{"model.added_tokens": 0})
  assert "config.task.format='pairs' unknown" in error(**{"task.format": "pairs"})
  assert "num_labels == 1" in error(**{"task.format": "multiple_choice", "task.choice_fields": ("a", "b")})
  assert "needs 2 field(s)" in error(**{"task.format": "entailment"})


def test_recipe_is_the_papers():
  c = config_lib.load("configs/finetune/gpt1.py:mnli")
  o = c.optimizer
  assert (c.objective, c.task.format, c.task.text_fields, c.model.num_labels) == (
      "gpt_classify", "entailment", ("premise", "hypothesis"), 3)
  assert (o.name, o.lr, o.weight_decay, o.schedule, c.batch_size, c.task.lm_coef, c.model.dropout_rate) == (
      "adam_l2", 6.25e-5, 0.01, "linear", 32, 0.5, 0.1)
  assert c.total_steps == -(-3 * 392_702 // 32) and o.warmup_steps == round(0.002 * c.total_steps)
  assert config_lib.load("configs/finetune/gpt1.py:qqp").task.format == "similarity"


# --------------------------------------------------------------------------------- a tiny GPT, then fine-tuned
@pytest.fixture(scope="module")
def finetuned(shared_data, tmp_path_factory):
  """A random 1-layer GPT saved as a run's workdir (its tokenizer trained on 300 SST-2 sentences, no train step to
  compile), then fine-tuned on SST-2 with configs/finetune/gpt1.py:tiny."""
  root = tmp_path_factory.mktemp("gpt1")
  lines = (shared_data / "sst2" / "train.tsv").read_text().splitlines()[:300]
  (root / "text.txt").write_text("\n\n".join(l.split("\t")[0] for l in lines))
  pre = config_lib.load("configs/gpt1.py:tiny", {
      "data.files": str(root / "text.txt"), "model.vocab_size": 128, "model.d_model": 32, "model.num_heads": 2,
      "model.d_ff": 128, "model.num_layers": 1})
  run_tokenizer(pre, str(root / "pre"))
  tx, _ = optim.make(pre, models.logical_axes(pre.model))
  mngr = checkpoint.manager(str(root / "pre"), 1)
  checkpoint.save(mngr, 1, step.init_state(_random_params(pre.model, 5, std=0.02), tx), {}, pre)
  checkpoint.finish(mngr)
  mngr.close()
  config = config_lib.load("configs/finetune/gpt1.py:tiny", {
      "init_from": str(root / "pre"), "task.files": str(shared_data / "sst2" / "{split}.tsv"),
      "data.train_split": "train[:480]", "data.eval_split": "dev[:40]", "data.seq_len": 32, "batch_size": 16,
      "total_steps": 24, "log_every": 1, "eval_every": 24, "checkpoint_every": 24, "optimizer.lr": 3e-3,
      "peak_tflops": 1.0})
  result = train.train(config, str(root / "ft"))
  return config, root, result


def test_finetune_a_tiny_gpt_on_sst2(finetuned):
  config, root, result = finetuned
  resolved = init_from.resolve(config)
  assert (resolved.model.vocab_size, resolved.model.added_tokens, resolved.model.num_labels) == (131, 3, 2)
  again = config.copy_and_resolve_references()
  again.init_from = str(root / "ft")          # a fine-tuned run keeps its enlarged vocabulary
  assert init_from.resolve(again).model.vocab_size == 131
  assert result["state"]["params"]["word_embeddings"]["embedding"].shape == (131, 32)
  recs = metrics_log.read(str(root / "ft" / "metrics.jsonl"))
  losses = [r["loss"] for r in recs if "loss" in r]
  assert len(losses) == 24 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses
  final = [r for r in recs if "eval_accuracy" in r][-1]
  assert 0 <= final["eval_accuracy"] <= 1 and {"eval_lm_loss", "eval_clf_loss", "eval_f1"} <= set(final)

"""lm_jax.evals.zeroshot (GPT-1 §5's zero-shot heuristics) on a tiny random GPT: each heuristic's scores against
log-probabilities computed by hand from models.apply (numpy log-softmax at the scored positions), the accuracy and
thresholds that follow from them, and one --mode=zeroshot run on a Hugging Face export of the same model."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cli
from lm_jax import config_lib, defaults, models
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.evals import zeroshot
from lm_jax.hf import export
from lm_jax.models import layers

metrics = pytest.importorskip("sklearn.metrics")

VOCAB, POSITIONS = 256, 64
SST2 = dict(text_fields=("0",), label_field="1")   # the offline SST-2 .tsv: sentence<TAB>label, no header


@pytest.fixture(scope="module")
def gpt(shared_data):
  """(model config, params, tokenizer): a 1-layer GPT with N(0, 0.3^2) weights (far from uniform predictions), a
  SentencePiece tokenizer trained on SST-2 sentences."""
  with open(shared_data / "sst2" / "train.tsv", encoding="utf-8") as f:
    lines = [line.split("\t")[0] for line in f][:2000]
  tok = tokenizer_lib._sentencepiece(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=VOCAB), models.family("gpt"))
  m = defaults.model_defaults("gpt")
  m.update(vocab_size=VOCAB, d_model=32, num_layers=1, num_heads=2, d_ff=128, max_positions=POSITIONS,
           layer_norm_eps=1e-5, dropout_rate=0.0, attention_dropout_rate=0.0)
  rng = np.random.default_rng(0)
  draw = lambda path, a: (0.3 * rng.standard_normal(a.shape) + path[-1].key.endswith("scale")).astype(np.float32)
  return m, jax.tree_util.tree_map_with_path(draw, models.abstract_params(m)), tok


def task_config(shared_data, **task):
  return config_lib.load("configs/gpt1.py:tiny", {"task.files": str(shared_data / "sst2" / "{split}.tsv"),
                                                  **{f"task.{k}": v for k, v in (SST2 | task).items()}})


@functools.partial(jax.jit, static_argnums=0)
def _logits(cfg, params, ids):
  return models.apply(cfg, params, {"input_ids": ids, "attention_mask": jnp.ones_like(ids)})["logits"]


def hand_logprobs(m, params, seqs) -> list:
  """Per sequence, log P(token j | tokens < j) for j = 1..len-1: one unmasked forward pass of the sequences without
  their last token, padded on the right to one shape for every test (causal: the padding after a row changes
  nothing in it), then a float64 log-softmax in numpy."""
  rows = 32
  assert len(seqs) <= rows and max(map(len, seqs)) <= POSITIONS + 1
  ids = np.zeros((rows, POSITIONS), np.int32)
  for i, s in enumerate(seqs):
    ids[i, :len(s) - 1] = s[:-1]
  logits = np.asarray(_logits(layers.frozen(m), params, ids), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return [logp[i, np.arange(len(s) - 1), s[1:]] for i, s in enumerate(seqs)]


def test_sentiment_is_the_likelier_label_word_after_the_cue(gpt, shared_data):
  m, params, tok = gpt
  config = task_config(shared_data, label_names=("bad", "good"))   # the data's labels are class numbers 0 / 1
  data = zeroshot.read(config, "sentiment", "dev[:10]")
  with open(shared_data / "sst2" / "dev.tsv", encoding="utf-8") as f:
    rows = [line.rstrip("\n").split("\t") for line in f][:10]
  assert [t[0] for t in data.texts] == [r[0] for r in rows] and data.labels.tolist() == [int(r[1]) for r in rows]
  long = " ".join(r[0] for r in rows)                         # longer than max_positions: cut on the left
  texts, words = [t[0] for t in data.texts] + [long], ("bad", "good")
  got = zeroshot.sentiment_logprobs(m, params, tok, texts, words, cue="so", batch_size=8)
  seqs, starts = [], []
  for text in texts:
    for w in words:
      context, word = [tok.eos_id] + tok.encode(f"{text} so"), tok.encode(" " + w)
      context = context[max(0, len(context) + len(word) - POSITIONS - 1):]
      seqs.append(context + word)
      starts.append(len(context))
  assert len(seqs[-1]) == POSITIONS + 1 and len(tok.encode(long)) > POSITIONS
  hand = np.array([lp[s - 1:].sum() for lp, s in zip(hand_logprobs(m, params, seqs), starts)]).reshape(-1, 2)
  np.testing.assert_allclose(got, hand, atol=1e-4, rtol=0)
  result = zeroshot.evaluate(m, params, tok, "sentiment", data, cue="so", words=words, batch_size=8)
  accuracy = np.mean(hand[:-1].argmax(1) == data.labels)
  assert result["accuracy"] == pytest.approx(accuracy) and 0 < accuracy < 1
  assert (result["examples"], result["skipped"], result["label_words"]) == (10, 0, ["bad", "good"])


def test_choice_is_the_best_average_log_probability_per_token(gpt, shared_data, tmp_path):
  m, params, tok = gpt
  items = [("the film opens on a rainy night", "and it is a great film", "very bad", "the end", "0"),
           ("my friend said", "this movie is long", "yes", "it was a good time at the cinema", "2"),
           ("a story about love", "and war", "and loss and pain", "", "1"),             # an empty answer
           ("nothing works here", "the actors", "the plot", "the music and the script", None),   # unlabelled
           ("it is a movie", "that you will forget", "about a dog", "with a song", "1")]
  with open(tmp_path / "dev.jsonl", "w", encoding="utf-8") as f:
    for *texts, label in items:
      f.write(json.dumps(dict(zip(("story", "a", "b", "c"), texts)) | ({"gold": label} if label else {})) + "\n")
  config = task_config(shared_data, files=str(tmp_path / "{split}.jsonl"), text_fields=("story", "a", "b", "c"),
                       label_field="gold")
  data = zeroshot.read(config, "choice", "dev")
  assert (len(data.labels), data.skipped, data.labels.tolist()) == (3, 2, [0, 2, 1])
  got = zeroshot.choice_logprobs(m, params, tok, [t[0] for t in data.texts], [t[1:] for t in data.texts],
                                 batch_size=8)
  seqs, starts = [], []
  for context, *answers in data.texts:
    for a in answers:
      seqs.append([tok.eos_id] + tok.encode(context) + tok.encode(" " + a))
      starts.append(1 + len(tok.encode(context)))
  hand = np.array([lp[s - 1:].mean() for lp, s in zip(hand_logprobs(m, params, seqs), starts)]).reshape(-1, 3)
  np.testing.assert_allclose(got, hand, atol=1e-5, rtol=0)
  assert len({len(tok.encode(" " + a)) for a in data.texts[1][1:]}) > 1   # the mean differs from the sum
  result = zeroshot.evaluate(m, params, tok, "choice", data, batch_size=8)
  assert result["accuracy"] == pytest.approx(np.mean(hand.argmax(1) == data.labels))
  assert (result["examples"], result["answers"]) == (3, 3)


def test_acceptability_thresholds_the_mean_log_probability(gpt, shared_data):
  m, params, tok = gpt
  config = task_config(shared_data)
  data, other = zeroshot.read(config, "acceptability", "dev[:16]"), zeroshot.read(config, "acceptability", "dev[16:32]")
  texts = [t[0] for t in data.texts + other.texts]
  got = zeroshot.sentence_logprobs(m, params, tok, texts, batch_size=8)
  seqs = [([tok.eos_id] + tok.encode(t))[:POSITIONS + 1] for t in texts]   # a long sentence loses its end
  assert max(len(tok.encode(t)) for t in texts) > POSITIONS
  hand = np.array([lp.mean() for lp in hand_logprobs(m, params, seqs)])
  np.testing.assert_allclose(got, hand, atol=1e-5, rtol=0)
  scores, other_scores = hand[:16], hand[16:]

  def mcc(s, y, t):
    return metrics.matthews_corrcoef(y, s > t)
  for s, y in ((scores, data.labels), (other_scores, other.labels)):   # the best of every possible cut
    best = zeroshot.best_threshold(s, y)
    cuts = np.concatenate([[s.min() - 1], np.sort(s), [s.max() + 1]])
    assert mcc(s, y, best) == pytest.approx(max(mcc(s, y, t) for t in cuts)) and mcc(s, y, best) > 0
  fixed = float(np.median(scores))
  at_fixed = zeroshot.evaluate(m, params, tok, "acceptability", data, threshold=fixed, batch_size=8)
  assert at_fixed["threshold"] == fixed
  assert at_fixed["accuracy"] == pytest.approx(np.mean((scores > fixed) == data.labels))
  assert at_fixed["matthews"] == pytest.approx(mcc(scores, data.labels, fixed))
  oracle = zeroshot.best_threshold(scores, data.labels)
  assert at_fixed["oracle_threshold"] == pytest.approx(oracle, abs=1e-5)
  assert at_fixed["oracle_matthews"] == pytest.approx(mcc(scores, data.labels, oracle))
  chosen = zeroshot.evaluate(m, params, tok, "acceptability", data, chosen_on=other, batch_size=8)
  threshold = zeroshot.best_threshold(other_scores, other.labels)
  assert chosen["threshold_split"] == "dev[16:32]" and chosen["threshold"] == pytest.approx(threshold, abs=1e-5)
  assert chosen["accuracy"] == pytest.approx(np.mean((scores > threshold) == data.labels))


def test_zeroshot_cli_on_an_export(gpt, shared_data, tmp_path):
  m, params, tok = gpt
  export.save_hf(m, params, str(tmp_path / "hf"), tokenizer=tok)
  config = task_config(shared_data)
  run = cli("--config=configs/gpt1.py:tiny", "--mode=zeroshot", "--zeroshot=sentiment", f"--workdir={tmp_path / 'run'}",
            f"--init_from={tmp_path / 'hf'}", f"--config.task.files={config.task.files}",
            "--config.task.text_fields=('0',)", "--config.task.label_field=1", "--config.data.eval_split=dev[:24]",
            "--config.data.seq_len=32", "--config.batch_size=8")
  assert run.returncode == 0, run.stderr[-2000:]
  result = json.loads(run.stdout.strip().splitlines()[-1])
  data = zeroshot.read(config, "sentiment", "dev[:24]")
  hand = zeroshot.sentiment_logprobs(m, params, tok, [t[0] for t in data.texts], batch_size=8)
  assert result["examples"] == 24 and result["label_words"] == ["negative", "positive"]
  assert result["accuracy"] == pytest.approx(np.mean(hand.argmax(1) == data.labels))


def test_user_errors(shared_data, tmp_path):
  def error(heuristic="sentiment", config="configs/gpt1.py:tiny", **options):
    c = config_lib.load(config, {"task.files": str(shared_data / "sst2" / "{split}.tsv"), "task.text_fields": ("0",),
                                 "task.label_field": "1", "data.eval_split": "dev"})
    with pytest.raises(ValueError) as e:
      zeroshot.run(c, str(tmp_path), heuristic, **options)
    assert "\n" not in str(e.value)
    return str(e.value)
  assert "config.model.family='bert'" in error(config="configs/bert.py:tiny")
  assert "text_fields must name the context and at least two answers" in error("choice")
  assert "for --zeroshot=acceptability" in error(threshold=-3.0)
  assert "not both" in error("acceptability", threshold=-3.0, threshold_split="train")
  assert "unknown zero-shot heuristic 'nli'" in error("nli")

"""Exact evaluation: corpus perplexity and bits from total NLL over total scored tokens, checked against an
independent computation over the same eval batches; the whole eval split on request."""
import math

import jax
import numpy as np
import pytest

from lm_jax import checkpoint_export, models, objectives, train
from lm_jax.data import pipeline
from lm_jax.evals import evaluate, run_eval
from conftest import load_config


@pytest.fixture(scope="module")
def trained(shared_data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("eval")
  config = load_config("clm", shared_data, total_steps=3, log_every=3, eval_every=0, checkpoint_every=3,
                       **{"data.eval_split": "train[90%:]", "data.eval_batches": 5})
  train.train(config, str(workdir))
  return config, workdir


def test_corpus_perplexity_is_total_nll_over_total_tokens(trained):
  config, workdir = trained
  record = run_eval.evaluate_checkpoint(config, str(workdir))
  s, params, _ = run_eval.restore_params(config, str(workdir))
  batches = list(pipeline.make_eval_iterator(config, s.tokenizer, objectives.get("clm")))
  nll, tokens = [], []
  for b in batches:   # plain numpy log-softmax over the model's logits, no lm_jax loss code
    logits = np.asarray(models.apply(config.model, jax.device_get(params), {
        k: b[k] for k in ("input_ids", "segment_ids", "positions")} | {"attention_mask": b["segment_ids"] > 0})[
            "logits"], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    scored = (b["weights"] > 0) & (b["segment_ids"] > 0)
    nll.append(-np.take_along_axis(logp, b["targets"][..., None], -1)[..., 0][scored].sum())
    tokens.append(scored.sum())
  assert len(set(tokens)) > 1, tokens          # batches score different numbers of tokens
  corpus = sum(nll) / sum(tokens)
  assert record["eval_tokens"] == sum(tokens)
  assert record["eval_perplexity"] == pytest.approx(math.exp(corpus), rel=1e-5)
  assert record["eval_bits_per_token"] == pytest.approx(corpus / math.log(2), rel=1e-5)
  mean_of_means = np.mean([n / t for n, t in zip(nll, tokens)])
  assert abs(mean_of_means - corpus) > 1e-6    # the old equal-weight average would differ
  assert 0 < record["eval_bits_per_byte"] < record["eval_bits_per_char"] * 1.01 < record["eval_bits_per_token"]


def test_whole_split_uses_every_complete_batch(trained):
  config, workdir = trained
  s, _, _ = run_eval.restore_params(config, str(workdir))
  whole = config.copy_and_resolve_references()
  whole.data.eval_batches = 0
  batches = list(pipeline.make_eval_iterator(whole, s.tokenizer, objectives.get("clm")))
  assert len(batches) > config.data.eval_batches
  more = config.copy_and_resolve_references()
  more.data.eval_batches = len(batches) + 5
  assert len(list(pipeline.make_eval_iterator(more, s.tokenizer, objectives.get("clm")))) == len(batches)


def test_summarize_weights_each_metric_by_its_own_denominator():
  batches = [({"token_loss": 1.0, "nsp_accuracy": 1.0}, {"mlm": 1.0, "nsp": 4.0}),
             ({"token_loss": 3.0, "nsp_accuracy": 0.0}, {"mlm": 3.0, "nsp": 4.0})]
  out = evaluate.summarize(batches, lambda k: {"nsp_accuracy": "nsp"}.get(k, "mlm"), {"bytes": 4.0, "chars": 2.0})
  assert out["eval_token_loss"] == pytest.approx(2.5) and out["eval_nsp_accuracy"] == pytest.approx(0.5)
  assert out["eval_bits_per_byte"] == pytest.approx(2.5 / math.log(2) / 4)
  assert out["eval_bits_per_char"] == pytest.approx(2.5 / math.log(2) / 2) and out["eval_tokens"] == 4


def test_eval_of_an_export_through_init_from_equals_the_checkpoints(trained, tmp_path):
  """--mode=eval --init_from=HF_DIR: the exported model, evaluated on our data, scores what the checkpoint did."""
  config, workdir = trained
  export_dir = str(tmp_path / "export")
  checkpoint_export.export_checkpoint(config, str(workdir), export_dir)
  ours = run_eval.evaluate_checkpoint(config, str(workdir))
  imported = config.copy_and_resolve_references()
  imported.init_from = export_dir
  imported.data.tokenizer = str(next(workdir.glob("tokenizer_*.model")))
  record = run_eval.evaluate_checkpoint(imported, str(tmp_path / "eval_run"))
  assert record["step"] == 0 and record["eval_tokens"] == ours["eval_tokens"]
  for k in ("eval_loss", "eval_perplexity", "eval_bits_per_byte", "eval_accuracy"):
    assert record[k] == pytest.approx(ours[k], rel=1e-5), k

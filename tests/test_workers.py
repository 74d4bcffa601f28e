"""data.workers (lm_jax/data/workers.py): tokenizing in 2 spawned processes gives exactly the batches, eval batches
and tallies of 1."""
import json

import pytest

from conftest import run_tokenizer, same_batches, take
from lm_jax import config_lib, objectives
from lm_jax.data import pipeline, workers

CONFIGS = {"clm": "configs/gpt1.py:tiny", "mlm": "configs/bert.py:tiny", "span_corruption": "configs/t5.py:tiny"}


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
  d = tmp_path_factory.mktemp("corpus")
  text = (shared_data / "tiny_shakespeare" / "input.txt").read_text()[:100_000]
  lines = [json.dumps({"text": t}) for t in text.split("\n\n") if t.strip()]
  lines[3] = "not json"
  (d / "train.jsonl").write_text("\n".join(lines[:-50]) + "\n")
  (d / "valid.jsonl").write_text("\n".join(lines[-50:]) + "\n")
  return d


@pytest.mark.parametrize("objective", list(CONFIGS))
def test_two_workers_give_the_batches_of_one(corpus, tmp_path, objective):
  c = config_lib.load(CONFIGS[objective])
  c.model.vocab_size = 320 + (100 if objective == "span_corruption" else 0)
  c.data.files, c.data.train_split, c.data.eval_split = str(corpus / "{split}.jsonl"), "train", "valid"
  c.data.tokenizer_type, c.data.seq_len, c.data.max_predictions_per_seq = "bpe", 64, 10
  c.data.nsp, c.batch_size = objective == "mlm", 8
  tok = run_tokenizer(c, str(tmp_path))
  objective_ = objectives.get(objective)
  one = pipeline.make_train_iterator(c, tok, objective_, window_rows=18, prefetch=0)
  reference = take(one, 12)
  c.data.workers = 2
  two = pipeline.make_train_iterator(c, tok, objective_, window_rows=18, prefetch=0)
  same_batches(take(two, 12), reference)
  assert any(key[2] == 2 for key in workers._POOLS)             # the documents did go to the worker processes
  assert two.stats == one.stats                                  # counted as they are used, as with one
  c.data.workers = 1
  ev1 = pipeline.make_eval_iterator(c, tok, objective_)
  c.data.workers = 2
  ev2 = pipeline.make_eval_iterator(c, tok, objective_)
  same_batches(list(ev2), list(ev1))
  assert ev2.text_per_token == ev1.text_per_token

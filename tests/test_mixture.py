"""Data mixtures (config.data.mixture): Tiny Shakespeare and WikiText-2 sampled by weight into one stream, the same on
1, 2 and 4 hosts, resumed exactly (from an iterator state and through the trainer's checkpoints), with per-source eval
records; a bad mixture is one line naming the field."""
import json
import shutil

import numpy as np
import pytest

from lm_jax import checkpoint, checks, config_lib, objectives, train
from lm_jax.data import mixture, pipeline, sources
from conftest import load_config, records, run_tokenizer, same_batches, take

CONFIGS = {"clm": "configs/gpt1.py:tiny", "mlm": "configs/bert.py:tiny", "span_corruption": "configs/t5.py:tiny"}
WEIGHTS = (3.0, 1.0)


def _mixture(data, *, train_slices=("90%", ""), weights=WEIGHTS):
  """Shakespeare (90% train, 10% eval of one file) and WikiText-2 (its train / valid files)."""
  return (dict(name="shakespeare", files=str(data / "tiny_shakespeare" / "input.txt"),
               train_split=f"train[:{train_slices[0]}]", eval_split="train[90%:]", weight=weights[0]),
          dict(name="wiki", files=str(data / "wikitext-2-raw" / "wiki.{split}.raw"),
               train_split=f"train[:{train_slices[1]}]" if train_slices[1] else "train",
               eval_split="valid", weight=weights[1]))


def _config(objective, data, *, shards=1, nsp=False, **mix):
  c = config_lib.load(CONFIGS[objective])
  c.model.vocab_size = 320 + (100 if objective == "span_corruption" else 0)
  c.data.tokenizer_type = "bpe"
  c.data.seq_len, c.data.max_predictions_per_seq, c.data.nsp = 64, 10, nsp
  c.data.shards, c.batch_size = shards, 8
  c.data.mixture = _mixture(data, **mix)
  return c


@pytest.fixture(scope="module")
def toks(shared_data, tmp_path_factory):
  """A BPE tokenizer per family, trained on the mixture's text (each source's share by weight)."""
  work = tmp_path_factory.mktemp("tok")
  return {o: run_tokenizer(_config(o, shared_data), str(work)) for o in CONFIGS}


def _train_it(c, tok, **kw):
  return pipeline.make_train_iterator(c, tok, objectives.get(c.objective), window_rows=18, **kw)


def test_tokenizer_text_takes_each_source_by_weight(shared_data):
  lines = sources.training_text(_config("clm", shared_data), 40_000)
  wiki = sum(len(line) for line in lines if line.startswith(" "))   # every WikiText line starts with a space
  assert wiki / sum(map(len, lines)) == pytest.approx(0.25, abs=0.01)


def test_two_sources_give_their_weights_in_their_own_order(shared_data, toks):
  """Over 150 batches the rows split 3:1 within sampling error; the rows drawn from a source are, in order, the rows a
  mixture of that source alone gives."""
  c = _config("clm", shared_data)
  it = _train_it(c, toks["clm"], prefetch=0)
  batches = take(it, 150)
  rows = it.get_state()["shards"]["0"]["rows"]
  n = 150 * c.batch_size
  assert rows["shakespeare"] + rows["wiki"] == n
  assert abs(rows["shakespeare"] / n - 0.75) < 4 * np.sqrt(0.75 * 0.25 / n)     # 4 standard errors
  p = mixture.weights(mixture.sources(c))
  which = np.concatenate([mixture.draw(p, c.batch_size, seed=c.seed, shard=0, batch_index=b) for b in range(150)])
  mixed = np.concatenate([b["input_ids"] for b in batches])
  for j, name in enumerate(("shakespeare", "wiki")):
    alone = _config("clm", shared_data)
    alone.data.mixture = (c.data.mixture[j],)
    own = _train_it(alone, toks["clm"], prefetch=0)
    expected = np.concatenate([b["input_ids"] for b in take(own, -(-rows[name] // c.batch_size))])
    np.testing.assert_array_equal(mixed[which == j], expected[:rows[name]])


CASES = [("clm", False, 4), ("mlm", True, 2), ("span_corruption", False, 2)]


@pytest.mark.parametrize("objective,nsp,shards", CASES)
def test_the_same_stream_on_1_2_and_4_hosts(shared_data, toks, objective, nsp, shards):
  """Hosts' slices of each global batch, concatenated, are the 1-host batches; the state of 4 hosts, merged as
  checkpoint.data_state merges it, continues the stream on 1 host and on 2."""
  c = _config(objective, shared_data, shards=shards, nsp=nsp)
  tok = toks[objective]
  one = take(_train_it(c, tok, prefetch=0), 6)
  for hosts in (2, 4):
    parts = [take(_train_it(c, tok, process_index=h, process_count=hosts, prefetch=0), 6) for h in range(hosts)]
    same_batches([{k: np.concatenate([p[b][k] for p in parts]) for k in one[b]} for b in range(6)], one)
  its = [_train_it(c, tok, process_index=h, process_count=4, prefetch=0) for h in range(4)]
  merged = {"batch_index": 3, "shards": {}}
  for it in its:
    take(it, 3)
    merged["shards"].update(it.get_state()["shards"])
  assert set(merged["shards"]) == {str(k) for k in range(shards)}
  for hosts in (1, 2):
    resumed = [_train_it(c, tok, process_index=h, process_count=hosts, prefetch=0) for h in range(hosts)]
    for it in resumed:
      it.set_state(json.loads(json.dumps(merged)))
    parts = [take(it, 3) for it in resumed]
    same_batches([{k: np.concatenate([p[b][k] for p in parts]) for k in one[b]} for b in range(3)], one[3:])


def test_exact_resume_across_epochs(shared_data, toks):
  """A state taken mid-window (prefetching) resumes the exact stream, also past the sources' epoch ends."""
  c = _config("mlm", shared_data, nsp=True, train_slices=("40", "8"))   # a few documents: epochs end soon
  reference = take(_train_it(c, toks["mlm"], prefetch=0), 30)
  first = _train_it(c, toks["mlm"], prefetch=2)
  take(first, 5)
  state = json.loads(json.dumps(first.get_state()))
  resumed = _train_it(c, toks["mlm"], prefetch=2)
  resumed.set_state(state)
  same_batches(take(resumed, 25), reference[5:])
  epochs = {name: s["epoch"] for name, s in resumed.get_state()["shards"]["0"]["sources"].items()}
  assert min(epochs.values()) >= 1, epochs
  first.close()
  resumed.close()


def test_data_changes_name_the_source_field(shared_data):
  c = _config("clm", shared_data)
  saved = checkpoint._plain(c)
  other = _config("clm", shared_data)
  other.data.mixture = tuple(dict(s, eval_split="train[95%:]") for s in c.data.mixture)   # eval only: same stream
  assert checkpoint.data_changes(saved, other) == []
  other.data.mixture = _mixture(shared_data, weights=(1.0, 1.0))
  assert checkpoint.data_changes(saved, other) == ["data.mixture[0].weight: 3.0 -> 1.0"]


@pytest.fixture(scope="module")
def runs(shared_data, tmp_path_factory):
  """A tiny GPT-1 run on the mixture to step 4 (checkpoints at 2 and 4, eval at 4), and its copy resumed from step 2."""
  root = tmp_path_factory.mktemp("runs")
  config = load_config("clm", shared_data, **{
      "data.files": "", "data.mixture": _mixture(shared_data), "total_steps": 4, "log_every": 1, "eval_every": 4,
      "checkpoint_every": 2, "data.eval_batches": 1})
  train.train(config, str(root / "whole"))
  shutil.copytree(root / "whole", root / "resumed")
  shutil.rmtree(root / "resumed" / "checkpoints" / "4")
  train.train(config, str(root / "resumed"))
  return root


def test_trainer_resumes_the_mixture_exactly(runs):
  whole, resumed = records(runs / "whole"), records(runs / "resumed")
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole], rel=1e-6)
  whole_eval, resumed_eval = records(runs / "whole", "eval"), records(runs / "resumed", "eval")
  assert [sorted(r) for r in resumed_eval] == [sorted(r) for r in whole_eval] and whole_eval
  for a, b in zip(resumed_eval, whole_eval):   # approx compares flat records only (pytest >= 9)
    assert a == pytest.approx(b, rel=1e-6)


def test_eval_records_hold_every_source(runs):
  (record,) = records(runs / "whole", "eval")
  for name in ("shakespeare", "wiki"):
    assert record[f"eval_{name}_perplexity"] == pytest.approx(np.exp(record[f"eval_{name}_token_loss"]))
    assert record[f"eval_{name}_loss"] > 0 and record[f"eval_{name}_bits_per_byte"] > 0
  per_source = sorted(record[f"eval_{name}_token_loss"] for name in ("shakespeare", "wiki"))
  assert per_source[0] <= record["eval_token_loss"] <= per_source[1]   # both sources' eval batches together


BAD = [  # (what the mixture's source 1 gets, message fragment)
    (dict(weight=0), "config.data.mixture[1].weight must be a finite number > 0, got 0"),
    (dict(weight=-1.0), "config.data.mixture[1].weight must be a finite number > 0, got -1.0"),
    (dict(weight=float("nan")), "config.data.mixture[1].weight must be a finite number > 0, got nan"),
    (dict(wieght=1.0), "config.data.mixture[1].wieght is not a source field"),
    (dict(files=""), "config.data.mixture[1] (wiki): set one of files (a glob) or tfds_name"),
    (dict(name="shakespeare"), "source name 'shakespeare' is used twice"),
    (dict(name="wiki-2"), "config.data.mixture[1].name='wiki-2' must be letters, digits and _"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[next(iter(b[0])) + "=" + str(next(iter(b[0].values())))
                                                      for b in BAD])
def test_bad_mixture_is_one_line_naming_the_field(shared_data, change, message):
  c = _config("clm", shared_data)
  first, second = c.data.mixture
  c.data.mixture = (first, {**second, **change})
  with pytest.raises(config_lib.ConfigError) as info:
    checks.validate(c, num_devices=1)
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("change,error,message", [
    (dict(files="/nonexistent/*.txt"), FileNotFoundError, "config.data.mixture[1].files: no files match"),
    (dict(files="", tfds_name="no_such_dataset"), ValueError,
     "config.data.mixture[1].tfds_name: unknown TFDS dataset 'no_such_dataset'"),
])
def test_missing_source_is_one_line_before_compiling(shared_data, tmp_path, monkeypatch, change, error, message):
  def compiled(*args, **kwargs):
    raise AssertionError("reached the compile step")
  monkeypatch.setattr(train.step, "fresh_state", compiled)
  first, second = _mixture(shared_data)
  config = load_config("clm", shared_data, **{"data.files": "", "data.mixture": (first, {**second, **change})})
  with pytest.raises(error) as info:
    train.train(config, str(tmp_path))
  assert message in str(info.value) and "\n" not in str(info.value)


def test_mixture_from_the_command_line_and_beside_files(shared_data):
  first, second = _mixture(shared_data)
  c = config_lib.load(CONFIGS["clm"], [f"--config.data.mixture=({first!r}, {second!r})"])
  assert [s.name for s in mixture.sources(c)] == ["shakespeare", "wiki"]
  c.data.files = "x.txt"
  with pytest.raises(config_lib.ConfigError, match=r"config.data.mixture and config.data.files are both set"):
    checks.validate(c, num_devices=1)

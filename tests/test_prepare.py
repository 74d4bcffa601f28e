"""Prepared input (lm_jax/data/prepare.py, prepared.py): shards are byte-identical for 1 and 2 preparing processes,
training on prepared tokens gives the on-the-fly batches (same seed), prepared MLM + NSP rows give the on-the-fly
pairs with masks of their own; both resume exactly and give the same global stream on 1 and 2 hosts; a prepared
folder that does not match the config is one line."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_tokenizer, same_batches, take
from lm_jax import config_lib, models, objectives
from lm_jax.data import pipeline, prepare
from lm_jax.data import rows as rows_lib

CONFIGS = {"clm": "configs/gpt1.py:tiny", "mlm": "configs/bert.py:tiny", "span_corruption": "configs/t5.py:tiny"}


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
  """~1000 Tiny Shakespeare documents as train / valid .jsonl, with a bad line and an empty text."""
  d = tmp_path_factory.mktemp("corpus")
  text = (shared_data / "tiny_shakespeare" / "input.txt").read_text()[:120_000]
  docs = [t for t in text.split("\n\n") if t.strip()]
  lines = [json.dumps({"text": t}) for t in docs]
  lines[5], lines[9] = "not json", json.dumps({"text": ""})
  (d / "train.jsonl").write_text("\n".join(lines[:-60]) + "\n")
  (d / "valid.jsonl").write_text("\n".join(lines[-60:]) + "\n")
  return d


def _config(objective, corpus, **data):
  c = config_lib.load(CONFIGS[objective])
  c.model.vocab_size = 320 + (100 if objective == "span_corruption" else 0)
  c.data.files, c.data.train_split, c.data.eval_split = str(corpus / "{split}.jsonl"), "train", "valid"
  c.data.tokenizer_type, c.data.seq_len, c.data.max_predictions_per_seq = "bpe", 64, 10
  c.data.nsp = objective == "mlm"
  c.batch_size = 8
  for k, v in data.items():
    setattr(c.data, k, v)
  return c


def _prepare(c, out, work, **kw) -> dict:
  return prepare.prepare(c, objectives.get(c.objective), models.family(c.model), str(out), workdir=str(work), **kw)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
  """Per objective: (config, tokenizer, work folder) with work/p1 prepared (tokens only); MLM + NSP also
  work/rows: 2 passes of rows for data.shards=2."""
  out = {}
  for objective in CONFIGS:
    work = tmp_path_factory.mktemp(objective)
    c = _config(objective, corpus)
    manifest = _prepare(c, work / "p1", work, docs_per_shard=300, passes=0)
    assert len(manifest["splits"]["train"]["shards"]) >= 3 and manifest["passes"] == 0
    out[objective] = (c, run_tokenizer(c, str(work)), work)
  c, _, work = out["mlm"]
  manifest = _prepare(_config("mlm", corpus, shards=2), work / "rows", work, docs_per_shard=300, passes=2)
  assert manifest["passes"] == 2 and len(manifest["splits"]["train"]["rows"]["train"]["shards"]) >= 6
  return out


def _it(c, tok, **kw):
  return pipeline.make_train_iterator(c, tok, objectives.get(c.objective), **kw)


def test_shards_and_rows_are_the_same_bytes_for_1_and_2_processes(prepared, corpus):
  _, _, work = prepared["mlm"]
  _prepare(_config("mlm", corpus, shards=2), work / "p2", work, processes=2, docs_per_shard=300, passes=2)
  one, two = sorted((work / "rows").rglob("*")), sorted((work / "p2").rglob("*"))
  assert [p.relative_to(work / "rows") for p in one] == [p.relative_to(work / "p2") for p in two]
  assert sum(p.name.startswith("rows-train-p001") for p in one) >= 3
  for a, b in zip(one, two):
    assert a.is_dir() or a.read_bytes() == b.read_bytes(), a


@pytest.mark.parametrize("objective", list(CONFIGS))
def test_prepared_training_is_the_on_the_fly_training_batch_for_batch(prepared, objective):
  c, tok, work = prepared[objective]
  fly = _it(c, tok, window_rows=18, prefetch=0)
  reference = take(fly, 10)
  p = _config(objective, work.parent, prepared=str(work / "p1"))
  p.data.files = c.data.files
  it = _it(p, tok, window_rows=18, prefetch=0)
  same_batches(take(it, 10), reference)
  assert it.stats == fly.stats and it.stats["documents"] > 0
  ev, ev_p = (pipeline.make_eval_iterator(x, tok, objectives.get(objective)) for x in (c, p))
  same_batches(list(ev_p), list(ev))
  assert ev_p.text_per_token == ev.text_per_token


def _unmasked(batch):
  """A masked batch's input_ids with the predicted tokens put back: the rows before masking."""
  ids = batch["input_ids"].copy()
  rows, cols = np.nonzero(batch["mlm_weights"])
  ids[rows, batch["mlm_positions"][rows, cols]] = batch["mlm_ids"][rows, cols]
  return ids


def test_prepared_rows_are_the_on_the_fly_pairs_masked_per_document(prepared, corpus):
  c, tok, work = prepared["mlm"]
  fly_c = _config("mlm", corpus, shards=2)
  rows_c = _config("mlm", corpus, shards=2, prepared=str(work / "rows"))
  fly, ready = (take(_it(x, tok, window_rows=18, prefetch=0), 12) for x in (fly_c, rows_c))
  for a, b in zip(fly, ready):
    for k in ("token_type_ids", "attention_mask", "nsp_labels"):
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    np.testing.assert_array_equal(_unmasked(a), _unmasked(b))
  masked = np.concatenate([(b["input_ids"] != _unmasked(b))[b["attention_mask"] > 0] for b in ready])
  predicted = np.concatenate([b["mlm_weights"].sum(1) for b in ready])
  assert 0.09 < masked.mean() < 0.16 and predicted.max() <= 10 and predicted.mean() > 5   # 15% (12% changed)
  assert not all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(fly, ready))   # other masks
  # epoch 1 has the pairs of on-the-fly epoch 1; epoch 2 reads pass 0 again
  layout = objectives.get("mlm").rows(fly_c, tok)
  corpus_ = pipeline._corpus(rows_c, "train", layout, tok)
  fly_rows = pipeline._corpus(fly_c, "train", layout, tok)
  shard = rows_lib.ShardRows(layout, fly_rows, pipeline.shard_order(len(fly_rows), seed=fly_c.seed, shuffle=True,
                                                                   shard=1, shards=2), seed=fly_c.seed, shard=1)
  docs = [d for d in range(1, 200, 2) if corpus_.instances(1, d)][:20]
  assert len(docs) == 20
  for d in docs:
    made, pairs = corpus_.instances(1, d), layout.assemble(shard.doc_instances(1, d))
    np.testing.assert_array_equal(_unmasked({k: np.stack([r[k] for r in made]) for k in made[0]}),
                                  pairs["input_ids"])
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(made, corpus_.instances(3, d)))
  assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for d in docs
             for x, y in zip(corpus_.instances(0, d), corpus_.instances(1, d)))
  ev, ev_p = (pipeline.make_eval_iterator(x, tok, objectives.get("mlm")) for x in (fly_c, rows_c))
  assert len(ev) == len(ev_p)
  for a, b in zip(ev, ev_p):
    np.testing.assert_array_equal(_unmasked(a), _unmasked(b))
    np.testing.assert_array_equal(a["nsp_labels"], b["nsp_labels"])


@pytest.mark.parametrize("objective,folder", [("mlm", "p1"), ("clm", "p1"), ("mlm", "rows")])
def test_prepared_resumes_exactly_and_is_the_same_stream_on_1_and_2_hosts(prepared, objective, folder):
  c, tok, work = prepared[objective]
  c = _config(objective, work.parent, prepared=str(work / folder), shards=2)
  c.data.files = prepared[objective][0].data.files
  one = take(_it(c, tok, window_rows=18, prefetch=0), 8)
  hosts = [_it(c, tok, process_index=h, process_count=2, window_rows=18, prefetch=0) for h in (0, 1)]
  parts = [take(it, 4) for it in hosts]
  same_batches([{k: np.concatenate([p[b][k] for p in parts]) for k in one[b]} for b in range(4)], one[:4])
  merged = {"batch_index": 4, "shards": {}}
  for it in hosts:
    merged["shards"].update(it.get_state()["shards"])
  resumed = _it(c, tok, window_rows=18, prefetch=0)
  resumed.set_state(json.loads(json.dumps(merged)))
  same_batches(take(resumed, 4), one[4:])


def test_prepared_bad_records_are_told_as_on_the_fly(prepared):
  c, tok, work = prepared["mlm"]
  p = _config("mlm", work.parent, prepared=str(work / "p1"))
  p.data.files = c.data.files
  layout = objectives.get("mlm").rows(c, tok)
  fly, ready = pipeline._corpus(c, "train", layout, tok), pipeline._corpus(p, "train", layout, tok)
  for corpus in (fly, ready):
    for start in range(0, len(corpus), 100):
      corpus.tokens(list(range(start, min(start + 100, len(corpus)))))
  assert ready.tally.report() == fly.tally.report() and ":6: not JSON" in ready.tally.report()
  assert ready.stats == fly.stats and ready.stats["malformed"] == ready.stats["empty"] == 1
  assert (ready.bytes, ready.chars, ready.tokens_count) == (fly.bytes, fly.chars, fly.tokens_count)


def test_a_mismatched_prepared_folder_is_one_line(prepared, corpus, tmp_path):
  c, tok, work = prepared["mlm"]
  p = _config("mlm", corpus, prepared=str(work / "p1"), seq_len=128)
  with pytest.raises(config_lib.ConfigError, match=r"^config.data.prepared=.* was prepared for seq_len=64, this "
                     r"config has 128: prepare it again for this config$"):
    _it(p, tok, prefetch=0)
  p = _config("mlm", corpus, prepared=str(work / "p1"), mlm_probability=0.2)
  with pytest.raises(config_lib.ConfigError, match=r"prepared for masking="):
    _it(p, tok, prefetch=0)
  p = _config("mlm", corpus, prepared=str(tmp_path))
  with pytest.raises(config_lib.ConfigError, match=r"no manifest.json there"):
    _it(p, tok, prefetch=0)
  p = _config("mlm", corpus, prepared=str(work / "rows"), shards=2)
  p.seed += 1
  with pytest.raises(config_lib.ConfigError, match=r"prepared for rows=\{'seed': 0, 'shards': 2, 'shuffle': True\}, "
                     r"this config has \{'seed': 1, "):
    _it(p, tok, prefetch=0)
  p = _config("mlm", corpus, prepared=str(work / "rows"))
  with pytest.raises(config_lib.ConfigError, match=r"'shards': 2, .* this config has \{'seed': 0, 'shards': 1,"):
    _it(p, tok, prefetch=0)
  other = _config("clm", corpus, prepared=str(work / "p1"))
  with pytest.raises(config_lib.ConfigError, match=r"prepared for tokenizer="):
    _it(other, prepared["clm"][1], prefetch=0)
  remote = _config("mlm", corpus, prepared="gs://bucket/prepared")
  with pytest.raises(config_lib.ConfigError, match=r"^config.data.prepared=gs://bucket/prepared: prepared shards are "
                     r"read by index from a local path; mount the bucket \(gcsfuse\) or copy"):
    _it(remote, tok, prefetch=0)
  with pytest.raises(config_lib.ConfigError, match=r"^--out=gs://bucket/p: prepared shards are read by index"):
    prepare.prepare(_config("mlm", corpus), objectives.get("mlm"), models.family(c.model), "gs://bucket/p")


def test_the_command_line(prepared, tmp_path):
  c, _, work = prepared["clm"]
  cmd = [sys.executable, "-m", "lm_jax.prepare", f"--config={CONFIGS['clm']}", f"--out={tmp_path / 'p'}",
         f"--workdir={work}", f"--config.data.files={c.data.files}", "--config.data.train_split=train",
         "--config.data.eval_split=valid", "--config.model.vocab_size=320", "--config.data.tokenizer_type=bpe",
         "--config.data.seq_len=64", "--docs_per_shard=300"]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  assert done.returncode == 0, done.stderr
  assert "train: " in done.stdout and (tmp_path / "p" / "manifest.json").exists()
  for a in sorted((work / "p1").rglob("*.array_record")):
    assert a.read_bytes() == (tmp_path / "p" / a.relative_to(work / "p1")).read_bytes()
  bad = subprocess.run(cmd + ["--config.data.prepared=/elsewhere"], capture_output=True, text=True, check=False)
  assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "prepare reads the corpus" in bad.stderr


@pytest.mark.parametrize("objective,passes", [("clm", 0), ("mlm", 1)])
def test_a_prepared_mixture_trains_as_on_the_fly(prepared, corpus, objective, passes):
  """Each source prepared in its folder; tokens give the on-the-fly batches, MLM + NSP rows its pairs."""
  c, tok, work = prepared[objective]
  mix = _config(objective, corpus)
  mix.data.files = ""
  mix.data.mixture = (dict(name="a", files=c.data.files, weight=1.0),
                      dict(name="b", files=c.data.files, train_split="train[:50%]", weight=2.0))
  out = work / f"mixture{passes}"
  manifest = _prepare(mix, out, work, docs_per_shard=300, passes=passes)
  assert list(manifest["sources"]) == ["a", "b"] and (out / "b" / "manifest.json").exists()
  ready = _config(objective, corpus, prepared=str(out))
  ready.data.files, ready.data.mixture = "", mix.data.mixture
  fly, it = (take(_it(x, tok, window_rows=18, prefetch=0), 6) for x in (mix, ready))
  if passes:
    fly, it = ([dict(b, input_ids=_unmasked(b), mlm_positions=0, mlm_ids=0, mlm_weights=0) for b in x]
               for x in (fly, it))
  same_batches(it, fly)
  ev, ev_p = (pipeline.make_eval_iterator(x, tok, objectives.get(objective)) for x in (mix, ready))
  assert ev_p.sources.keys() == ev.sources.keys() == {"a", "b"} and len(ev_p) == len(ev)
  single = _config(objective, corpus, prepared=str(out))
  single.data.files = c.data.files
  with pytest.raises(config_lib.ConfigError, match=r"holds the sources of a mixture \(a, b\); this config has no "):
    _it(single, tok, prefetch=0)
  ready.data.prepared = str(work / "p1")
  with pytest.raises(config_lib.ConfigError, match=r"holds one source, this config has a config.data.mixture"):
    _it(ready, tok, prefetch=0)

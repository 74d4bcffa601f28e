"""Input pipeline: sources (files, TFDS offline), bad records, packing, NSP pairs, determinism, resumption,
host sharding, eval batches."""
import json
import types

import numpy as np
import pytest
import tensorflow_datasets as tfds

from conftest import run_tokenizer, same_batches, take
from lm_jax import config_lib, objectives
from lm_jax.data import masking, nsp, packing, pipeline, records, sources, tfds_prepare

CONFIGS = {"clm": "configs/gpt1.py:tiny", "mlm": "configs/bert.py:tiny", "span_corruption": "configs/t5.py:tiny"}


@pytest.fixture(scope="module")
def text(shared_data):
  return (shared_data / "tiny_shakespeare" / "input.txt").read_text()


@pytest.fixture(scope="module")
def files(text, tmp_path_factory):
  """Small .txt corpora cut from Tiny Shakespeare: 'big' (~60 KB), 'small' and 'tiny' (a few batches)."""
  d = tmp_path_factory.mktemp("corpus")
  (d / "big.txt").write_text(text[:60_000])
  (d / "small.txt").write_text(text[:8_000])
  (d / "tiny.txt").write_text(text[:3_000])
  return d


def _config(objective, path, *, nsp_=False, vocab=320, seq_len=64, batch=8, **data):
  c = config_lib.load(CONFIGS[objective])
  c.model.vocab_size = vocab + (100 if objective == "span_corruption" else 0)
  c.data.files = str(path)
  c.data.tokenizer_type = "bpe"
  c.data.seq_len = seq_len
  c.data.max_predictions_per_seq = 10
  c.data.nsp = nsp_
  c.batch_size = batch
  for k, v in data.items():
    setattr(c.data, k, v)
  return c


@pytest.fixture(scope="module")
def toks(files, tmp_path_factory):
  """A BPE tokenizer per family, trained on the big corpus."""
  work = tmp_path_factory.mktemp("tok")
  return {o: run_tokenizer(_config(o, files / "big.txt"), str(work)) for o in CONFIGS}


def _train_it(c, tok, **kw):
  return pipeline.make_train_iterator(c, tok, objectives.get(c.objective), **kw)


def _eval_it(c, tok, **kw):
  return pipeline.make_eval_iterator(c, tok, objectives.get(c.objective), **kw)


# ------------------------------------------------------------------------------------------------ sources

def test_file_types_and_bad_records_are_counted(tmp_path, toks):
  (tmp_path / "a.txt").write_bytes(b"First doc line one\nline two\n\n \n\nSecond doc here\n\n\xff\xfe broken\n"
                                   b"\n\n\xff\xfe")
  (tmp_path / "b.jsonl").write_bytes(b'{"text": "a json document"}\nnot json\n{"other": 1}\n{"text": ""}\n'
                                     b'{"text": "\xff bad"}\n{"text": "a"}\n')
  (tmp_path / "c.tsv").write_text("a tab separated sentence\t1\nanother one\t0\n")
  (tmp_path / "d.tsv").write_text("label\ttext\n1\theader names the text column\n")
  docs = sources.documents(_config("clm", tmp_path / "*"), "train[:]")   # every record, none held out for eval
  assert [d if isinstance(d, str) else d.reason for d in docs] == [
      "First doc line one\nline two", "Second doc here", "\ufffd\ufffd broken", "undecodable",
      "a json document", "malformed", "malformed", "", "\ufffd bad", "a",
      "a tab separated sentence", "another one", "header names the text column"]
  it = _train_it(_config("clm", tmp_path / "*", shuffle=False, train_split="train[:]"), toks["clm"], prefetch=0)
  next(it)   # one epoch is smaller than a batch: the iterator wraps around, never crashes
  assert it.stats == dict(documents=13, empty=1, undecodable=1, malformed=2, too_short=1, dropped_tokens=0,
                          replaced_documents=2, replaced_bytes=3)


def test_missing_empty_and_unsupported_sources_are_named(tmp_path, toks):
  with pytest.raises(FileNotFoundError, match="no files match .*nothing-here"):
    sources.documents(_config("clm", tmp_path / "nothing-here*.txt"), "train")
  (tmp_path / "bad.jsonl").write_text("oops\n{}\n")
  it = _train_it(_config("clm", tmp_path / "bad.jsonl", train_split="train[:]"), toks["clm"], prefetch=0)
  with pytest.raises(ValueError, match="no usable documents in .*bad.jsonl.*'malformed': 2"):
    next(it)
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="x.csv: unsupported type"):
    sources.documents(_config("clm", tmp_path / "x.csv"), "train")
  with pytest.raises(ValueError, match="bad split"):
    records.split_spec("train[:5%")


def test_split_placeholder_and_slices(tmp_path):
  for split, n in (("train", 10), ("valid", 3)):
    (tmp_path / f"part.{split}.txt").write_text("\n\n".join(f"{split} doc {i}" for i in range(n)))
  c = _config("clm", tmp_path / "part.{split}.txt")
  assert len(sources.documents(c, "train")) == 10 and sources.documents(c, "valid")[2] == "valid doc 2"
  head, tail = sources.documents(c, "train[:30%]"), sources.documents(c, "train[30%:]")
  assert [head[i] for i in range(len(head))] + [tail[i] for i in range(len(tail))] == \
      [f"train doc {i}" for i in range(10)]
  assert len(head) == 3 and sources.documents(c, "train[-2:]")[0] == "train doc 8"


def test_tfds_tiny_shakespeare_offline_through_the_trainer_path(shared_data, tmp_path, text, toks):
  """Build the catalog tiny_shakespeare (array_record, no TensorFlow) from the local input.txt, then read it
  with the same calls the trainer makes."""
  tfds_prepare.prepare_tfds("tiny_shakespeare", str(tmp_path), manual_dir=str(shared_data / "tiny_shakespeare"))
  c = config_lib.load("configs/gpt1.py:tiny")
  c.data.tfds_data_dir = str(tmp_path)
  c.data.seq_len, c.batch_size, c.model.vocab_size = 64, 8, 320
  splits = {s: sources.documents(c, s) for s in ("train", "validation", "test")}
  assert splits["train"][0] == "First Citizen:\nBefore we proceed any further, hear me speak."
  assert len(splits["train"]) > 5000                           # one record per split, cut at blank lines
  joined = "".join("".join(d[i].split()) for d in splits.values() for i in range(len(d)))
  assert joined == "".join(text.split())                       # nothing lost or duplicated
  batch = next(_train_it(c, toks["clm"], prefetch=0))
  assert batch["input_ids"].shape == (8, 64) and batch["weights"].sum() > 0
  evals = _eval_it(c, toks["clm"])
  assert len(evals) == c.data.eval_batches and 1.5 < evals.text_per_token["bytes"] < 4


class ToyDocs(tfds.core.GeneratorBasedBuilder):
  """40 one-line documents, record 7 not UTF-8: the random-access (many records) TFDS path."""
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i in range(40):
      yield i, {"text": b"\xff\xfe" if i == 7 else f"Document number {i}. It has a second sentence."}


def test_tfds_random_access_records_built_on_first_use(tmp_path, toks, monkeypatch):
  monkeypatch.setattr(records, "_FEW_RECORDS", 10)       # 40 records count as many: read one by one
  c = _config("clm", "", tfds_name="toy_docs", tfds_data_dir=str(tmp_path), shuffle=False)
  docs = sources.documents(c, "train")                     # not prepared yet: built as array_record now
  assert isinstance(docs, records.TfdsRecords) and len(docs) == 40
  assert len(sources.documents(c, "train[:25%]")) == 10
  texts = [docs[i] for i in range(40)]
  assert texts.count(records.Bad("undecodable")) == 1 and "Document number 3. It has a second sentence." in texts
  it = _train_it(c, toks["clm"], prefetch=0)
  next(it)
  assert it.stats["undecodable"] == 1 and it.stats["documents"] == 40
  with pytest.raises(ValueError, match="config.data.text_field='body' is not a feature of TFDS toy_docs"):
    sources.documents(_config("clm", "", tfds_name="toy_docs", tfds_data_dir=str(tmp_path), text_field="body"),
                      "train")
  with pytest.raises(ValueError, match="has no split 'validation'; it has train"):
    sources.documents(c, "validation")


@pytest.mark.skipif(tfds_prepare.have_tensorflow(), reason="TensorFlow is installed")
def test_tfrecord_without_tensorflow_says_so():
  with pytest.raises(ImportError, match="prepared as tfrecord, which needs TensorFlow"):
    tfds_prepare.tfdata_records(types.SimpleNamespace(data_dir="/data/x"), "train", "x")


# ---------------------------------------------------------------------------------------------- batches

CASES = [("clm", False), ("mlm", False), ("mlm", True), ("span_corruption", False)]


@pytest.mark.parametrize("objective,with_nsp", CASES)
def test_batches_have_exactly_the_objective_features(files, toks, objective, with_nsp):
  c = _config(objective, files / "big.txt", nsp_=with_nsp, whole_word_mask=objective == "mlm")
  batch = next(_train_it(c, toks[objective], prefetch=0))
  want = objectives.get(objective).features(c)
  assert {k: (v.shape[1:], v.dtype) for k, v in batch.items()} == {k: (s, np.dtype(t)) for k, (s, t) in want.items()}
  assert all(v.shape[0] == 8 for v in batch.values())
  if objective == "mlm":   # whole words: a selected continuation piece follows a selected piece
    sel = np.zeros(batch["input_ids"].shape, bool)
    np.put_along_axis(sel, batch["mlm_positions"], batch["mlm_weights"] > 0, 1)
    orig = batch["input_ids"].copy()
    np.put_along_axis(orig, batch["mlm_positions"], np.where(batch["mlm_weights"] > 0, batch["mlm_ids"],
                                                             np.take_along_axis(orig, batch["mlm_positions"], 1)), 1)
    special = np.isin(orig, toks["mlm"].special_ids)
    cont = sel & ~toks["mlm"].word_starts(orig) & ~np.roll(special, 1, 1)
    assert cont.any() and (np.roll(sel, 1, 1) | ~cont).all()
  if objective == "span_corruption":
    assert (batch["input_ids"][:, -1] == toks[objective].eos_id).all()
    assert (batch["decoder_input_ids"][:, 1:] == batch["decoder_target_ids"][:, :-1]).all()


@pytest.mark.parametrize("objective,with_nsp", CASES)
def test_same_seed_same_batches_and_resume_mid_epoch(files, toks, objective, with_nsp):
  c = _config(objective, files / ("tiny.txt" if with_nsp else "small.txt"), nsp_=with_nsp)
  make = lambda **kw: _train_it(c, toks[objective], window_rows=18, **kw)
  reference = take(make(prefetch=0), 12)
  same_batches(take(make(prefetch=3), 12), reference)           # prefetch thread changes nothing
  first = make(prefetch=2)
  take(first, 5)
  state = json.loads(json.dumps(first.get_state()))
  assert state["shards"]["0"]["window"] > 0 and state["shards"]["0"]["row"] > 0   # mid-window (18 rows, batches of 8)
  resumed = make(prefetch=2)
  resumed.set_state(state)
  after = take(resumed, 7)
  same_batches(after, reference[5:])
  assert resumed.get_state()["shards"]["0"]["epoch"] >= 1                    # the check crossed an epoch boundary
  c.seed = 1
  assert not np.array_equal(next(make(prefetch=0))["input_ids"], reference[0]["input_ids"])


def test_state_without_this_hosts_shards_is_refused(files, toks):
  c = _config("clm", files / "small.txt", shards=2)
  it = _train_it(c, toks["clm"], process_index=1, process_count=2, prefetch=0)
  state = _train_it(c, toks["clm"], process_index=0, process_count=2, prefetch=0).get_state()
  with pytest.raises(ValueError, match=r"no position for data shard\(s\) 1"):
    it.set_state(state)


def test_shards_are_disjoint_and_cover_the_documents(files, toks):
  n = len(sources.documents(_config("clm", files / "small.txt"), "train"))
  for shuffle in (False, True):
    orders = [pipeline.shard_order(n, seed=0, shuffle=shuffle, shard=k, shards=2) for k in (0, 1)]
    for epoch in (0, 1):
      shards = [{o[epoch * len(o) + i] for i in range(len(o))} for o in orders]
      assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(n))
  # What a shard emits in its first epoch: exactly its documents, each followed by eos, in order (row k of
  # every global batch of 2 rows comes from shard k).
  c = _config("clm", files / "small.txt", shuffle=False, batch=2, shards=2)
  tok, docs = toks["clm"], sources.documents(c, "train")
  it = _train_it(c, tok, prefetch=0)
  streams = [[], []]
  while all(it.get_state()["shards"][str(k)]["epoch"] == 0 for k in (0, 1)):
    b = next(it)
    for k in (0, 1):
      streams[k] += b["input_ids"][k][b["segment_ids"][k] > 0].tolist()
  for k in (0, 1):
    expected = [t for i in range(k, n, 2) for t in tok.encode(docs[i]) + [tok.eos_id]]
    assert streams[k] == expected[:len(streams[k])] and len(streams[k]) > 0.5 * len(expected)


@pytest.mark.parametrize("objective,shards", [("clm", 1), ("clm", 4), ("mlm", 2), ("span_corruption", 2)])
def test_the_global_batch_does_not_depend_on_the_number_of_hosts(files, toks, objective, shards):
  """Hosts' slices of each global batch, concatenated, are the 1-host batches; a state saved with 4 hosts
  continues the stream on 1 host and on 2."""
  c = _config(objective, files / "small.txt", shards=shards)
  tok = toks[objective]
  one = take(_train_it(c, tok, window_rows=18, prefetch=0), 6)
  for hosts in (2, 4):
    its = [_train_it(c, tok, process_index=h, process_count=hosts, window_rows=18, prefetch=0) for h in range(hosts)]
    parts = [take(it, 6) for it in its]
    same_batches([{k: np.concatenate([p[b][k] for p in parts]) for k in one[b]} for b in range(6)], one)
  its = [_train_it(c, tok, process_index=h, process_count=4, window_rows=18, prefetch=0) for h in range(4)]
  for it in its:
    take(it, 3)
  merged = {"batch_index": 3, "shards": {}}
  for it in its:
    merged["shards"].update(it.get_state()["shards"])
  for hosts in (1, 2):
    resumed = [_train_it(c, tok, process_index=h, process_count=hosts, window_rows=18, prefetch=0)
               for h in range(hosts)]
    for it in resumed:
      it.set_state(json.loads(json.dumps(merged)))
    parts = [take(it, 3) for it in resumed]
    same_batches([{k: np.concatenate([p[b][k] for p in parts]) for k in one[b]} for b in range(3)], one[3:])


def test_thin_data_is_reported(files, toks, tmp_path, caplog):
  """A one-sentence corpus: rows mostly padding, and one epoch smaller than the batch, each said once."""
  (tmp_path / "one.txt").write_text("To be, or not to be, that is the question.\n")
  c = _config("clm", tmp_path / "one.txt")
  with caplog.at_level("WARNING"):
    take(_train_it(c, toks["clm"], prefetch=0), 2)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert any("% padding" in w and "one.txt" in w for w in warnings), warnings
  assert any("fewer rows than the 8" in w for w in warnings), warnings


# ---------------------------------------------------------------------------------------------- packing

def test_causal_rows_segments_positions_and_padding():
  # Documents 0 (5 tokens + eos), 1 (2 + eos), 2 (6 + eos) as one stream, rows of 6.
  docs = [np.array([11, 12, 13, 14, 15, 1]), np.array([21, 22, 1]), np.array([31, 32, 33, 34, 35, 36, 1])]
  tokens = np.concatenate(docs)
  doc = np.concatenate([np.full(len(d), i) for i, d in enumerate(docs)])
  r = packing.causal_rows(tokens, doc, 6, pad_id=0)
  np.testing.assert_array_equal(r["input_ids"], [[11, 12, 13, 14, 15, 1], [21, 22, 1, 31, 32, 33],
                                                 [34, 35, 36, 0, 0, 0]])
  np.testing.assert_array_equal(r["targets"], [[12, 13, 14, 15, 1, 21], [22, 1, 31, 32, 33, 34],
                                               [35, 36, 1, 0, 0, 0]])
  np.testing.assert_array_equal(r["weights"], [[1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(r["segment_ids"], [[1, 1, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(r["positions"], [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 0, 0]])


def test_packed_pipeline_rows_score_no_padding(files, toks):
  c = _config("clm", files / "small.txt", shuffle=False)
  batches = take(_train_it(c, toks["clm"], prefetch=0), 8)
  for b in batches:
    pad = b["segment_ids"] == 0
    assert not b["weights"][pad].any() and (b["input_ids"][pad] == 0).all()
    same = (b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]) & ~pad[:, 1:]
    # inside a segment, the target is the next input and positions count up by one
    assert (b["targets"][:, :-1][same] == b["input_ids"][:, 1:][same]).all()
    assert (b["positions"][:, 1:][same] == b["positions"][:, :-1][same] + 1).all()
    assert (b["positions"][:, 1:][~same & ~pad[:, 1:]] == 0).all()
  # the epoch's last row is the only padded one (the model side, packed row == documents alone, is
  # tests/test_objectives.py::test_packed_gpt_row_equals_documents_alone with the same conventions)
  assert sum(int((b["segment_ids"] == 0).any()) for b in batches) == 1


# -------------------------------------------------------------------------------------------------- NSP

def test_nsp_instances_follow_document_structure():
  # Document d's sentence s holds tokens 1000 d + 100 s + (0..len-1): adjacency is visible in the ids.
  rng = np.random.default_rng(0)
  corpus = [[np.arange(n) + 1000 * d + 100 * s for s, n in enumerate(rng.integers(3, 15, 8))] for d in range(1, 30)]
  flat = [np.concatenate(doc) for doc in corpus]
  n_pairs = 0
  for d, doc in enumerate(corpus):
    other = lambda r: corpus[(d + 1 + int(r.integers(0, len(corpus) - 1))) % len(corpus)]
    for a, b, is_random in nsp.instances(doc, rng=np.random.default_rng(d), seq_len=32, other_doc=other):
      n_pairs += 1
      assert 1 <= len(a) and 1 <= len(b) and len(a) + len(b) <= 29
      assert a[0] // 1000 == d + 1
      start = np.flatnonzero(flat[d] == a[0])[0]
      np.testing.assert_array_equal(flat[d][start:start + len(a)], a)   # A: a contiguous run of the document
      if is_random:
        assert b[0] // 1000 != d + 1
      else:                                  # B: the text after A in the same document (ends may be trimmed)
        after = np.flatnonzero(flat[d] == b[0])[0]
        assert after >= start + len(a)
        np.testing.assert_array_equal(flat[d][after:after + len(b)], b)
  assert n_pairs > 50


def test_nsp_pairs_half_random_and_within_length(files, toks):
  c = _config("mlm", files / "big.txt", nsp_=True, seq_len=64, batch=500)
  tok = toks["mlm"]
  batches = take(_train_it(c, tok, prefetch=0), 12)
  labels = np.concatenate([b["nsp_labels"] for b in batches])
  assert len(labels) == 6000 and abs(labels.mean() - 0.5) < 0.02
  for b in batches:
    ids, types_, mask = b["input_ids"], b["token_type_ids"], b["attention_mask"]
    assert (ids[:, 0] == tok.cls_id).all() and ((ids == tok.sep_id).sum(1) == 2).all()
    n = mask.sum(1)
    last_sep = ids.shape[1] - 1 - np.argmax((ids == tok.sep_id)[:, ::-1], 1)
    assert (last_sep == n - 1).all() and (n <= 64).all()
    first_sep = np.argmax(ids == tok.sep_id, 1)
    idx = np.arange(64)
    assert (types_ == ((idx > first_sep[:, None]) & (idx < n[:, None]))).all()
    assert (ids[mask == 0] == tok.pad_id).all()


# ------------------------------------------------------------------------------------------------- eval

def test_eval_batches_are_finite_repeatable_and_split_across_hosts(files, toks):
  c = _config("clm", files / "big.txt", eval_batches=3)
  c.data.eval_split = "train[80%:]"
  one = _eval_it(c, toks["clm"])
  assert len(list(one)) == 3 and 1.5 < one.text_per_token["bytes"] < 4
  same_batches(list(one), list(one))
  hosts = [list(_eval_it(c, toks["clm"], process_index=h, process_count=2)) for h in (0, 1)]
  for b, (h0, h1) in enumerate(zip(*hosts)):
    for k in h0:
      np.testing.assert_array_equal(np.concatenate([h0[k], h1[k]]), list(one)[b][k])
  c.data.eval_split = "train[:2]"
  with pytest.raises(ValueError, match="too small for one eval batch"):
    _eval_it(c, toks["clm"])


def test_random_replacements_are_every_non_special_token_and_only_those():
  ids = np.full((64, 40), 5, np.int32)
  special = [0, 3, 4, 11, 12]        # 12 is the mask id; 11 the last of the vocabulary
  out = masking.mask_tokens(ids, rng=np.random.default_rng(0), vocab_size=12, mask_id=12, special_ids=special,
                            rate=0.9, max_predictions=36)
  replaced = set(out["input_ids"][(out["input_ids"] != 5) & (out["input_ids"] != 12)].tolist())
  assert replaced == {1, 2, 6, 7, 8, 9, 10}


def test_a_corpus_past_its_cache_returns_documents_it_already_had(monkeypatch):
  """With the cache full, asking for a recent document together with many new ones returns it (storing the new
  ones used to drop it from the recent ones first: a KeyError on a multi-GB corpus)."""
  from lm_jax.data import corpus as corpus_lib

  class Docs(records.Records):
    path = "docs"

    def __len__(self):
      return 600

    def _get(self, i):
      return f"document {i} text"

  class Tok:
    def encode_batch(self, texts):
      return [[len(t), 7, 8] for t in texts]
  monkeypatch.setattr(corpus_lib, "_CACHE_TOKENS", 0)
  c = corpus_lib.Corpus(Docs(), Tok(), as_sentences=False)
  first = c.tokens([0])[0]
  out = c.tokens([0] + list(range(1, 400)))
  np.testing.assert_array_equal(out[0], first)
  assert len(out) == 400 and all(len(t) == 3 for t in out)

"""The one record reader (lm_jax/data/records.py): every format, TFDS, split slices, and a bad record in each kind of
input (text, task, instruction, preference, PPO prompt) reported the same way: counted by reason, named by file:line."""
import logging
import types

import numpy as np
import pytest

from lm_jax import config_lib, defaults, models, objectives
from lm_jax.data import corpus, instructions, pipeline, records, sources, tasks, tfds_prepare
from lm_jax.data import tokenizer as tokenizer_lib


def _read(path, split="train", fields="text", **kw):
  return records.read(split, fields, files=str(path), origin="config.x.files", named_by="config.x.fields", **kw)


def _all(found):
  return [found[i] for i in range(len(found))], [found.where(i) for i in range(len(found))]


# ---------------------------------------------------------------------------------------------------------- formats
def test_text_documents_and_lines_with_their_line_numbers(tmp_path):
  (tmp_path / "a.txt").write_text("one\ntwo\n\n  \n\nthree\n\n\n\nfour\n")
  items, where = _all(_read(tmp_path / "a.txt", documents=True))
  assert items == ["one\ntwo", "three", "four\n"]
  assert where == [f"{tmp_path}/a.txt:1", f"{tmp_path}/a.txt:6", f"{tmp_path}/a.txt:10"]
  items, where = _all(_read(tmp_path / "a.txt", fields=("prompt",)))      # documents=False: a record per line
  assert items == [{"prompt": "one"}, {"prompt": "two"}, {"prompt": "three"}, {"prompt": "four"}]
  assert [w.rsplit(":", 1)[1] for w in where] == ["1", "2", "6", "10"]
  with pytest.raises(ValueError, match="a.txt: a text file holds one text per record, not the fields s, label; use"):
    _read(tmp_path / "a.txt", fields=("s",), optional=("label",))              # a task's label would be missing


def test_jsonl_fields_optional_and_bad_lines(tmp_path):
  (tmp_path / "a.jsonl").write_bytes(b'{"s": "x", "label": 1}\n\n{"s": "y"}\nnot json\n[1]\n{"s": 5}\n'
                                     b'{"label": 0}\n\xff\xfe\xfd\xfc\n')
  items, where = _all(_read(tmp_path / "a.jsonl", fields=("s",), optional=("label",)))
  assert items[:2] == [{"s": "x", "label": 1}, {"s": "y"}]
  assert [(b.reason, b.detail) for b in items[2:]] == [
      ("malformed", "not JSON"), ("malformed", "not a JSON object but list"),
      ("malformed", "field 's' is int, not text"), ("malformed", "no field 's'"),
      ("undecodable", "4 of 4 bytes not UTF-8")]
  assert where[2:] == [f"{tmp_path}/a.jsonl:{n}" for n in (4, 5, 6, 7, 8)]


def test_tsv_by_header_by_number_and_first_column(tmp_path):
  (tmp_path / "h.tsv").write_text("id\ttext\tlabel\n0\thello\t1\n1\tshort\n2\n")
  items, where = _all(_read(tmp_path / "h.tsv", fields=("text",), optional=("label",)))
  assert items[:2] == [{"text": "hello", "label": "1"}, {"text": "short"}]
  assert (items[2].reason, items[2].detail, where[2]) == ("malformed", "1 columns, no 'text' (column 1)",
                                                         f"{tmp_path}/h.tsv:4")
  (tmp_path / "n.tsv").write_text("good\t1\nbad\t0\n")
  assert _read(tmp_path / "n.tsv", fields=("0",), optional=("1",))[:] == [{"0": "good", "1": "1"},
                                                                           {"0": "bad", "1": "0"}]
  assert _read(tmp_path / "n.tsv")[:] == ["good", "bad"]                  # one field, no header: the first column
  assert _read(tmp_path / "h.tsv")[:] == ["hello", "short", records.Bad("malformed")]   # the header names it
  with pytest.raises(ValueError, match=r"^config.x.fields=\('a', 'b'\): .*n.tsv has no header row naming them"):
    _read(tmp_path / "n.tsv", fields=("a", "b"))


def test_split_placeholder_slices_and_errors(tmp_path):
  for split in ("train", "dev"):
    (tmp_path / f"{split}.jsonl").write_text("".join(f'{{"text": "{split} {i}"}}\n' for i in range(10)))
  found = _read(tmp_path / "{split}.jsonl", "dev[20%:40%]")
  assert found[:] == ["dev 2", "dev 3"] and found.where(1) == f"{tmp_path}/dev.jsonl:4"
  assert found.path == f"{tmp_path}/dev.jsonl (dev[20%:40%])"
  with pytest.raises(FileNotFoundError, match="^config.x.files: no files match .*test.jsonl"):
    _read(tmp_path / "{split}.jsonl", "test")
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match="^config.x.files: no records in .*empty.jsonl"):
    _read(tmp_path / "empty.jsonl")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="^config.x.files: .*x.csv: unsupported type"):
    _read(tmp_path / "x.csv")


def _builder(data, formats=("array_record",), num_examples=5000):
  info = types.SimpleNamespace(
      splits={s: types.SimpleNamespace(num_examples=num_examples) for s in data},
      features={"text": 0, "label": 0},
      available_file_formats=lambda: [types.SimpleNamespace(value=f) for f in formats])
  return types.SimpleNamespace(data_dir="/tfds", info=info, as_data_source=lambda split: data[split])


def test_tfds_lazy_records_and_small_splits_cut_into_documents(monkeypatch):
  data = {"train": [{"text": b"a", "label": 1}, {"text": 3, "label": 0}, {"text": b"\xff\xfe", "label": 1}]}
  monkeypatch.setattr(tfds_prepare, "prepare_tfds", lambda name, data_dir: _builder(data))
  read = lambda fields, **kw: records.read("train", fields, tfds_name="toy", origin="o", named_by="n", **kw)
  found = read(("text",), optional=("label",))
  assert isinstance(found, records.TfdsRecords)
  assert found[:2] == [{"text": "a", "label": 1}, records.Bad("malformed")] and found[2].reason == "undecodable"
  assert found.where(1) == "TFDS toy in /tfds (train) record 1" and found[1].detail == "field 'text' is int, not text"
  data["train"] = [{"text": b"first doc\n\nsecond\ndoc"}, {"text": b"third"}]
  monkeypatch.setattr(tfds_prepare, "prepare_tfds", lambda name, data_dir: _builder(data, num_examples=2))
  small = read("text", documents=True)                          # few records: read whole, cut at blank lines
  assert isinstance(small, records.Listed) and small[:] == ["first doc", "second\ndoc", "third"]
  assert small.where(1) == "TFDS toy in /tfds (train) record 0:3"
  with pytest.raises(ValueError, match="^n='body' is not a feature of TFDS toy in /tfds; it has text, label"):
    read("body")


# ---------------------------------------------------------------------------------------- bad records, every kind
class _Tokenizer:
  """Characters as ids: enough for the readers, which only count and cut tokens."""
  eos_id = 1

  def encode_batch(self, texts):
    return [[2 + ord(c) % 90 for c in t] for t in texts]


def _text(path):
  c = config_lib.load("configs/gpt1.py:tiny", {"data.files": str(path.parent / "{split}.jsonl")})  # its own split
  return corpus.Corpus(sources.documents(c, "train"), _Tokenizer(), as_sentences=False)


def _task(path):
  c = defaults.base_config()
  c.model.num_labels = 2
  c.task.update(files=str(path), text_fields=("sentence",), label_field="label")
  return tasks.examples(c, "train", _Tokenizer())


def _rlhf(kind):
  def examples(path):
    c = config_lib.load("configs/rlhf/sft.py:tiny", {"rlhf.files": str(path)})
    return instructions.examples(c, "train", _Tokenizer(), kind)
  return examples


KINDS = {   # kind: (reader, a good record, a bad one, how the report names the bad one)
    "text": (_text, '{"text": "a good document"}', '{"txt": "a typo in the field"}', "no field 'text'"),
    "task": (_task, '{"sentence": "fine", "label": 1}', '{"sentence": "odd", "label": 7}', "label 7 not in 0..1"),
    "instruction": (_rlhf("instruction"), '{"prompt": "p", "response": "r"}', '{"prompt": "p", "response": "r"',
                    "not JSON"),
    "preference": (_rlhf("preference"), '{"prompt": "p", "chosen": "a", "rejected": "b"}',
                   '{"prompt": "p", "chosen": 5, "rejected": "b"}', "field 'chosen' is int, not text"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_record_is_counted_and_named_by_file_and_line(kind, tmp_path):
  read, good, bad, detail = KINDS[kind]
  path = tmp_path / "train.jsonl"
  path.write_text(f"{good}\n\n{good}\n{bad}\n")
  found = read(path)
  found.tokens(list(range(len(found))))
  assert found.stats["documents"] == 3 and found.stats["malformed"] == 1
  assert found.tally.report() == f"{path} (train): 1 malformed of 3 records; first: {path}:4: {detail}"


def test_a_bad_prompt_is_counted_and_named_and_no_usable_prompt_is_an_error(tmp_path, caplog):
  path = tmp_path / "prompts.jsonl"
  path.write_text('{"prompt": "hello"}\n{"prompt": 5}\n{"text": "x"}\n')
  c = config_lib.load("configs/rlhf/ppo.py:tiny", {"ppo.prompts": str(path), "ppo.prompt_len": 3,
                                                   "rlhf.template": ""})
  with caplog.at_level(logging.WARNING):
    assert instructions.prompts(c, _Tokenizer()) == _Tokenizer().encode_batch(["llo"])
  assert f"data: {path} (train): 2 malformed of 3 records; first: {path}:2: field 'prompt' is int, not text; " \
         f"{path}:3: no field 'prompt'" in caplog.messages
  path.write_text('{"prompt": 5}\n')
  with pytest.raises(ValueError, match=f"^config.ppo.prompts='{path}': no usable prompt; {path} .*{path}:1: field"):
    instructions.prompts(c, _Tokenizer())


def test_the_pipeline_names_bad_records_in_its_warning_and_errors(tmp_path, caplog):
  lines = ["alpha beta gamma delta epsilon zeta eta theta"] * 40
  (tmp_path / "tok.model").write_bytes(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=64))
  tok = tokenizer_lib.load(str(tmp_path / "tok.model"), models.family("gpt"))
  (tmp_path / "train.jsonl").write_text("\n".join([f'{{"text": "{lines[0]}"}}'] * 30 + ["oops"]) + "\n")
  c = config_lib.load("configs/gpt1.py:tiny", {"data.files": str(tmp_path / "{split}.jsonl"), "data.seq_len": 16,
                                               "batch_size": 4, "model.vocab_size": 64})
  it = pipeline.make_train_iterator(c, tok, objectives.get("clm"), prefetch=0)
  with caplog.at_level(logging.WARNING):
    for _ in range(30):
      next(it)
  assert any(f"1 malformed of 31 records; first: {tmp_path}/train.jsonl:31: not JSON" in m for m in caplog.messages)
  (tmp_path / "dev.jsonl").write_text('{"text": "alpha"}\n{"body": "beta"}\n')
  with pytest.raises(ValueError, match=f"too small for one eval batch .*; .*{tmp_path}/dev.jsonl:2: no field 'text'"):
    pipeline.make_eval_iterator(config_lib.override(c, {"data.eval_split": "dev"}), tok, objectives.get("clm"))

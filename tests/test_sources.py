"""Data hygiene in sources and tokenizer training: invalid UTF-8 kept and counted, long lines trained on
whole, binary files refused by name."""
import logging

import pytest

from lm_jax import config_lib
from lm_jax.data import records as records_lib, sources, tokenizer
from conftest import run_tokenizer


def _config(path, vocab=320):
  c = config_lib.load("configs/gpt1.py:tiny")
  c.data.files = str(path)
  c.data.tokenizer_type = "bpe"
  c.model.vocab_size = vocab
  return c


def test_invalid_utf8_is_replaced_kept_counted_and_warned(tmp_path, caplog):
  (tmp_path / "a.txt").write_bytes(b"good doc\n\ncaf\xe9 au lait \xff\n\n\xff\xfe\xfd\n\nlast doc")
  (tmp_path / "b.jsonl").write_bytes(b'{"text": "na\xefve"}\n{"text": "fine"}\nnot json\n')
  (tmp_path / "c.tsv").write_bytes(b"r\xe9sum\xe9\t1\n")
  with caplog.at_level(logging.WARNING):
    docs = sources.documents(_config(tmp_path / "*"), "train[:]")   # every record, none held out for eval
  assert [docs[i] for i in range(len(docs))] == [
      "good doc", "caf\ufffd au lait \ufffd", records_lib.Bad("undecodable"), "last doc",   # 3 of 3 bytes bad
      "na\ufffdve", "fine", records_lib.Bad("malformed"), "r\ufffdsum\ufffd"]
  assert docs.decode_stats == dict(replaced_documents=3, replaced_bytes=5)
  warned = [r.getMessage() for r in caplog.records if "invalid UTF-8" in r.getMessage()]
  assert len(warned) == 3 and warned[0].endswith("a.txt: invalid UTF-8 in 1 documents, kept with 2 bytes replaced "
                                                  "by U+FFFD; 1 records mostly not UTF-8 skipped as undecodable")
  assert "b.jsonl: invalid UTF-8 in 1 documents, kept with 1 bytes" in warned[1]
  assert "c.tsv: invalid UTF-8 in 1 documents, kept with 2 bytes" in warned[2]
  # The counts follow the split's slice.
  assert sources.documents(_config(tmp_path / "*"), "train[:3]").decode_stats == \
      dict(replaced_documents=1, replaced_bytes=2)
  assert sources.documents(_config(tmp_path / "*"), "train[3:]").decode_stats == \
      dict(replaced_documents=2, replaced_bytes=3)


def test_lazy_tfds_records_count_replacements_once_per_document(caplog):
  records = records_lib.TfdsRecords([{"text": b"caf\xe9"}, {"text": b"ok"}, {"text": b"\xe9t\xe9 ok"}], "text", "toy")
  with caplog.at_level(logging.WARNING):
    texts = [records[i] for i in (0, 1, 0, 2)]
  assert texts == ["caf\ufffd", "ok", "caf\ufffd", "\ufffdt\ufffd ok"]
  assert records.decode_stats == dict(replaced_documents=2, replaced_bytes=3)
  assert [r.getMessage() for r in caplog.records if "invalid UTF-8" in r.getMessage()] == [
      "data: toy: record 0 has invalid UTF-8, kept with 1 bytes replaced by U+FFFD (warned once per split)"]


def test_binary_files_are_refused_by_name(tmp_path):
  (tmp_path / "weights.txt").write_bytes(b"PK\x03\x04" + b"\x00" * 100 + b"some text" * 100)
  with pytest.raises(ValueError, match=r"weights.txt looks binary \(NUL bytes at offset 4\); data.files expects"):
    sources.documents(_config(tmp_path / "weights.txt"), "train")
  (tmp_path / "latin1.jsonl").write_bytes(bytes(range(128, 256)) * 100)
  with pytest.raises(ValueError, match=r"latin1.jsonl looks binary \(8192 of its first 8192 bytes are not UTF-8"):
    sources.documents(_config(tmp_path / "latin1.jsonl"), "train")
  # UTF-8 text of multibyte characters, its first block cut inside a character, is text.
  (tmp_path / "ja.txt").write_text("日本語の文章です。" * 2000, encoding="utf-8")
  assert sources.documents(_config(tmp_path / "ja.txt"), "train")[0].startswith("日本語")


def test_spm_sentences_stay_under_the_byte_limit_and_keep_every_word():
  line = " ".join(f"w{i}é日" for i in range(5000))
  pieces = list(tokenizer.spm_sentences(line, 100))
  assert max(len(p.encode()) for p in pieces) <= 100 and len(pieces) > len(line.encode()) // 100
  assert " ".join(pieces).split() == line.split()                    # cut at spaces only
  unbroken = "é日z" * 1000
  pieces = list(tokenizer.spm_sentences(unbroken, 100))              # no space: cut between characters
  assert "".join(pieces) == unbroken and max(len(p.encode()) for p in pieces) <= 100
  assert list(tokenizer.spm_sentences("short line")) == ["short line"]
  assert list(tokenizer.spm_sentences("  ")) == []


def test_training_text_takes_max_chars_of_one_long_line(tmp_path):
  (tmp_path / "one.txt").write_text("word " * 20_000)
  lines = sources.training_text(_config(tmp_path / "one.txt"), 30_000)
  assert sum(map(len, lines)) == 30_000


def test_tokenizer_learns_the_end_of_a_single_line_file(tmp_path):
  """SentencePiece skips sentences over 4192 bytes: a one-line corpus must reach it in pieces, all of it."""
  (tmp_path / "one.txt").write_text("alpha beta gamma delta " * 10_000 + "zebra quokka " * 500)
  tok = run_tokenizer(_config(tmp_path / "one.txt", vocab=64), str(tmp_path / "work"))
  ids = tok.encode("zebra quokka")
  assert tok.unk_id not in ids and tok.decode(ids) == "zebra quokka"
  assert "▁zebra" in tok._pieces and "▁quokka" in tok._pieces

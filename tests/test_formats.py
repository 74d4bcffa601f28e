"""The formats real corpora come in (lm_jax/data/formats.py) read the same records as their .jsonl twin, through the
same reader and bad-record tally; a truncated compressed file is a one-line error naming it."""
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import write_arrow_dir
from lm_jax.data import formats, records

DATA = os.environ.get("LM_JAX_DATA", "/work/shared/data")


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
  """WikiText-2 valid's documents as .jsonl and its twins (with two bad lines in the line formats)."""
  d = tmp_path_factory.mktemp("twins")
  texts = list(records.read("valid", "text", files=f"{DATA}/wikitext-2-raw/wiki.valid.raw", documents=True,
                            origin="o", named_by="n"))
  data = ("\n".join([json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)] + ["not json", '{"id": 3}'])
          + "\n").encode()
  (d / "c.jsonl").write_bytes(data)
  half = len(data) // 2                  # two gzip members, two zstd frames
  (d / "c.jsonl.gz").write_bytes(gzip.compress(data[:half]) + gzip.compress(data[half:]))
  (d / "c.json.gz").write_bytes(gzip.compress(data))
  z = zstandard.ZstdCompressor()
  (d / "c.jsonl.zst").write_bytes(z.compress(data[:half]) + z.compress(data[half:]))
  table = pa.table({"text": texts, "id": list(range(len(texts)))})
  pq.write_table(table, d / "c.parquet", row_group_size=100)
  write_arrow_dir(d / "arrow", table, 100)
  (d / "wiki.txt").write_bytes(open(f"{DATA}/wikitext-2-raw/wiki.valid.raw", "rb").read())
  return d, texts


@pytest.fixture(autouse=True)
def spill_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("LM_JAX_SPILL_DIR", str(tmp_path / "spill"))


def _read(path, split="train"):
  return records.read(split, "text", files=str(path), documents=True, origin="config.data.files",
                      named_by="config.data.text_field")


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.json.gz", "c.jsonl.zst"])
def test_compressed_lines_read_as_their_jsonl_twin_with_the_same_tally(twins, name):
  d, texts = twins
  twin, got = _read(d / "c.jsonl"), _read(d / name)
  assert got.lazy and list(got) == list(twin) and list(got)[:len(texts)] == texts
  assert records.screen(got, lambda r: None).counts == records.screen(twin, lambda r: None).counts == dict(
      documents=len(texts) + 2, malformed=2)
  assert got.where(len(texts)) == f"{d / name}:{len(texts) + 1}"   # file:line, as the twin's
  assert records.screen(got, lambda r: None).report().replace(name, "c.jsonl") == \
      records.screen(twin, lambda r: None).report()


@pytest.mark.parametrize("name", ["c.parquet", "arrow"])
def test_columnar_rows_read_as_the_jsonl_documents(twins, name):
  d, texts = twins
  got = _read(d / name)
  assert list(got) == texts and len(_read(d / name, "train[10:20]")) == 10 and _read(d / name, "train[10:20]")[0] == \
      texts[10]
  with pytest.raises(ValueError, match=r"^config.data.text_field='body': .*c.parquet has no such column"):
    records.read("train", "body", files=str(d / "c.parquet"), documents=True, origin="config.data.files",
                 named_by="config.data.text_field")


def test_a_big_text_file_is_streamed_into_a_spill_with_the_same_documents(twins, monkeypatch):
  d, _ = twins
  whole = _read(d / "wiki.txt")
  monkeypatch.setattr(records, "SPILL_BYTES", 1000)
  monkeypatch.setattr(formats, "_BLOCK", 4096)          # documents cross block boundaries
  spilled = _read(d / "wiki.txt")
  assert isinstance(whole, records.Listed) and isinstance(spilled, records.Spilled)
  assert list(spilled) == list(whole) and [spilled.where(i) for i in (0, 7)] == [whole.where(i) for i in (0, 7)]


@pytest.mark.parametrize("name,what", [("c.jsonl.gz", "gzip"), ("c.jsonl.zst", "zstandard")])
def test_a_truncated_compressed_file_is_one_line(twins, tmp_path, name, what):
  d, _ = twins
  cut = tmp_path / name
  cut.write_bytes((d / name).read_bytes()[:-40])
  with pytest.raises(ValueError) as e:
    _read(cut)
  assert str(e.value) == f"{cut}: truncated {what} file (it ends inside a {'member' if what == 'gzip' else 'frame'})"
  assert not list((tmp_path / "spill").glob("*.array_record"))        # no half spill is left to be read


def test_a_spill_is_made_once_and_again_when_the_file_changes(twins, tmp_path):
  d, _ = twins
  path = tmp_path / "x.jsonl.gz"
  path.write_bytes(gzip.compress(b'{"text": "one two"}\n'))
  assert list(_read(path)) == ["one two"]
  spills = sorted((tmp_path / "spill").glob("*.array_record"))
  assert list(_read(path)) == ["one two"] and sorted((tmp_path / "spill").glob("*.array_record")) == spills
  path.write_bytes(gzip.compress(b'{"text": "three four five"}\n'))
  os.utime(path, ns=(1, 1))
  assert list(_read(path)) == ["three four five"]


def test_a_glob_of_several_files_reads_them_in_order(twins, tmp_path):
  d, texts = twins
  for k in range(3):
    (tmp_path / f"part-{k}.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"text": t}) + "\n" for t in texts[k * 100:(k + 1) * 100]).encode()))
  got = _read(tmp_path / "part-*.jsonl.gz")
  assert len(got) == 300 and list(got) == texts[:300] and got.where(150) == f"{tmp_path / 'part-1.jsonl.gz'}:51"
  assert list(_read(tmp_path / "part-*.jsonl.gz", "train[95:205]")) == texts[95:205]

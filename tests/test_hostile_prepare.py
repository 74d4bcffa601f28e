"""A hostile user of `python -m lm_jax.prepare` and of the folders it writes (issue 44): a re-prepare that fails, is
killed or races another never leaves a mixed folder (every file hashed), a user's folder and the targets of links
placed in --out are never written, --processes is capped, and damaged shards or a torn manifest are one line naming
the file."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_hostile import one_line

TINY = ["--config=configs/gpt1.py:tiny", "--config.data.train_split=train", "--config.data.eval_split=valid",
        "--config.model.vocab_size=256", "--config.data.tokenizer_type=char", "--config.data.seq_len=32"]
TRAIN = ["--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.d_ff=128",
         "--config.model.num_layers=1", "--config.batch_size=8", "--config.phase_end_step=0",
         "--config.data.eval_batches=2", "--config.total_steps=1"]


def _prepare_cmd(corpus, out, *more):
  return [sys.executable, "-m", "lm_jax.prepare", *TINY, f"--config.data.files={corpus}/{{split}}.jsonl",
          f"--out={out}", *more]


def prepare(corpus, out, *more):
  return subprocess.run(_prepare_cmd(corpus, out, *more), cwd=REPO, capture_output=True, text=True, timeout=300)


def train(corpus, prepared, workdir):
  return subprocess.run([sys.executable, "-m", "lm_jax.main", *TINY, *TRAIN, f"--workdir={workdir}",
                         f"--config.data.files={corpus}/{{split}}.jsonl", f"--config.data.prepared={prepared}"],
                        cwd=REPO, capture_output=True, text=True, timeout=600)


def hashes(folder) -> dict:
  """relative path -> sha256 of every file under `folder` (a link: where it points, not followed)."""
  out = {}
  for root, dirs, files in os.walk(folder):
    for name in dirs + files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, folder)
      if os.path.islink(path):
        out[rel] = "link to " + os.readlink(path)
      elif os.path.isfile(path):
        out[rel] = hashlib.sha256(open(path, "rb").read()).hexdigest()
  return out


@pytest.fixture(scope="module")
def corpora(shared_data, tmp_path_factory):
  """Two small corpora as train / valid .jsonl: a, 215 Tiny Shakespeare documents; b, the same in reverse order
  (other shards, the same characters for the char tokenizer each preparation caches)."""
  root = tmp_path_factory.mktemp("corpora")
  docs = [t for t in (shared_data / "tiny_shakespeare" / "input.txt").read_text()[:30_000].split("\n\n") if t.strip()]
  for name, part in (("a", docs), ("b", docs[::-1])):
    (root / name).mkdir()
    (root / name / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part[:-20]))
    (root / name / "valid.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part[-20:]))
  return root / "a", root / "b"


@pytest.fixture(scope="module")
def prepared(corpora, tmp_path_factory):
  """Corpus a prepared, 5 documents a shard (39 train shards)."""
  out = tmp_path_factory.mktemp("prepared") / "p"
  done = prepare(corpora[0], out, "--docs_per_shard=5")
  assert done.returncode == 0, done.stderr
  return out


def copy(prepared, tmp_path):
  shutil.copytree(prepared, tmp_path / "p", symlinks=True)
  return tmp_path / "p"


def leftovers(out) -> list:
  """What else than `out` and its lock lies beside it."""
  return sorted(set(os.listdir(out.parent)) - {out.name, f".{out.name}.lock"})


def test_a_failing_reprepare_keeps_the_old_preparation(prepared, corpora, tmp_path):
  out = copy(prepared, tmp_path)
  before = hashes(out)
  result = prepare(corpora[1], out, "--docs_per_shard=5", "--config.data.eval_split=vaild")   # a typo
  one_line(result, 1, "vaild")
  assert hashes(out) == before and leftovers(out) == []


def _wait_for_a_shard(folder, proc):
  """Until a shard file is written anywhere under `folder` after now (the prepare is then mid-way)."""
  start, deadline = time.time(), time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    for root, _, files in os.walk(folder):
      if any(f.endswith(".array_record") and os.path.getmtime(os.path.join(root, f)) >= start for f in files):
        return
    time.sleep(0.01)
  raise AssertionError(f"no shard written (exit {proc.poll()}): {proc.stderr.read() if proc.stderr else ''}")


def test_a_killed_reprepare_keeps_the_old_one_and_the_next_cleans_up_capping_processes(prepared, corpora, tmp_path):
  out = copy(prepared, tmp_path)
  before = hashes(out)
  proc = subprocess.Popen(_prepare_cmd(corpora[1], out, "--docs_per_shard=1"), cwd=REPO, stderr=subprocess.PIPE,
                          text=True)
  _wait_for_a_shard(tmp_path, proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert hashes(out) == before
  done = prepare(corpora[1], out, "--docs_per_shard=1000", "--processes=16")   # and --processes is capped
  warning = one_line(done, 0, "warning: --processes=16: using 1 (")
  assert f"({os.cpu_count()} CPUs, at most 1 shards written at once)" in warning and leftovers(out) == []
  assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["path"].startswith(f"{corpora[1]}/")


def test_two_prepares_at_once_one_is_refused(prepared, corpora, tmp_path):
  """The first is paused (SIGSTOP) once it writes shards, while the second tries."""
  out = tmp_path / "p"
  first = subprocess.Popen(_prepare_cmd(corpora[0], out, "--docs_per_shard=5"), cwd=REPO, stderr=subprocess.PIPE,
                           text=True)
  _wait_for_a_shard(tmp_path, first)
  first.send_signal(signal.SIGSTOP)
  try:
    second = prepare(corpora[1], out, "--docs_per_shard=5")
  finally:
    first.send_signal(signal.SIGCONT)
  one_line(second, 1, f"--out={out} is being prepared by another prepare (pid {first.pid} on ")
  assert first.wait(timeout=300) == 0, first.stderr.read()
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["splits"]["train"]["path"].startswith(f"{corpora[0]}/") and leftovers(out) == []
  assert hashes(out / "train") == hashes(prepared / "train")


def test_a_folder_that_is_not_a_preparation_is_refused_untouched(corpora, tmp_path):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "manifest.json").write_text('{"name": "my project", "files": 3}\n')
  (out / "notes.txt").write_text("keep me\n")
  before = hashes(out)
  result = prepare(corpora[0], out)
  one_line(result, 2, f"--out={out} is a folder that holds no preparation", "name a new or empty folder")
  assert hashes(out) == before and leftovers(out) == []


def test_links_placed_in_out_are_replaced_not_written_through(prepared, corpora, tmp_path):
  """Links at the manifest, at a shard and at a split's folder: their targets (the user's files) are unchanged."""
  out = copy(prepared, tmp_path)
  user = tmp_path / "user"
  shutil.copytree(out / "valid", user / "valid")
  shutil.copy(out / "manifest.json", user / "manifest.json")
  shutil.copy(out / "train" / "shard-00000-of-00039.array_record", user / "shard")
  shutil.rmtree(out / "valid")
  for link, target in ((out / "valid", user / "valid"), (out / "manifest.json", user / "manifest.json"),
                       (out / "train" / "shard-00000-of-00039.array_record", user / "shard")):
    link.unlink(missing_ok=True)
    link.symlink_to(target)
  before = hashes(user)
  done = prepare(corpora[1], out, "--docs_per_shard=5")
  assert done.returncode == 0, done.stderr
  assert hashes(user) == before
  assert not any(os.path.islink(os.path.join(root, f)) for root, dirs, files in os.walk(out) for f in dirs + files)
  assert json.loads((out / "manifest.json").read_text())["splits"]["valid"]["path"].startswith(f"{corpora[1]}/")


def _damage(out, how):
  shard = out / "train" / "shard-00002-of-00039.array_record"
  if how == "torn manifest":
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text[:len(text) // 2])
    return out / "manifest.json", "is not a complete manifest"
  shard.write_bytes(shard.read_bytes()[:1000])
  return shard, "is damaged (1000 bytes, its manifest.json says"


@pytest.mark.parametrize("how", ["torn manifest", "truncated shard"])
def test_damaged_prepared_data_is_one_line_naming_the_file(prepared, corpora, tmp_path, how):
  out = copy(prepared, tmp_path)
  path, words = _damage(out, how)
  one_line(train(corpora[0], out, tmp_path / "run"), 1, f"error: {path}" if how == "torn manifest" else str(path),
           words, "prepare the folder again with python -m lm_jax.prepare")


def test_a_deleted_or_corrupt_shard_is_named_and_old_manifests_still_read(prepared, corpora, tmp_path):
  """In process (a step compiles before a corrupt record is read; the CLI makes the same ValueError one line, as
  above): a missing shard is named at start, a record that fails its checksum when read; a manifest written before
  shard sizes were recorded still reads."""
  from lm_jax import config_lib, models, objectives
  from lm_jax.data import pipeline, tokenizer
  out = copy(prepared, tmp_path)
  c = config_lib.load("configs/gpt1.py:tiny")
  c.data.files, c.data.train_split, c.data.eval_split = f"{corpora[0]}/{{split}}.jsonl", "train", "valid"
  c.model.vocab_size, c.data.tokenizer_type, c.data.seq_len, c.batch_size = 256, "char", 32, 8
  c.data.prepared = str(out)
  tok, clm = tokenizer.load_or_train(c, str(out), models.family(c.model)), objectives.get("clm")
  manifest = json.loads((out / "manifest.json").read_text())
  for meta in manifest["splits"].values():
    del meta["shard_bytes"]
  (out / "manifest.json").write_text(json.dumps(manifest))
  assert next(pipeline.make_train_iterator(c, tok, clm, prefetch=0))["input_ids"].shape == (8, 32)
  for shard in (out / "train").iterdir():   # the same size, records that fail their checksum
    data = bytearray(shard.read_bytes())
    data[100:400] = bytes(b ^ 0x5A for b in data[100:400])
    shard.write_bytes(data)
  with pytest.raises(ValueError, match=r"^prepared shard .*/train/shard-000\d\d-of-00039.array_record is damaged "
                     r"\(Corrupted Riegeli/records file: .*\); prepare the folder again with python -m lm_jax"):
    next(pipeline.make_train_iterator(c, tok, clm, prefetch=0))
  (out / "train" / "shard-00038-of-00039.array_record").unlink()
  with pytest.raises(ValueError, match=r"^prepared shard .*/train/shard-00038-of-00039.array_record is missing; "
                     r"prepare the folder again with python -m lm_jax.prepare$"):
    pipeline.make_train_iterator(c, tok, clm, prefetch=0)

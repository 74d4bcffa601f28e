"""gs:// workdirs, data and exports against a real GCS API server (fake-gcs-server, the gcs_server fixture): a run
trains, checkpoints, resumes (after kill -9 too) and evaluates in a bucket with the records of a local run and a quiet
stderr, on 2 processes as on 1; one run per workdir; metrics.jsonl in appended segments; W&B beside it; exports
written whole or not at all; data (every format, mixture globs, task files, tokenizers, prompts, adapters) read from
a bucket as from a local disk; one-line errors for a missing bucket, missing credentials, a permission refusal and a
server gone mid-save."""
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, cli, flags, free_port, gcs_env, records, start_gcs, write_arrow_dir
from lm_jax import models, storage
from lm_jax.obs import metrics_log

# tensorstore (orbax's checkpoints) logs this one INFO line per process when told the emulator needs no credentials
TENSORSTORE_LINE = "google_auth_provider.cc:136] Using GOOGLE_AUTH_TOKEN_FOR_TESTING"


def quiet(stderr: str) -> list[str]:
  """stderr's lines other than tensorstore's one: what a storage library printed beyond lm_jax's own lines."""
  return [line for line in stderr.splitlines() if TENSORSTORE_LINE not in line]


def same_records(a, b):
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    assert {k: v for k, v in x.items() if k not in metrics_log.WALL_CLOCK} == \
           {k: v for k, v in y.items() if k not in metrics_log.WALL_CLOCK}


@pytest.fixture(scope="module")
def gs_run(gcs_server, shared_data, tmp_path_factory):
  """4 steps to gs://testbucket/run, resumed to 6, then evaluated; and the same 6 steps uninterrupted on a local
  disk."""
  args = flags("clm", shared_data, checkpoint_every=2, eval_every=2, log_every=2)
  workdir = "gs://testbucket/run"
  first = cli(*args, "--config.total_steps=4", f"--workdir={workdir}", env=gcs_server["env"])
  resumed = cli(*args, "--config.total_steps=6", f"--workdir={workdir}", env=gcs_server["env"])
  evaluated = cli(*args, "--config.total_steps=6", "--mode=eval", f"--workdir={workdir}", env=gcs_server["env"])
  local = tmp_path_factory.mktemp("local") / "run"
  reference = cli(*args, "--config.total_steps=6", f"--workdir={local}")
  for p in (first, resumed, evaluated, reference):
    assert p.returncode == 0, p.stderr[-3000:]
  return dict(args=args, workdir=workdir, local=local, first=first, resumed=resumed, evaluated=evaluated)


def test_train_resume_eval_in_a_bucket(gs_run):
  """The resumed gs:// run has exactly the records of the uninterrupted local one; eval reads its checkpoint."""
  assert "resumed step 4 from gs://testbucket/run/checkpoints" in gs_run["resumed"].stdout
  same_records(records(gs_run["workdir"]), records(str(gs_run["local"])))
  evals = records(gs_run["workdir"], "eval")   # the training's, then --mode=eval's own record
  same_records(evals[:-1], records(str(gs_run["local"]), "eval"))
  assert evals[-1]["step"] == 6 and "step 6/6 | eval_accuracy" in gs_run["evaluated"].stdout


def test_storage_libraries_are_quiet(gs_run):
  """No credential warnings, no gcsfs tracebacks: stderr holds at most tensorstore's one line."""
  for p in (gs_run["first"], gs_run["resumed"], gs_run["evaluated"]):
    assert quiet(p.stderr) == [], p.stderr[-3000:]
    assert len(p.stderr.splitlines()) <= 1


def test_second_run_on_a_busy_workdir_is_refused(gcs_server, shared_data):
  """The same one line as on a local disk while the first run holds gs://.../run.lock."""
  from lm_jax import workdir_lock
  with workdir_lock.hold("gs://testbucket/busy"):
    p = cli(*flags("clm", shared_data), "--config.total_steps=2", "--workdir=gs://testbucket/busy",
            env=gcs_server["env"])
  assert p.returncode == 1
  [line] = quiet(p.stderr)
  assert line.startswith(f"error: gs://testbucket/busy is in use by the run of pid {os.getpid()} on host "
                         f"{socket.gethostname()} (started ")
  assert line.endswith("; wait for it, stop it, or use another --workdir")
  assert not storage.path("gs://testbucket/busy/run.lock").exists()   # released at the end of the block


def test_lock_is_renewed_and_a_stale_one_replaced(gcs_server, monkeypatch):
  """A renewed lock keeps a second holder out past STALE_S; an unrenewed one is replaced; a dead pid of this host
  frees it at once."""
  from lm_jax import workdir_lock
  monkeypatch.setattr(workdir_lock, "RENEW_S", 0.5)   # margins for a loaded 2-core CI machine
  monkeypatch.setattr(workdir_lock, "STALE_S", 3.0)
  with workdir_lock.hold("gs://testbucket/renewed"):
    time.sleep(4.0)
    with pytest.raises(workdir_lock.WorkdirInUse, match="in use by the run of pid"):
      workdir_lock.hold("gs://testbucket/renewed").__enter__()
  blob = storage.gcs_blob("gs://testbucket/stale/run.lock")
  blob.upload_from_string(json.dumps({"host": "elsewhere", "pid": 1, "started": "then"}))
  time.sleep(3.2)
  with workdir_lock.hold("gs://testbucket/stale"):
    assert json.loads(blob.download_as_text())["pid"] == os.getpid()
  monkeypatch.setattr(workdir_lock, "STALE_S", 300.0)
  blob = storage.gcs_blob("gs://testbucket/dead_pid/run.lock")
  blob.upload_from_string(json.dumps({"host": socket.gethostname(), "pid": _exited_pid(), "started": "then"}))
  with workdir_lock.hold("gs://testbucket/dead_pid"):
    assert json.loads(blob.download_as_text())["pid"] == os.getpid()


def _exited_pid() -> int:
  p = subprocess.Popen(["true"])
  p.wait()
  return p.pid


def test_metrics_are_appended_segments_and_cut_back_on_resume(gcs_server, tmp_path):
  """Each write uploads one object holding only its record; a resume cuts back exactly as a local file does, and
  leaves one base segment."""
  def run(workdir, resume_step, steps):
    log = metrics_log.MetricsLog(workdir, resume_step, tensorboard=False)
    for step in steps:
      log.write({"step": step, "loss": 1.0 / step})
    log.close()

  for workdir in ("gs://testbucket/metrics", str(tmp_path)):
    run(workdir, 0, range(1, 6))
    run(workdir, 3, range(4, 8))   # killed after step 5, resumed from a step-3 checkpoint
  folder = "gs://testbucket/metrics/metrics.jsonl"
  assert metrics_log.read(folder) == metrics_log.read(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in metrics_log.read(folder)] == [1, 2, 3, 4, 5, 6, 7]
  names = [url.rsplit("/", 1)[1] for url in storage.list_files(folder)]
  assert names == ["00000005.base.jsonl", "00000006.jsonl", "00000007.jsonl", "00000008.jsonl", "00000009.jsonl"]
  texts = storage.read_many(storage.list_files(folder))
  assert [len(t.splitlines()) for t in texts.values()] == [3, 1, 1, 1, 1]


def test_export_to_a_bucket_then_load_hf_and_init_from_it(gs_run, gcs_server, tmp_path):
  """--mode=export writes a bucket's export that load_hf reads with the weights of the same run's local export;
  a second export there is refused; a fine-tune starts from it."""
  from lm_jax.hf import export
  target = "gs://testbucket/export"
  p = cli(*gs_run["args"], "--mode=export", f"--workdir={gs_run['workdir']}", f"--export_dir={target}",
          env=gcs_server["env"])
  assert p.returncode == 0 and quiet(p.stderr) == [], p.stderr[-3000:]
  assert {"config.json", "model.safetensors"} <= {u.rsplit("/", 1)[1] for u in storage.find(target)}
  local = cli(*gs_run["args"], "--mode=export", f"--workdir={gs_run['local']}", f"--export_dir={tmp_path / 'ex'}")
  assert local.returncode == 0, local.stderr[-3000:]
  (cfg, params), (local_cfg, local_params) = export.load_hf(target), export.load_hf(str(tmp_path / "ex"))
  assert cfg == local_cfg
  jax.tree.map(np.testing.assert_array_equal, params, local_params)
  with pytest.raises(FileExistsError, match=f"^export directory {target} is not empty; pass --overwrite"):
    export.check_target(target)
  ft = cli(*gs_run["args"], "--config.total_steps=2", f"--config.init_from={target}", f"--workdir={tmp_path / 'ft'}",
           env=gcs_server["env"])
  assert ft.returncode == 0 and quiet(ft.stderr) == [], ft.stderr[-3000:]
  assert records(str(tmp_path / "ft"))[-1]["step"] == 2


def test_a_failed_upload_leaves_no_export(gcs_server, monkeypatch, tmp_path):
  """An upload that fails part way removes what it wrote: the target holds no file (no config.json, no export)."""
  from lm_jax.hf import export
  fs = storage._fs("gs://testbucket")
  put, calls = fs.put_file, []

  def failing_put(*args, **kwargs):
    calls.append(args)
    if len(calls) == 2:
      raise OSError("connection reset")
    return put(*args, **kwargs)

  monkeypatch.setattr(fs, "put_file", failing_put)
  with pytest.raises(OSError, match="connection reset"):
    with export.writing("gs://testbucket/partial") as out:
      for name in ("a.bin", "model.safetensors", "config.json"):
        pathlib.Path(out, name).write_text(name)
  assert len(calls) == 2 and storage.find("gs://testbucket/partial") == []


def test_a_missing_bucket_is_one_line(gcs_server, shared_data):
  p = cli(*flags("clm", shared_data), "--config.total_steps=2", "--workdir=gs://nobucket/run", env=gcs_server["env"])
  assert p.returncode == 1
  [line] = quiet(p.stderr)
  assert line.startswith("error: cannot create the workdir lock gs://nobucket/run/run.lock: ") and "nobucket" in line


def test_a_server_gone_mid_run_is_one_line_and_the_last_checkpoint_survives(shared_data, tmp_path):
  """The server is killed while the run saves every 20 steps: the run exits 1 with one error line naming the
  checkpoint directory, right after it (no exit-time upload retried for minutes, no traceback), the lock, metrics.jsonl
  and TensorBoard failing with it folded into that line (storage.hold); a restarted server still has the completed
  steps, and the run resumes from the last."""
  (tmp_path / "data" / "testbucket").mkdir(parents=True)
  port, root = free_port(), tmp_path / "root"
  args = [*flags("clm", shared_data, checkpoint_every=20, log_every=20, eval_every=10**6), "--config.total_steps=400",
          "--config.storage_retry_s=20", "--workdir=gs://testbucket/k"]
  server = start_gcs(tmp_path / "data", port, root)
  out, err = tmp_path / "stdout", tmp_path / "stderr"
  with open(out, "w") as o, open(err, "w") as e:
    run = subprocess.Popen([sys.executable, "-m", "lm_jax.main", *args], cwd=REPO, stdout=o, stderr=e,
                           env={**os.environ, **gcs_env(port)})
  try:
    # a save waits for the one before it: at step 60 the save of step 40 has begun, so step 20 is complete
    assert _wait_for(out, "step 60/", 300), out.read_text()[-3000:]
    server.kill()
    server.wait()
    assert _wait_for(err, "error: ", 420), err.read_text()[-3000:]
    run.wait(timeout=60)   # the lock's last renewal and release time out within 40 s
  finally:
    run.kill()
    run.wait()
  # orbax's own note when a save waits over a second for the one before (a loaded machine's): not lm_jax's lines
  lines = [line for line in quiet(err.read_text()) if "] Waiting for previous save to complete took" not in line]
  errors = [line for line in lines if line.startswith("error: ")]
  assert len(errors) == 1 and errors[0].startswith("error: saving a checkpoint in gs://testbucket/k/checkpoints "
                                                   "failed: "), errors
  assert run.returncode == 1 and lines == errors, lines
  server = start_gcs(tmp_path / "data", port, root)
  try:
    resumed = cli(*[a.replace("total_steps=400", "total_steps=81") for a in args], env=gcs_env(port))
  finally:
    server.kill()
    server.wait()
  assert resumed.returncode == 0, resumed.stdout[-1500:] + resumed.stderr[-3000:]
  assert re.search(r"resumed step (20|40|60) from gs://testbucket/k/checkpoints", resumed.stdout), resumed.stdout


def test_a_step_whose_save_never_finished_is_removed_at_start(gcs_server, capsys):
  """A bucket step folder without orbax's commit_success.txt (a run stopped mid-save) is removed when a run opens the
  checkpoints, so its resumed save of that step number starts clean; a finished step stays, a reader removes nothing."""
  from lm_jax import checkpoint
  root = "gs://testbucket/partial/checkpoints"
  for name in ("3/commit_success.txt", "3/state/x", "6/config/x", "6/data/x"):
    storage.gcs_blob(f"{root}/{name}").upload_from_string("x")
  checkpoint.manager("gs://testbucket/partial", 2, read_only=True)
  assert storage.exists(f"{root}/6/config/x")
  checkpoint.manager("gs://testbucket/partial", 2)
  assert storage.exists(f"{root}/3/state/x") and not storage.exists(f"{root}/6/config/x")
  assert f"warning: removing {root}/6: a save that never finished" in capsys.readouterr().err


def test_a_reader_lists_afresh_the_steps_a_trainer_saved_and_deleted(gs_run):
  """A reader's step listing is read again, not kept: after an evaluator listed step 6, a trainer beside it saves step
  9 and deletes step 6 (here by the GCS client, behind this process's caches), and the evaluator reads step 9. It
  used to keep the listing fsspec had cached (a CI run ended 'no readable checkpoint ... move the directory away')."""
  from lm_jax import checkpoint
  source, root = f"{gs_run['workdir']}/checkpoints/6", "gs://testbucket/relisted/checkpoints"
  for url in storage.find(source):
    storage.gcs_blob(url.replace(source, f"{root}/6")).upload_from_string(storage.gcs_blob(url).download_as_bytes())
  mngr = checkpoint.manager("gs://testbucket/relisted", 2, read_only=True)
  assert mngr.all_steps() == [6] and checkpoint.read_config(mngr) is not None   # step 6 listed and read: cached
  for url in storage.find(f"{root}/6"):
    blob = storage.gcs_blob(url)
    storage.gcs_blob(url.replace(f"{root}/6", f"{root}/9")).upload_from_string(blob.download_as_bytes())
    blob.delete()
  assert checkpoint.read_config(mngr)["total_steps"] == 6 and mngr.all_steps() == [9]


def test_a_failed_listing_never_starts_the_run_over(tmp_path, monkeypatch):
  """A checkpoints folder the storage fails to list is an error, not an empty folder: epath's exists() says False on
  any error, orbax then lists no step, and the run started over from step 0 (seen when a killed server left a file
  that failed every listing of its folder). At the manager's start and when orbax's own listing comes back empty."""
  from lm_jax import checkpoint
  (tmp_path / "data" / "testbucket").mkdir(parents=True)
  port, root = free_port(), tmp_path / "root"
  server = start_gcs(tmp_path / "data", port, root)
  import gcsfs
  for k, v in gcs_env(port).items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(storage, "_CLIENT", None)   # the clients of this server, not the session's
  gcsfs.GCSFileSystem.clear_instance_cache()
  try:
    folder = "gs://testbucket/t/checkpoints"
    for name in ("3/commit_success.txt", "3/state/x"):
      storage.gcs_blob(f"{folder}/{name}").upload_from_string("x")
    mngr = checkpoint.manager("gs://testbucket/t", 2, read_only=True)
    (root / "testbucket/t/checkpoints/3/state/torn").write_bytes(b"cut off")   # no metadata: its listings fail
    with pytest.raises(storage.StorageError, match=f"^cannot list the checkpoints in {folder}: .*; not starting over"):
      checkpoint.manager("gs://testbucket/t", 2)
    os.unlink(root / "testbucket/t/checkpoints/3/state/torn")
    mngr.all_steps = lambda: []      # orbax's listing failing a moment after ours succeeds
    with pytest.raises(storage.StorageError, match=f"^listing {folder} failed: orbax found no step, the storage "
                                                   "holds the finished steps 3; not starting over them"):
      checkpoint.restore_latest(mngr, None, None, None, with_data=False)
  finally:
    gcsfs.GCSFileSystem.clear_instance_cache()
    server.kill()
    server.wait()


def _wait_for(path: pathlib.Path, text: str, timeout_s: float) -> bool:
  """Whether `text` appears in the file within timeout_s."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if text in path.read_text():
      return True
    time.sleep(0.5)
  return False


def test_tpu_vm_setup_installs_what_gs_needs():
  """launch/tpu_vm.py setup installs requirements.txt, which holds gcsfs (epath's gs://) and google-cloud-storage
  (the lock, TensorBoard)."""
  p = subprocess.run([sys.executable, "launch/tpu_vm.py", "setup", "--name=x", "--zone=z", "--dry-run"], cwd=REPO,
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 0, p.stderr
  assert "-r ~/lm_jax/requirements.txt" in p.stdout + p.stderr
  names = {re.split(r"[<>=\[ #]", line, maxsplit=1)[0].lower()
           for line in (REPO / "requirements.txt").read_text().splitlines() if line.strip()}
  assert {"gcsfs", "google-cloud-storage"} <= names


# ---------------------------------------------------------------------------------------------------- data paths
BUCKET = "gs://testbucket/corpus"


def upload(local: pathlib.Path, url: str):
  """Every file under `local` to the prefix `url`."""
  fs = storage._fs(url)
  for f in sorted(p for p in local.rglob("*") if p.is_file()):
    fs.put_file(str(f), f"{url}/{f.relative_to(local)}")


@pytest.fixture(scope="module")
def corpus(gcs_server, shared_data, tmp_path_factory):
  """WikiText-2 valid's first documents in every format records.py reads, on a local disk and under BUCKET."""
  import gzip

  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard
  from lm_jax.data import records
  d = tmp_path_factory.mktemp("corpus")
  texts = list(records.read("valid", "text", files=str(shared_data / "wikitext-2-raw" / "wiki.valid.raw"),
                            documents=True, origin="o", named_by="n"))[:120]
  data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode() + b"not json\n"
  (d / "sub").mkdir()
  cut = data.index(b"\n", len(data) // 2) + 1
  (d / "c.jsonl").write_bytes(data[:cut])
  (d / "sub" / "d.jsonl").write_bytes(data[cut:])
  (d / "c.jsonl.gz").write_bytes(gzip.compress(data))
  (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
  (d / "c.txt").write_text("\n\n".join(texts[:60]))
  table = pa.table({"text": texts})
  pq.write_table(table, d / "c.parquet", row_group_size=50)
  write_arrow_dir(d / "arrow", table, 50)
  upload(d, BUCKET)
  return d, texts


@pytest.mark.parametrize("name", ["c.txt", "**/*.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet", "arrow"])
def test_every_format_reads_the_same_records_from_a_bucket(corpus, name, monkeypatch, tmp_path):
  """A gs:// glob reads the records of the same files on a local disk, with the same tally; where() names the URL."""
  from lm_jax.data import records
  monkeypatch.setenv("LM_JAX_SPILL_DIR", str(tmp_path / "spill"))
  d, texts = corpus
  read = lambda files: records.read("train", "text", files=files, documents=True, origin="config.data.files",
                                    named_by="config.data.text_field")
  local, remote = read(f"{d}/{name}"), read(f"{BUCKET}/{name}")
  assert list(remote) == list(local) and [t for t in remote if t in texts]
  assert len(remote) == (60 if name == "c.txt" else 120 + (name != "c.parquet" and name != "arrow"))
  assert [remote.where(i) for i in range(len(remote))] == [local.where(i).replace(str(d), BUCKET)
                                                         for i in range(len(local))]
  screen = lambda r: records.screen(r, lambda x: None).report()
  assert screen(remote) == screen(local).replace(str(d), BUCKET)


def test_a_bucket_glob_matching_nothing_is_the_local_error(corpus):
  from lm_jax.data import records
  d, _ = corpus
  for root in (str(d), BUCKET):
    with pytest.raises(FileNotFoundError, match=f"^config.data.files: no files match {root}/none\\*.txt$"):
      records.read("train", "text", files=f"{root}/none*.txt", origin="config.data.files", named_by="n")
  with pytest.raises(storage.StorageError, match="^bucket gs://nobucket of gs://nobucket/x.txt does not exist"):
    records.read("train", "text", files="gs://nobucket/x.txt", origin="config.data.files", named_by="n")


def test_a_mixture_of_bucket_globs_trains_as_the_same_local_files(corpus, shared_data, tmp_path):
  """Two steps of a mixture of gs:// sources (a spilled .jsonl.gz, a recursive glob of .jsonl) log the losses of the
  same mixture read from a local disk."""
  d, _ = corpus
  args = [*flags("clm", shared_data, log_every=1, eval_every=2), "--config.total_steps=2", "--config.data.files="]
  runs = {}
  for root in (BUCKET, str(d)):
    mix = (dict(name="gz", files=f"{root}/c.jsonl.gz"), dict(name="json", files=f"{root}/**/*.jsonl", weight=2.0))
    workdir = tmp_path / root.replace("/", "_").replace(":", "")
    runs[root] = cli(*args, f"--config.data.mixture={mix!r}", f"--workdir={workdir}",
                     env={"LM_JAX_SPILL_DIR": str(tmp_path / "spill")})
    # the eval reads each source's held-out tail, which ends in the corpus' one malformed record
    lines = quiet(runs[root].stderr)
    assert runs[root].returncode == 0 and len(lines) == 2, runs[root].stderr[-3000:]
    assert all("1 malformed of 13 records" in line and "not JSON" in line for line in lines), lines
    runs[root] = workdir
  same_records(records(str(runs[BUCKET])), records(str(runs[str(d)])))
  same_records(records(str(runs[BUCKET]), "eval"), records(str(runs[str(d)]), "eval"))


def test_a_fine_tune_from_a_bucket_workdir_on_bucket_task_files(gs_run, shared_data, tmp_path):
  """configs/finetune/gpt1.py:tiny from the gs:// run's checkpoint and tokenizer, on SST-2 .tsv files in the bucket,
  logs the losses of the same fine-tune on the local files."""
  task = tmp_path / "sst2"
  task.mkdir()
  for split, n in (("train", 200), ("dev", 40)):
    lines = (shared_data / "sst2" / f"{split}.tsv").read_text().splitlines(keepends=True)[:n]
    (task / f"{split}.tsv").write_text("".join(lines))
  upload(task, "gs://testbucket/sst2")
  args = ["--config=configs/finetune/gpt1.py:tiny", f"--config.init_from={gs_run['workdir']}", "--config.batch_size=8",
          "--config.data.seq_len=32", "--config.total_steps=2", "--config.log_every=1", "--config.eval_every=2",
          "--config.data.train_split=train", "--config.data.eval_split=dev[:16]"]
  runs = {}
  for files in ("gs://testbucket/sst2/{split}.tsv", str(task / "{split}.tsv")):
    runs[files] = p = cli(*args, f"--config.task.files={files}", f"--workdir={tmp_path / str(len(runs))}")
    assert p.returncode == 0 and quiet(p.stderr) == [], p.stderr[-3000:]
  same_records(records(str(tmp_path / "0")), records(str(tmp_path / "1")))
  same_records(records(str(tmp_path / "0"), "eval"), records(str(tmp_path / "1"), "eval"))


def test_prompts_file_and_tokenizer_in_a_bucket(gs_run, tmp_path):
  """--mode=generate with --prompts_file and config.data.tokenizer on gs:// prints what the same prompts and
  tokenizer on a local disk give."""
  [model] = [u for u in storage.list_files(gs_run["workdir"]) if u.endswith(".model")]
  (tmp_path / "prompts.txt").write_text("ROMEO:\n\nJULIET: O\n")
  (tmp_path / "tok.model").write_bytes(storage.path(model).read_bytes())
  upload(tmp_path, "gs://testbucket/inputs")
  out = {}
  for root in ("gs://testbucket/inputs", str(tmp_path)):
    p = cli(*gs_run["args"], "--config.total_steps=6", "--mode=generate", f"--workdir={gs_run['local']}",
            f"--prompts_file={root}/prompts.txt", f"--config.data.tokenizer={root}/tok.model", "--max_new_tokens=3")
    assert p.returncode == 0 and quiet(p.stderr) == [], p.stderr[-3000:]
    out[root] = p.stdout
  assert out["gs://testbucket/inputs"] == out[str(tmp_path)] and "JULIET: O" in out[str(tmp_path)]
  missing = cli(*gs_run["args"], "--mode=generate", f"--workdir={gs_run['local']}",
                "--prompts_file=gs://testbucket/inputs/none.txt")
  assert missing.returncode == 1 and quiet(missing.stderr) == [
      "error: [Errno 2] No such file or directory: 'gs://testbucket/inputs/none.txt'"], missing.stderr


def test_a_hugging_face_tokenizer_folder_in_a_bucket(gcs_server, tmp_path):
  """A WordPiece vocab.txt folder (with its tokenizer_config.json) loads from gs:// as from a local disk; .path is
  the URL."""
  from lm_jax.data import tokenizer as tokenizer_lib
  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "##s", "on", "mat"]
  (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
  (tmp_path / "model.safetensors").write_bytes(b"not read")
  upload(tmp_path, "gs://testbucket/hf_tok")
  local, remote = (tokenizer_lib.load(p, models.family("bert")) for p in (str(tmp_path), "gs://testbucket/hf_tok"))
  assert remote.encode("The cats sat") == local.encode("The cats sat") == [5, 6, 8, 7]
  assert remote.serialized == local.serialized and remote.path == "gs://testbucket/hf_tok/vocab.txt"
  with pytest.raises(FileNotFoundError, match="^config.data.tokenizer: gs://testbucket/none does not exist$"):
    tokenizer_lib.load("gs://testbucket/none", models.family("bert"))
  with pytest.raises(ValueError, match="^tokenizer gs://testbucket/hf_tok/vocab.txt: a t5 tokenizer needs <extra_id"):
    tokenizer_lib.load("gs://testbucket/hf_tok", models.family("t5"))


def test_a_lora_adapter_in_a_bucket(gcs_server, tmp_path):
  """config.lora.init_from on gs:// loads the adapters of the same PEFT directory on a local disk."""
  from test_lora import random_params, run_config

  from lm_jax.peft import lora
  config = run_config("gpt")
  lora.save(config, random_params(config), str(tmp_path / "adapter"))
  upload(tmp_path / "adapter", "gs://testbucket/adapter")
  config.lora.init_from = "gs://testbucket/adapter"
  lora.check(config)
  jax.tree.map(np.testing.assert_array_equal, lora.load(config, "gs://testbucket/adapter"),
               lora.load(config, str(tmp_path / "adapter")))
  config.lora.init_from = "gs://testbucket/none"
  with pytest.raises(FileNotFoundError, match="^config.lora.init_from='gs://testbucket/none': no adapter_config"):
    lora.check(config)


# ------------------------------------------------------------------------------------- credentials and permission
def _cli_without_gcs_env(*args, **env):
  """The CLI with none of the gcs_server fixture's emulator variables, plus `env`."""
  base = {k: v for k, v in os.environ.items() if k not in gcs_env(0) and k != "GOOGLE_APPLICATION_CREDENTIALS"}
  return subprocess.run([sys.executable, "-m", "lm_jax.main", *args], cwd=REPO, capture_output=True, text=True,
                        env={**base, **env}, timeout=300)


@pytest.mark.parametrize("where", ["data", "workdir"])
def test_missing_credentials_are_one_line_at_start(shared_data, tmp_path, where):
  """No STORAGE_EMULATOR_HOST and no Application Default Credentials (HOME and gcloud's config empty, no metadata
  server looked for): the run stops at its first gs:// path, in one line naming it, and creates nothing."""
  if where == "data":
    args, named = ["--config.data.files=gs://testbucket/x.txt", f"--workdir={tmp_path / 'run'}"], "gs://testbucket/x.txt"
  else:
    args, named = ["--workdir=gs://testbucket/run"], "gs://testbucket/run/run.lock"
  p = _cli_without_gcs_env(*flags("clm", shared_data), "--config.total_steps=2", *args, HOME=str(tmp_path),
                           CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), NO_GCE_CHECK="true")
  assert p.returncode == 1
  assert p.stderr.splitlines() == [f"error: {named}: no Google Cloud credentials (run `gcloud auth "
                                   "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or run on a VM "
                                   "with a service account)"], p.stderr[-3000:]
  assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture
def refusing_server():
  """A local HTTP server that answers 403 (GCS's JSON error) to every request: storage that refuses permission."""
  import http.server
  import threading

  class Refuse(http.server.BaseHTTPRequestHandler):
    def _refuse(self):
      body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.list access"}})
      self.send_response(403)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body.encode())

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _refuse

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("localhost", 0), Refuse)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  yield f"http://localhost:{server.server_address[1]}"
  server.shutdown()


@pytest.mark.parametrize("where", ["data", "workdir"])
def test_a_permission_refusal_is_one_line_at_start(shared_data, tmp_path, refusing_server, where):
  if where == "data":
    args, start = ["--config.data.files=gs://testbucket/x.txt", f"--workdir={tmp_path / 'run'}"], \
        "error: gs://testbucket/x.txt: permission denied"
  else:
    args, start = ["--workdir=gs://testbucket/run"], "error: cannot create the workdir lock gs://testbucket/run/run.lock: 403 "
  p = _cli_without_gcs_env(*flags("clm", shared_data), "--config.total_steps=2", *args,
                           STORAGE_EMULATOR_HOST=refusing_server)
  assert p.returncode == 1
  [line] = quiet(p.stderr)
  assert line.startswith(start), p.stderr[-3000:]


# ------------------------------------------------------------------------- kill -9, several processes, W&B
# The trainer, killed by SIGKILL from inside its own process as soon as step 60's record is written: a poll from outside
# raced the tiny run (the fresh-venv CI saw it finish all 100 steps before the poll read step 60).
_KILLED_AT_60 = """
import os, runpy, signal, sys
from lm_jax.obs import metrics_log
write = metrics_log.MetricsLog.write
def write_then_die(self, record):
  write(self, record)
  if record.get("step", 0) >= 60:
    os.kill(os.getpid(), signal.SIGKILL)
metrics_log.MetricsLog.write = write_then_die
sys.argv = ["lm_jax.main", *sys.argv[1:]]
runpy.run_module("lm_jax.main", run_name="__main__")
"""


def test_kill_9_then_resume_is_bit_identical_to_an_uninterrupted_run(gcs_server, shared_data, tmp_path):
  """A gs:// run killed with SIGKILL once step 60 is logged (a checkpoint every 7 steps, so maybe mid-save) resumes
  to the records of the same run uninterrupted on a local disk, every loss exact."""
  args = flags("clm", shared_data, log_every=1, eval_every=50, checkpoint_every=7, **{"optimizer.lr": 1e-2})
  args += ["--config.total_steps=100"]
  killed = subprocess.run([sys.executable, "-c", _KILLED_AT_60, *args, "--workdir=gs://testbucket/killed"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert max(r["step"] for r in metrics_log.read("gs://testbucket/killed/metrics.jsonl")) == 60
  resumed = cli(*args, "--workdir=gs://testbucket/killed")
  reference = cli(*args, f"--workdir={tmp_path / 'local'}")
  for p in (resumed, reference):
    assert p.returncode == 0, p.stderr[-3000:]
  # a save waits for the one before it: once step 60 is logged, step 56's save has begun, so step 49 is complete
  resumed_step = re.search(r"resumed step (\d+) from gs://testbucket/killed/checkpoints", resumed.stdout)
  assert resumed_step and int(resumed_step[1]) % 7 == 0 and int(resumed_step[1]) >= 49, resumed.stdout
  same_records(records("gs://testbucket/killed"), records(str(tmp_path / "local")))
  same_records(records("gs://testbucket/killed", "eval"), records(str(tmp_path / "local"), "eval"))


def test_two_processes_on_a_bucket_workdir_log_the_records_of_one(gcs_server, shared_data, tmp_path):
  """launch/local.sh 2 (2 processes x 4 CPU devices) training into gs:// logs the losses of 1 process x 8 devices
  on a local disk."""
  overrides = {"data.files": shared_data / "tiny_shakespeare" / "input.txt", "data.tfds_name": "", "total_steps": 6,
               "checkpoint_every": 3, "log_every": 1, "eval_every": 0, "batch_size": 8, "data.seq_len": 32,
               "data.shards": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "model.vocab_size": 256}
  args = ["--config=configs/gpt1.py:tiny", *(f"--config.{k}={v}" for k, v in overrides.items())]
  env = lambda devices: dict(os.environ, JAX_PLATFORMS="cpu", LM_JAX_DEVICES_PER_PROCESS=str(devices),
                             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONPATH=str(REPO),
                             LM_JAX_LOG_DIR=str(tmp_path / "logs"))
  two = subprocess.run([str(REPO / "launch" / "local.sh"), "2", *args, "--workdir=gs://testbucket/two"], cwd=REPO,
                       env=env(4), capture_output=True, text=True, timeout=600)
  logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
  assert two.returncode == 0, logs
  one = subprocess.run([sys.executable, "-m", "lm_jax.main", *args, f"--workdir={tmp_path / 'one'}"], cwd=REPO,
                       env=env(8), capture_output=True, text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  got, expected = records("gs://testbucket/two"), records(str(tmp_path / "one"))
  assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, 7))
  for x, y in zip(got, expected):
    assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x, y)
  assert {u.rsplit("/", 2)[1] for u in storage.find("gs://testbucket/two/checkpoints")} >= {"3", "6"}


def test_wandb_offline_with_a_bucket_workdir(gcs_server, shared_data, tmp_path):
  """W&B (offline) beside a gs:// workdir: its files go to WANDB_DIR (a local folder; W&B writes no bucket), its run
  id is kept in the bucket, and the offline run holds exactly the records of metrics.jsonl."""
  from test_wandb import _offline_run
  workdir = "gs://testbucket/wandb"
  p = cli(*flags("clm", shared_data, log_every=2, **{"wandb.project": "lm_jax_test"}), "--config.total_steps=4",
          f"--workdir={workdir}", env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)})
  assert p.returncode == 0, p.stderr[-3000:]   # stderr: W&B's own offline lines, as with a local workdir
  [run_dir] = sorted((tmp_path / "wandb").glob("offline-run-*"))
  run = _offline_run(run_dir)
  assert run["id"] == storage.path(f"{workdir}/wandb_run_id").read_text()
  assert run["history"] == metrics_log.read(f"{workdir}/metrics.jsonl") and len(run["history"]) >= 2

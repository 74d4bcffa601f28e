"""A hostile user's data (issue 44): data.workers killed or interrupted, too many workers, corrupt corpus files, bad
records, and data.files without {split}. Each case runs `python -m lm_jax.main` as a user would, or reads the
pipeline in-process where what is checked is the data itself."""
import gzip
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli, flags, load_config, records, write_arrow_dir
from lm_jax.data import sources


def one_line(result, code: int, *words: str) -> str:
  """The single stderr line of a run that exited with `code`, holding every one of `words`."""
  lines = result.stderr.strip().splitlines()
  assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
  assert all(w in lines[0] for w in words), lines[0]
  return lines[0]


def _start(workdir: pathlib.Path, *args) -> subprocess.Popen:
  """The CLI in its own process group (a Ctrl-C at a terminal reaches the whole group), stdout to a file."""
  return subprocess.Popen([sys.executable, "-m", "lm_jax.main", *args, f"--workdir={workdir}"], cwd=REPO,
                          stdout=open(f"{workdir}.out", "w"), stderr=subprocess.PIPE, text=True,
                          start_new_session=True)


def _wait_for(run: subprocess.Popen, workdir: pathlib.Path, text: str, timeout: float = 600) -> str:
  """The run's stdout once it holds `text`."""
  end = time.monotonic() + timeout
  while text not in (out := pathlib.Path(f"{workdir}.out").read_text()):
    assert run.poll() is None and time.monotonic() < end, (run.poll(), out[-2000:], run.stderr.read()[-3000:])
    time.sleep(0.2)
  return out


def _workers(run: subprocess.Popen) -> list[int]:
  """The pids of the run's data worker processes (multiprocessing's spawned children)."""
  found = subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split()
  return [int(pid) for pid in found if b"spawn_main" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()]


def _end(run: subprocess.Popen, workdir: pathlib.Path, within: float = 90):
  """(exit code, stdout, stderr) of a run that must end within `within` seconds (else it hung: killed, failed)."""
  try:
    _, err = run.communicate(timeout=within)
  except subprocess.TimeoutExpired:
    os.killpg(run.pid, signal.SIGKILL)
    run.communicate()
    pytest.fail(f"the run hung: still running {within}s later")
  return run.returncode, pathlib.Path(f"{workdir}.out").read_text(), err


@pytest.fixture(scope="module")
def jsonl(shared_data, tmp_path_factory) -> pathlib.Path:
  """Tiny Shakespeare's documents as .jsonl, every 20th line not JSON."""
  docs = [d for d in (shared_data / "tiny_shakespeare" / "input.txt").read_text().split("\n\n") if d.strip()]
  lines = ["not json" if i % 20 == 7 else json.dumps({"text": d}) for i, d in enumerate(docs)]
  path = tmp_path_factory.mktemp("jsonl") / "corpus.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return path


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="data.workers needs 2 CPUs (capped at 1)")


@two_cpus
def test_bad_records_are_counted_as_they_go_and_a_killed_worker_stops_in_one_line(shared_data, jsonl, tmp_path):
  """Bad records are counted in every log line and train record (not only at an epoch's end, which a real corpus
  never reaches); a data worker killed with -9 (the OOM killer) ends the run in one line, exit 1, where it used to
  leave the trainer waiting for ever with SIGTERM and Ctrl-C ignored."""
  workdir = tmp_path / "w"
  run = _start(workdir, *flags("clm", shared_data, total_steps=100_000, log_every=2, eval_every=0,
                               **{"data.files": jsonl, "data.workers": 2}))
  out = _wait_for(run, workdir, "step 4/")
  assert "bad records skipped" in out.splitlines()[-1], out[-1000:]
  assert all(r["bad_records"] > 0 for r in records(workdir))
  (worker, *_), at = _workers(run), time.monotonic()
  os.kill(worker, signal.SIGKILL)
  code, out, err = _end(run, workdir)
  one_line(subprocess.CompletedProcess([], code, out, err), 1, f"data worker 0 (pid {worker}) died (signal 9)",
           "rerun the command to resume")
  assert time.monotonic() - at < 60


@two_cpus
def test_ctrl_c_to_the_process_group_saves_and_exits_with_workers_capped_at_the_cpus(shared_data, tmp_path):
  """Ctrl-C at a terminal reaches the trainer and its workers: the trainer saves and exits 0 at once, with no worker
  tracebacks (it used to hang at exit until a second Ctrl-C). data.workers above the CPU count is capped, with one
  warning. data.files without {split} holds out its eval, saying so."""
  workdir, cpus = tmp_path / "w", len(os.sched_getaffinity(0))
  run = _start(workdir, *flags("clm", shared_data, total_steps=100_000, log_every=2, eval_every=0,
                               **{"data.workers": 64}))
  out = _wait_for(run, workdir, "step 4/")
  assert 1 < len(_workers(run)) <= cpus
  assert "data.files has no {split}: training on the first 90% of its documents, evaluating on the last 10%" in out
  os.killpg(run.pid, signal.SIGINT)
  code, out, err = _end(run, workdir, within=60)
  warning = one_line(subprocess.CompletedProcess([], code, out, err), 0, "data.workers=64",
                     f"the {cpus} CPUs", f"tokenizing in {cpus} worker processes")
  assert "Traceback" not in out + err, warning
  saved = int(out.split("SIGINT: saved step ")[1].split(",")[0])
  assert (workdir / "checkpoints" / str(saved)).is_dir()


def _flipped(data: bytes) -> bytes:
  middle = len(data) // 2
  return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:]


def _damaged(kind: str, folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """(data.files, the damaged file) of one kind of damage."""
  import pyarrow as pa
  import zstandard
  lines = "".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(3000)).encode()
  if kind == "gzip":
    (folder / "c.jsonl.gz").write_bytes(_flipped(gzip.compress(lines)))
    return folder / "c.jsonl.gz", folder / "c.jsonl.gz"
  if kind == "zstd":
    (folder / "c.jsonl.zst").write_bytes(_flipped(zstandard.ZstdCompressor().compress(lines)))
    return folder / "c.jsonl.zst", folder / "c.jsonl.zst"
  write_arrow_dir(folder / "ds", pa.table({"text": [f"document {i} " * 30 for i in range(3000)]}), 100)
  torn = folder / "ds" / ("state.json" if kind == "state.json" else "data-00000-of-00001.arrow")
  torn.write_bytes(torn.read_bytes()[:torn.stat().st_size // 2])
  return folder / "ds", torn


@pytest.mark.parametrize("kind", ["gzip", "zstd", "arrow", "state.json"])
def test_a_damaged_corpus_file_is_one_line_naming_it(shared_data, tmp_path, kind):
  files, damaged = _damaged(kind, tmp_path)
  result = cli(*flags("clm", shared_data, **{"data.files": files}), f"--workdir={tmp_path / 'w'}",
               env={"LM_JAX_SPILL_DIR": str(tmp_path / "spill")})
  one_line(result, 1, str(damaged), "damaged", "replace the file")


def test_data_files_without_split_hold_out_the_eval(shared_data):
  """The README's first command names one file: its eval reads the last 10% of the documents, not the training
  text; an explicit data.split_fraction moves the cut."""
  def split(**overrides):
    c = load_config("clm", shared_data, **overrides)
    return [list(sources.documents(c, s)) for s in (c.data.train_split, c.data.eval_split, "train[:]")]
  train, held_out, everything = split()
  cut = int(0.9 * len(everything))
  assert (train, held_out) == (everything[:cut], everything[cut:]) and not set(train) & set(held_out)
  train, held_out, _ = split(**{"data.split_fraction": 0.5})
  assert (train, held_out) == (everything[:len(everything) // 2], everything[len(everything) // 2:])

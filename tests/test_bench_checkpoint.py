"""bench/checkpoint_stall.py --quick runs (so that the bench cannot rot silently): saves to a local disk and to
fake-gcs-server each report a stall and a write, and the metrics segments upload each record once."""
import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_checkpoint_stall_quick(tmp_path):
  from conftest import gcs_binary
  gcs_binary()   # skips without fake-gcs-server
  out = tmp_path / "out.json"
  done = subprocess.run([sys.executable, str(REPO / "bench" / "checkpoint_stall.py"), "--quick", "--saves=2",
                         f"--json={out}"], capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["state_bytes"] > 1e8
  for where in ("local", "gcs"):
    assert len(r[where]["stalls_s"]) == 2 and r[where]["stall_s"] > 0 and r[where]["write_s"] > 0
  m = r["metrics"]
  assert m["records"] == m["segments"] == 200 and m["segment_bytes"] == round(m["record_bytes"] * 200)
  assert m["rewrite_bytes"] > 50 * m["segment_bytes"]
  assert "gcs / local: stall x" in done.stdout and "whole rewrites" in done.stdout

"""bench/data_throughput.py --quick runs (so that the bench cannot rot silently): every objective, on the fly with 1
and 2 workers and prepared, gives a rate."""
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_data_throughput_quick(tmp_path):
  out = tmp_path / "rows.json"
  done = subprocess.run([sys.executable, str(REPO / "bench" / "data_throughput.py"), "--quick", f"--json={out}",
                         f"--workdir={tmp_path}"], capture_output=True, text=True, check=False, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.loads(out.read_text())
  assert {(r["case"].split()[0], r["input"], r["workers"]) for r in rows} == {
      (case, kind, w) for case in ("mlm+nsp", "clm", "span") for kind, w in (("on the fly", 1), ("on the fly", 2),
                                                                             ("prepared", 1))}
  assert all(r["tokens_per_s"] > 0
             and r["tokens_per_s_per_process"] * r["processes"] == pytest.approx(r["tokens_per_s"]) for r in rows)
  assert "load average at end" in done.stdout

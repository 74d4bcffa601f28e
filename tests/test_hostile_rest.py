"""A hostile user's leftovers (issue 44): a symbolic link placed where an image or table is written (lm_jax.obs.plot's
curves, the scaling fit's plot, a sweep's results.csv / results.png) is replaced, its target left as it was."""
import hashlib
import json
import subprocess
import sys

import numpy as np

from conftest import REPO
from lm_jax import scaling
from lm_jax.scaling import fit, plot as scaling_plot
from lm_jax.sweep import results

PNG = b"\x89PNG\r\n\x1a\n"


def _linked(tmp_path, name: str):
  """tmp_path/out/NAME, a link to a file outside out/ holding the user's text; returns (link, target, its hash)."""
  (tmp_path / "out").mkdir(exist_ok=True)
  target = tmp_path / f"precious-{name}"
  target.write_text("a user's file, not lm_jax's\n")
  (tmp_path / "out" / name).symlink_to(target)
  return tmp_path / "out" / name, target, hashlib.sha256(target.read_bytes()).hexdigest()


def _replaced(link, target, digest, magic: bytes):
  assert hashlib.sha256(target.read_bytes()).hexdigest() == digest, f"{target} was written through the link"
  assert not link.is_symlink() and link.read_bytes().startswith(magic)
  assert [p.name for p in link.parent.iterdir() if p.name.startswith(".")] == [], "a temporary file was left"


def test_plot_cli_replaces_a_link_at_out(tmp_path):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5 / s}) + "\n"
                                                          for s in range(1, 6)))
  link, target, digest = _linked(tmp_path, "curves.png")
  run = subprocess.run([sys.executable, "-m", "lm_jax.obs.plot", str(tmp_path / "run"), f"--out={link}"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  _replaced(link, target, digest, PNG)


def test_scaling_fit_plot_replaces_a_link(tmp_path):
  n = np.repeat(np.geomspace(1e7, 1e9, 3), 3)
  c = np.tile(np.geomspace(1e17, 1e19, 3), 3)
  d = c / (6 * n)
  runs = {"N": n, "D": d, "C": c, "loss": scaling.CHINCHILLA.loss(n, d)}
  link, target, digest = _linked(tmp_path, "fit.png")
  scaling_plot.plot_fit(runs, fit.fit_approach3(n, d, runs["loss"])[0], None, str(link))
  _replaced(link, target, digest, PNG)


def test_sweep_results_replace_links(tmp_path, monkeypatch):
  rows = [{"trial": f"t{i}", "lr": lr, "seed": s, "final_eval_loss": 3.0 - lr + s / 10, "best_eval_loss": 2.0,
           "steps": 10, "wall_s": 1.0, "status": "done"} for i, (lr, s) in enumerate([(1, 0), (1, 1), (2, 0)])]
  monkeypatch.setattr(results, "read", lambda root, metric: (rows, ["lr", "seed"]))
  csv_link, csv_target, csv_digest = _linked(tmp_path, "results.csv")
  png_link, png_target, png_digest = _linked(tmp_path, "results.png")
  results.collect(str(tmp_path / "out"))
  _replaced(csv_link, csv_target, csv_digest, b"trial,lr,seed,")
  _replaced(png_link, png_target, png_digest, PNG)

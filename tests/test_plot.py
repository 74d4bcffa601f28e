"""python -m lm_jax.obs.plot: the curves of two runs' metrics.jsonl in one PNG."""
import json
import subprocess
import sys

import numpy as np
import pytest
from matplotlib import image

from lm_jax.obs import metrics_log, plot
from conftest import REPO


def _workdir(path, steps, loss_scale):
  """A workdir whose metrics.jsonl holds train records every 10 steps (with `tokens`) and eval records every 50."""
  path.mkdir()
  records = []
  for step in steps:
    loss = loss_scale * 5 / np.sqrt(step)
    records.append({"step": step, "tokens": step * 4096, "loss": loss, "token_loss": loss, "accuracy": 0.1,
                    "tokens_per_sec": 1e4, "step_s": 0.5})
    if step % 50 == 0:
      records.append({"step": step, "eval_loss": loss + 0.1, "eval_token_loss": loss + 0.1,
                      "eval_perplexity": float(np.exp(loss + 0.1)), "eval_accuracy": 0.2,
                      "eval_books_loss": loss + 0.2})   # a data mixture's source
  (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def test_plot_writes_a_png_of_two_runs(tmp_path):
  a = _workdir(tmp_path / "a", range(10, 201, 10), 1.0)
  b = _workdir(tmp_path / "b", range(10, 101, 10), 1.2)
  out = tmp_path / "curves.png"
  run = subprocess.run([sys.executable, "-m", "lm_jax.obs.plot", str(a), str(b), "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and run.stdout.strip() == f"wrote {out}", run.stderr[-2000:]
  height, width, _ = image.imread(out).shape
  assert width > 2 * height > 0
  fig = plot.figure({"a": metrics_log.read(a / "metrics.jsonl"), "b": metrics_log.read(b / "metrics.jsonl")})
  axes = fig.get_axes()
  assert [(ax.get_title(), ax.get_xlabel()) for ax in axes] == [
      (p, x) for x in ("step", "tokens") for p in ("loss", "perplexity", "accuracy", "tokens/s")]
  loss_over_tokens = {line.get_label(): line.get_xdata() for line in axes[4].get_lines()}
  assert list(loss_over_tokens) == ["a: loss", "a: eval_loss", "a: eval_books_loss", "b: loss", "b: eval_loss",
                                    "b: eval_books_loss"]
  np.testing.assert_array_equal(loss_over_tokens["b: eval_loss"], [50 * 4096, 100 * 4096])


def test_plot_says_which_workdir_has_no_records(tmp_path):
  with pytest.raises(SystemExit, match=f"^lm_jax.obs.plot: no records in {tmp_path / 'metrics.jsonl'}$"):
    plot.main([str(tmp_path)])

"""A hostile user's leftovers (issue 44): a symbolic link placed where an image or table is written (lm_jax.obs.plot's
curves, the scaling fit's plot, a sweep's results.csv / results.png) is replaced, its target left as it was; a data
mixture's source without {split} holds out its eval; a resume from a checkpoint made before that split says so; a
gs:// run's storage warnings fold into the line of the save that ends it."""
import hashlib
import json
import subprocess
import sys

import numpy as np

from conftest import REPO
from lm_jax import config_lib, models, objectives, scaling, storage
from lm_jax.data import mixture, pipeline, sources, tokenizer
from lm_jax.obs import metrics_log
from lm_jax.scaling import plot as scaling_plot
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
  scaling_plot.plot_fit(runs, scaling.CHINCHILLA, None, str(link))   # the law itself stands for a fit
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


def test_a_mixture_source_without_split_holds_out_its_eval(tmp_path, capsys):
  """As data.files without {split}: the source's first 90% of documents train, the last 10% evaluate, said once; a
  source with {split} keeps its files' own splits."""
  (tmp_path / "one.txt").write_text("\n\n".join(f"one document {i}" for i in range(20)) + "\n")
  for split in ("train", "valid"):
    (tmp_path / f"two.{split}.txt").write_text("\n\n".join(f"two {split} {i}" for i in range(5)) + "\n")
  config = config_lib.load("configs/gpt1.py:tiny", {
      "data.files": "", "data.train_split": "train", "data.eval_split": "valid",
      "data.mixture": (dict(name="one", files=str(tmp_path / "one.txt")),
                       dict(name="two", files=str(tmp_path / "two.{split}.txt")))})
  one, two = mixture.sources(config)
  read = lambda split, source: [sources.documents(config, split, source)[i]
                                for i in range(len(sources.documents(config, split, source)))]
  assert [d.strip() for d in read("train", one)] == [f"one document {i}" for i in range(18)]
  assert [d.strip() for d in read("valid", one)] == [f"one document {i}" for i in (18, 19)]
  assert [d.strip() for d in read("valid", two)] == [f"two valid {i}" for i in range(5)]
  assert capsys.readouterr().out.count("data: config.data.mixture[0].files (one) has no {split}: training on the "
                                       "first 90% of its documents, evaluating on the last 10%") == 1


def test_a_resume_from_a_checkpoint_without_the_held_out_rule_says_its_eval_changed(tmp_path, monkeypatch):
  """A data iterator state saved before data.files without {split} held out an eval has no held_out rule: the
  resume says in one line that the evals before and after it read different text; a state with today's rule says
  nothing. (The lines are recorded where they are said: a line is printed once per process, and an earlier test in
  this process may have printed it.)"""
  said = []
  monkeypatch.setattr(sources, "_say_once", said.append)
  (tmp_path / "text.txt").write_text("\n\n".join(f"document {i} " * 20 for i in range(40)) + "\n")
  c = config_lib.load("configs/gpt1.py:tiny")
  c.data.files, c.data.train_split, c.data.eval_split = str(tmp_path / "text.txt"), "train", "valid"
  c.model.vocab_size, c.data.tokenizer_type, c.data.seq_len, c.batch_size = 256, "char", 32, 8
  tok = tokenizer.load_or_train(c, str(tmp_path), models.family(c.model))
  it = pipeline.make_train_iterator(c, tok, objectives.get("clm"), prefetch=0)
  next(it)
  state = it.get_state()
  assert state["held_out"] == "data.files: the first 90% of its documents train, the rest evaluate"
  said.clear()
  pipeline.make_train_iterator(c, tok, objectives.get("clm"), prefetch=0).set_state(state)
  assert not [line for line in said if "resumed from a checkpoint" in line], said
  old = {k: v for k, v in state.items() if k != "held_out"}
  pipeline.make_train_iterator(c, tok, objectives.get("clm"), prefetch=0).set_state(old)
  [line] = [line for line in said if "resumed from a checkpoint" in line]
  assert line == ("data: resumed from a checkpoint made before files without {split} held out an eval (its evals "
                  "read the training text); now data.files: the first 90% of its documents train, the rest evaluate: "
                  "evals before and after this resume read different text")


def test_storage_warnings_of_a_gs_run_fold_into_the_unreachable_line(monkeypatch, capsys):
  """In a gs:// run (bound_upload_retries) a warning about the workdir's storage is held: a save failing with
  Unreachable then ends its one line with it, and nothing else is printed; outside such a run warnings print at
  once. tests/test_gcs.py kills a real server mid-run."""
  monkeypatch.setattr(storage, "_HOLD_S", None)
  metrics_log.warn("cannot write gs://b/run/metrics.jsonl (refused)", remote=True)
  assert capsys.readouterr().err == "warning: cannot write gs://b/run/metrics.jsonl (refused)\n"
  monkeypatch.setattr(storage, "_HOLD_S", 60.0)
  metrics_log.warn("cannot renew the workdir lock gs://b/run/run.lock: timeout", remote=True)
  metrics_log.warn("TensorBoard stopped (ConnectionError: refused); training goes on without it", remote=True)
  metrics_log.warn("data.workers=64: using 2", remote=False)
  error = storage.Unreachable("saving a checkpoint in gs://b/run/checkpoints failed: refused")
  assert str(error) == ("saving a checkpoint in gs://b/run/checkpoints failed: refused (before it: cannot renew the "
                        "workdir lock gs://b/run/run.lock: timeout; TensorBoard stopped (ConnectionError: refused); "
                        "training goes on without it)")
  storage._release_all()   # as at exit: nothing left held
  assert capsys.readouterr().err == "warning: data.workers=64: using 2\n"

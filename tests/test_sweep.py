"""lm_jax.sweep: a 2 x 2 grid x 2 seeds of tiny runs shared by workers, one of them killed -9 mid-trial (its whole
process group); a rerun that starts nothing; collect's CSV against each trial's metrics.jsonl; the margin by hand;
the grid helpers; bad input in one line before anything compiles."""
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_tokenizer, values
from lm_jax import config_lib
from lm_jax.obs import metrics_log
from lm_jax.sweep import grid, hyper, results

STEPS = 8
# Fields that leave the train step's program alone: every trial loads the one compiled executable from the cache.
GRID = ["--grid=model.initializer_range=0.02,0.05", "--grid=data.shuffle=true,false"]


def sweep_cli(*args, **kwargs):
  return subprocess.run([sys.executable, "-m", "lm_jax.sweep", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=120, **kwargs)


def worker(root, flags, env, log):
  """A worker in a process group of its own (killpg stops it and its trainer)."""
  return subprocess.Popen([sys.executable, "-m", "lm_jax.sweep", "run", "--config=configs/gpt1.py:tiny",
                           f"--root={root}", *GRID, "--seeds=2", *flags], cwd=REPO, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def swept(shared_data, tmp_path_factory):
  """Workers A, B and C on one grid; A killed -9 with its trainer (its process group) once its first trial has a
  checkpoint. Returns (root, {worker: log text}, the killed trial's name, the shared --config flags)."""
  tmp = tmp_path_factory.mktemp("sweep")
  text = tmp / "lines.txt"
  text.write_text("".join((shared_data / "tiny_shakespeare" / "input.txt").read_text().splitlines(True)[:2000]))
  fields = values("clm", shared_data, total_steps=STEPS, eval_every=STEPS, checkpoint_every=2, log_every=1,
                  **{"optimizer.warmup_steps": 0, "data.files": str(text)})
  run_tokenizer(config_lib.load("configs/gpt1.py:tiny", fields), tmp)   # trained once, for every trial
  fields["data.tokenizer"] = str(next(tmp.glob("tokenizer_*.model")))
  flags = [f"--config.{k}={v}" for k, v in fields.items()]
  root = tmp / "root"
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp / "cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
  logs = {name: tmp / f"{name}.log" for name in "ABC"}
  files = {name: open(p, "w") for name, p in logs.items()}
  procs = {name: worker(root, flags, env, f) for name, f in files.items()}
  try:
    deadline, victim = time.time() + 200, None
    while victim is None:
      assert procs["A"].poll() is None and time.time() < deadline, logs["A"].read_text()[-3000:]
      started = re.search(r"sweep: (\S+): start", logs["A"].read_text())
      if started and (root / started[1] / "checkpoints" / "2").is_dir():   # complete: orbax renames it into place
        victim = started[1]
      time.sleep(0.05)
    os.killpg(procs["A"].pid, signal.SIGKILL)
    codes = [procs[name].wait(timeout=300) for name in "ABC"]
  finally:   # a failed test leaves no worker behind
    for proc in procs.values():
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for f in files.values():
      f.close()
  assert codes == [-signal.SIGKILL, 0, 0], logs["B"].read_text()[-3000:]
  return root, {name: p.read_text() for name, p in logs.items()}, victim, flags


def test_workers_share_the_grid_and_finish_a_killed_workers_trial(swept):
  root, logs, victim, _ = swept
  trials = sorted(p.name for p in root.iterdir())
  assert len(trials) == 8 and victim in trials
  done = [line.split(":")[1].strip() for name in "ABC" for line in logs[name].splitlines()
          if line.startswith("sweep: ") and ": done, step" in line]
  assert sorted(done) == trials   # every trial finished exactly once, the killed one included
  assert ": done, step" not in logs["A"] and re.search(r"resumed step [2-7] ", logs["B"] + logs["C"])
  for name in trials:   # no step repeated or lost, the killed trial's included
    train = [r["step"] for r in metrics_log.read(root / name / "metrics.jsonl") if "loss" in r]
    assert train == list(range(1, STEPS + 1)), name
    assert (root / name / "sweep_done.json").is_file()
  assert "0 left" in logs["B"].splitlines()[-1]


def test_a_rerun_starts_nothing(swept):
  root, _, _, flags = swept
  out = sweep_cli("run", "--config=configs/gpt1.py:tiny", f"--root={root}", *GRID, "--seeds=2", *flags)
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines() == [f"sweep: all 8 trials in {root} are finished (8 done, 0 running, 0 failed, "
                                     "0 left); nothing to start"]


def test_collect_reads_each_trials_metrics(swept):
  root = swept[0]
  out = sweep_cli("collect", f"--root={root}", "--target=9.0")
  assert out.returncode == 0, out.stderr
  rows = list(csv.DictReader(open(root / "results.csv")))
  assert len(rows) == 8
  for row in rows:
    recs = metrics_log.read(root / row["trial"] / "metrics.jsonl")
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert float(row["final_eval_loss"]) == evals[-1] and float(row["best_eval_loss"]) == min(evals)
    wall = sum(r.get(k, 0.0) for r in recs for k in metrics_log.TIME_SPLIT)
    assert int(row["steps"]) == STEPS and row["status"] == "done" and float(row["wall_s"]) == round(wall, 3) > 0
    assert {row["model.initializer_range"], row["data.shuffle"], row["seed"]} <= {"0.02", "0.05", "True", "False",
                                                                                   "0", "1"}
  lines = out.stdout.splitlines()
  assert sum("n=2  margin +" in line for line in lines) == 4 and lines[-2].startswith("best: ")
  assert (root / "results.png").stat().st_size > 1000


def test_a_failing_trial_is_retried_then_recorded_with_its_error(tmp_path):
  """A config that its trainer refuses (fast: before the trainer's imports), the worker accepts."""
  config = tmp_path / "refused.py"
  config.write_text(f"import runpy, sys\n\n\ndef get_config(arg='tiny'):\n"
                    f"  if sys.argv[0].endswith('main.py'):\n    raise ValueError('refused by the trainer')\n"
                    f"  return runpy.run_path({str(REPO / 'configs' / 'gpt1.py')!r})['get_config'](arg)\n")
  args = ["run", f"--config={config}:tiny", f"--root={tmp_path / 'root'}", "--seeds=1"]
  out = sweep_cli(*args, "--retries=1")
  assert out.returncode == 1 and out.stdout.count(": start (attempt") == 2, out.stdout + out.stderr
  assert out.stdout.splitlines()[-2].endswith(": attempt 2 failed: refused by the trainer")
  assert out.stdout.splitlines()[-1].startswith("sweep: 0 done, 0 running, 1 failed, 0 left of 1 trials in ")
  record = json.loads(next(tmp_path.glob("root/*/sweep_failed.json")).read_text())
  assert (record["error"], record["attempts"], record["exit_code"]) == ("refused by the trainer", 2, 2)
  again = sweep_cli(*args)
  assert again.stdout.endswith("(0 done, 0 running, 1 failed, 0 left); nothing to start\n") and again.returncode == 1


def test_a_trainer_stopped_alone_stops_its_worker_with_no_retry(tmp_path):
  """A trainer that exits 0 before its last step was stopped by a signal sent to it alone (a scheduler's, a user's
  kill of lm_jax.main) and saved: the worker stops too, with no retry and no failed record, and the trial stays left
  for a later worker. (The trainer here exits 0 at once, before its imports, as a stopped one ends.)"""
  config = tmp_path / "stopped.py"
  config.write_text(f"import runpy, sys\n\n\ndef get_config(arg='tiny'):\n"
                    f"  if sys.argv[0].endswith('main.py'):\n    sys.exit(0)\n"
                    f"  return runpy.run_path({str(REPO / 'configs' / 'gpt1.py')!r})['get_config'](arg)\n")
  args = ["run", f"--config={config}:tiny", f"--root={tmp_path / 'root'}", "--seeds=2"]
  out = sweep_cli(*args)
  assert out.returncode == 0 and out.stdout.count(": start (attempt") == 1, out.stdout + out.stderr
  assert out.stdout.splitlines()[-2].endswith(": stopped at step 0; a worker started later resumes it")
  assert out.stdout.splitlines()[-1].startswith("sweep: stopped; 0 done, 0 running, 0 failed, 2 left of 2 trials in ")
  assert not list(tmp_path.glob("root/*/sweep_failed.json"))


def test_margin_and_groups_by_hand():
  rows = [{"lr": lr, "seed": s, "final_eval_loss": v, "status": "done"}
          for lr, s, v in [(1, 0, 3.0), (1, 1, 3.2), (2, 0, 2.9), (2, 1, 3.0), (3, 0, 1.0)]]
  rows.append({"lr": 3, "seed": 1, "final_eval_loss": 0.5, "status": "unfinished"})
  found = results.groups(rows, ["lr", "seed"], "eval_loss")
  assert [(g["values"], g["n"]) for g in found] == [({"lr": 1}, 2), ({"lr": 2}, 2), ({"lr": 3}, 1)]
  assert found[0]["mean"] == pytest.approx(3.1) and found[0]["sd"] == pytest.approx(math.sqrt(0.02))
  assert results.margin(3.5, [3.0, 3.2]) == pytest.approx(0.4 * math.sqrt(2))   # (3.5 - 3.1) * sqrt(2)
  assert "best: lr=3: 1.0000" in results.table(found, "eval_loss", 3.5)


def test_grid_helpers_and_typed_trials():
  a, b = hyper.sweep("x", [1, 2]), hyper.sweep("y", ["p", "q"])
  assert hyper.product(a, b) == [{"x": 1, "y": "p"}, {"x": 1, "y": "q"}, {"x": 2, "y": "p"}, {"x": 2, "y": "q"}]
  assert hyper.zip(a, b) == [{"x": 1, "y": "p"}, {"x": 2, "y": "q"}]
  assert hyper.chain(a, b) == [{"x": 1}, {"x": 2}, {"y": "p"}, {"y": "q"}]
  trials = grid.trials("configs/gpt1.py:tiny", ["--config.total_steps=6"], ["optimizer.lr=1e-3,2e-3"], 2)
  assert [t.swept for t in trials] == [{"optimizer.lr": lr, "seed": s} for lr in (1e-3, 2e-3) for s in (0, 1)]
  assert trials[0].args == ("--config.total_steps=6", "--config.optimizer.lr=0.001", "--config.seed=0")
  assert trials[0].end == 6 and trials[0].name.startswith("lr0.001_seed0-")
  other = grid.trials("configs/gpt1.py:tiny", ["--config.total_steps=7"], ["optimizer.lr=1e-3"], 1)[0]
  assert other.name.split("-")[0] == trials[0].name.split("-")[0] and other.name != trials[0].name   # another base
  example = grid.trials("configs/gpt1.py:tiny", [], [], None)   # the config file's get_sweep
  assert len(example) > 1 and all("optimizer.lr" in t.swept for t in example)


@pytest.mark.parametrize("flag, message", [
    ("--grid=optimizer.lrr=1e-3", "error: config field 'optimizer.lrr' does not exist; did you mean 'optimizer.lr'?"),
    ("--grid=optimizer.lr=1e-3,fast", "error: config field 'optimizer.lr' expects a float, got 'fast'"),
    ("--grid=optimizer.lr=", "error: --grid=optimizer.lr=: no values (e.g. --grid=optimizer.lr=1e-3,3e-3)"),
    ("--seeds=0", "error: --seeds=0 must be at least 1"),
])
def test_bad_input_is_one_line_before_anything_runs(tmp_path, flag, message):
  out = sweep_cli("run", "--config=configs/gpt1.py:tiny", f"--root={tmp_path / 'root'}", flag)
  assert (out.returncode, out.stderr.splitlines(), out.stdout) == (2, [message], "")
  assert not (tmp_path / "root").exists()


def test_sweep_array_runs_a_worker_with_the_arguments(tmp_path):
  fake = tmp_path / "python"
  fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\n")
  fake.chmod(0o755)
  env = {**os.environ, "PYTHON": str(fake), "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_JOB_ID": "7"}
  script = str(REPO / "launch" / "sweep_array.sbatch")
  subprocess.run(["bash", script, "--config=c.py", "--root=/nfs/s", "--seeds=2"], env=env, check=True, timeout=20,
                 capture_output=True)
  assert (tmp_path / "args").read_text() == "-m lm_jax.sweep run --config=c.py --root=/nfs/s --seeds=2\n"
  missing = subprocess.run(["bash", script, "--config=c.py"], env=env, capture_output=True, text=True, timeout=20)
  assert missing.returncode == 2 and missing.stderr.startswith("sweep_array.sbatch: pass --root=DIR")

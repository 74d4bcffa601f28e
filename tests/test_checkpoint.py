"""Checkpoints: kill -9 and SIGTERM resume to exactly the uninterrupted run; a non-finite loss is never
saved; BERT phase 2 resumes phase 1 with a fresh data iterator; what invalidates an iterator position."""
import os
import random
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lm_jax import checkpoint, metrics_log, train
from test_train import REPO, flags, load_config

STEPS = 150


def _start(workdir, data_dir):
  """The training command in the background; its output goes to workdir.log (a pipe could fill and block)."""
  args = flags("clm", data_dir, total_steps=STEPS, log_every=1, eval_every=50, checkpoint_every=7,
               **{"optimizer.lr": 1e-2})
  log = open(f"{workdir}.log", "a")
  return subprocess.Popen([sys.executable, "-m", "lm_jax.main", *args, f"--workdir={workdir}"], cwd=REPO,
                          stdout=log, stderr=subprocess.STDOUT, text=True)


def _output(proc, workdir, timeout=600):
  """Waits for the process; (return code, its log so far)."""
  proc.wait(timeout=timeout)
  with open(f"{workdir}.log") as f:
    return proc.returncode, f.read()


def _wait_for_step(proc, workdir, step, timeout=600):
  """Blocks until metrics.jsonl has a record at `step` or later; the process must still be running."""
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    recs = metrics_log.read(path)
    if recs and recs[-1]["step"] >= step:
      assert proc.poll() is None, "the run finished before it could be interrupted"
      return
    assert proc.poll() is None, _output(proc, workdir)[1][-3000:]
    time.sleep(0.02)
  raise TimeoutError(f"no step {step} in {path}")


def _comparable(workdir):
  return [{k: v for k, v in r.items() if k not in metrics_log.WALL_CLOCK}
          for r in metrics_log.read(os.path.join(workdir, "metrics.jsonl"))]


def _final_params(workdir):
  return ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(STEPS), "state"))["params"]


def test_sigterm_and_kill_resume_exactly(shared_data, tmp_path):
  rng = random.Random()
  term_at, kill_at = rng.randint(3, 40), rng.randint(50, 100)
  uninterrupted, interrupted = tmp_path / "a", tmp_path / "b"
  a = _start(uninterrupted, shared_data)

  b = _start(interrupted, shared_data)
  _wait_for_step(b, interrupted, term_at)
  b.send_signal(signal.SIGTERM)
  code, out = _output(b, interrupted)
  assert code == 0, out[-3000:]
  saved = int(out.split("SIGTERM: saved step ")[1].split(",")[0])
  assert saved >= term_at and (interrupted / "checkpoints" / str(saved)).is_dir()

  b = _start(interrupted, shared_data)
  _wait_for_step(b, interrupted, kill_at)
  b.kill()  # SIGKILL: no chance to save
  b.wait()
  b = _start(interrupted, shared_data)
  code, out = _output(b, interrupted)
  assert code == 0, out[-3000:]
  assert out.count("resumed step") == 2
  code, out = _output(a, uninterrupted)
  assert code == 0, out[-3000:]

  msg = f"SIGTERM at {term_at}, kill -9 at {kill_at}"
  expected = _comparable(uninterrupted)
  assert len(expected) == STEPS + 3  # a record per step, evals at 50, 100, 150
  assert _comparable(interrupted) == expected, msg
  for x, y in zip(jax.tree.leaves(_final_params(uninterrupted)), jax.tree.leaves(_final_params(interrupted))):
    np.testing.assert_array_equal(x, y, err_msg=msg)


def test_non_finite_loss_is_never_saved(shared_data, tmp_path, monkeypatch):
  make = train.step.make_train_step

  def poisoned(*args, **kwargs):
    real = make(*args, **kwargs)

    def step(state, batch):
      state, metrics = real(state, batch)
      return state, dict(metrics, loss=jnp.where(state["step"] >= 6, jnp.nan, metrics["loss"]))
    return step
  monkeypatch.setattr(train.step, "make_train_step", poisoned)
  config = load_config("clm", shared_data, total_steps=12, log_every=4, eval_every=0, checkpoint_every=2)
  with pytest.raises(FloatingPointError, match="at step 6; not saved. Last good checkpoint: step 4"):
    train.train(config, str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_bert_phase_two_resumes_phase_one(shared_data, tmp_path, capsys):
  phase1 = load_config("mlm", shared_data, total_steps=8, phase_end_step=5, log_every=1, eval_every=0,
                       checkpoint_every=100)
  first = train.train(phase1, str(tmp_path))
  assert first["step"] == 5
  phase2 = load_config("mlm", shared_data, total_steps=8, log_every=1, eval_every=0, checkpoint_every=100,
                       **{"data.seq_len": 64, "data.max_predictions_per_seq": 10})
  second = train.train(phase2, str(tmp_path))
  out = capsys.readouterr().out
  assert "resumed step 5; data config changed (data.max_predictions_per_seq: 5 -> 10; data.seq_len: 32 -> 64)" in out
  assert second["step"] == 8
  recs = metrics_log.read(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7, 8]
  lr = train.optim.schedule(phase2.optimizer, 8)  # one schedule over both phases
  assert [r["lr"] for r in recs] == pytest.approx([float(lr(s - 1)) for s in range(1, 9)], rel=1e-6)


def test_data_changes(shared_data):
  config = load_config("clm", shared_data)
  saved = checkpoint._plain(config)
  assert checkpoint.data_changes(saved, config) == []
  other = load_config("clm", shared_data, **{"data.eval_batches": 5, "total_steps": 9, "data.seq_len": 64,
                                              "batch_size": 16})
  assert checkpoint.data_changes(saved, other) == ["data.seq_len: 32 -> 64", "batch_size: 8 -> 16"]

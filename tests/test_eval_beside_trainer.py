"""An evaluator beside the trainer (t5x / MaxText users run one routinely): --mode=eval on a workdir whose trainer
saves every step and keeps one, so each save deletes the step an eval may have just listed. Every eval must read a
complete step (lm_jax.checkpoint.restore_latest re-lists and takes the next newest) and exit 0."""
import os
import signal
import subprocess
import sys
import time

from conftest import REPO, cli, flags

EVALS = 3   # each one lost the race about 3 times in 5 before the re-list (12 of 20)


def test_evals_beside_a_trainer_saving_every_step(shared_data, tmp_path):
  common = flags("clm", shared_data, checkpoint_every=1, keep_checkpoints=1, log_every=50)
  trainer = subprocess.Popen([sys.executable, "-m", "lm_jax.main", *common, "--config.total_steps=100000",
                              f"--workdir={tmp_path}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
  try:
    deadline = time.monotonic() + 120
    while not any(p.name.isdigit() for p in (tmp_path / "checkpoints").glob("*")):
      assert trainer.poll() is None and time.monotonic() < deadline, trainer.stderr.read()[-2000:]
      time.sleep(0.2)
    runs = [cli(*common, f"--workdir={tmp_path}", "--mode=eval") for _ in range(EVALS)]
    assert trainer.poll() is None, "the trainer stopped while the evals ran"
  finally:
    trainer.send_signal(signal.SIGTERM)   # saves its step and exits 0
    trainer.wait(timeout=120)
  failed = [r.stderr.strip().splitlines()[-1:] for r in runs if r.returncode != 0]
  assert not failed, failed
  assert all("eval_loss" in r.stdout for r in runs)
  assert trainer.returncode == 0, trainer.stderr.read()[-2000:]

"""The loop's schedules: the steps queued on the device before an eval are timed as steps, not as the eval's pause."""
import time

import numpy as np

from lm_jax import train
from conftest import load_config, records


def test_a_slow_eval_does_not_inflate_its_windows_throughput(shared_data, tmp_path, monkeypatch):
  """Windows of 10 steps; the eval at step 19 sleeps 3 s. Its window (steps 11-20) logs the tokens/s of its
  neighbours (2-10, 21-30) within 2x (a loaded, shared CPU): the steps 11-19 still queued when the eval starts ran
  during its sleep, and they count as steps. Timing from the eval's call, the window would report them as free."""
  def slow_evaluator(s):
    def run(params):
      time.sleep(3)
      return {"eval_loss": 1.0}
    return run
  monkeypatch.setattr(train, "make_evaluator", slow_evaluator)
  config = load_config("clm", shared_data, total_steps=30, log_every=10, eval_every=19, checkpoint_every=1000,
                       batch_size=16, **{"model.d_model": 128, "model.num_layers": 2, "model.d_ff": 512,
                                         "data.seq_len": 64})
  train.train(config, str(tmp_path))
  speed = {r["step"]: r["tokens_per_sec"] for r in records(tmp_path)}
  neighbours = np.sqrt(speed[10] * speed[30])
  assert 0.5 < speed[20] / neighbours < 2, speed

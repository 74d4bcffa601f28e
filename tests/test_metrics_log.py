"""metrics_log's observers: a TensorBoard writer failing in its own thread is one warning, not a traceback."""
import threading

from lm_jax.obs import metrics_log


def test_a_tensorboard_thread_failing_is_one_warning(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)   # restored after the test
  log = metrics_log.MetricsLog(str(tmp_path), 0)
  assert log.tb is not None

  def upload():
    raise ConnectionError("HTTPConnectionPool(host='localhost'): Max retries exceeded\nsecond line")

  writer_thread = type("Uploader", (threading.Thread,), {"__module__": "tensorboardX.event_file_writer"})
  for _ in range(2):   # the second failure is not warned again
    t = writer_thread(target=upload)
    t.start()
    t.join()
  err = capsys.readouterr().err
  assert err.splitlines() == ["warning: TensorBoard stopped (ConnectionError: HTTPConnectionPool(host='localhost'): "
                              "Max retries exceeded); training goes on without it"], err
  assert log.tb is None
  log.write({"step": 1, "loss": 1.0})   # the run goes on, its records still written
  assert metrics_log.read(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]


def test_other_threads_failing_reach_the_hook_before(tmp_path, monkeypatch):
  seen = []
  monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
  metrics_log.MetricsLog(str(tmp_path), 0)

  def fail():
    raise ValueError("not tensorboard's")

  t = threading.Thread(target=fail)
  t.start()
  t.join()
  assert [str(e) for e in seen] == ["not tensorboard's"]


def test_tensorboard_starts_without_importing_torch(tmp_path):
  """tensorboardX's writer imports torch where it is installed (seconds of every run's start); the run's writer
  loads without it, writes events, and leaves torch importable for code that wants it."""
  import importlib.util
  import subprocess
  import sys
  if importlib.util.find_spec("torch") is None:
    import pytest
    pytest.skip("torch is not installed: nothing to keep out")
  script = ("import os, sys\nfrom lm_jax.obs import metrics_log\n"
            f"log = metrics_log.MetricsLog({str(tmp_path)!r}, 0)\nlog.write({{'step': 1, 'loss': 2.0}})\nlog.close()\n"
            "assert 'torch' not in sys.modules, 'tensorboardX imported torch'\n"
            f"assert os.listdir({str(tmp_path / 'tensorboard')!r})\n"
            "import torch\nprint(float(torch.ones(2).sum()))")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr[-2000:]

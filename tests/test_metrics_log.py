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

"""Weights & Biases (config.wandb, lm_jax/obs/wandb_log.py) with WANDB_MODE=offline: the run files W&B writes into the
workdir hold the config and the log records, and a resumed run continues the same W&B run."""
import struct

import pytest
from wandb.proto import wandb_internal_pb2

from lm_jax import checks, config_lib, train
from lm_jax.obs import metrics_log, wandb_log
from conftest import load_config

_BLOCK = 32768   # the .wandb file is a LevelDB log (32 KiB blocks) after a 7-byte W&B header


def _wandb_records(path) -> list:
  """The protobuf Records of an offline run's .wandb file (wandb no longer ships a Python reader)."""
  data, out, pos, parts = path.read_bytes(), [], 7, b""
  assert data.startswith(b":W&B"), data[:8]
  while pos + 7 <= len(data):
    left = _BLOCK - pos % _BLOCK
    length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
    if left < 7 or (length, kind) == (0, 0):   # a block's zero-filled tail
      pos += left
      continue
    parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):   # a full record, or the last fragment of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      out.append(record)
      parts = b""
  return out


def _key(item) -> str:
  return item.key or "/".join(item.nested_key)


def _offline_run(run_dir) -> dict:
  """{'id', 'config': {key: JSON}, 'history': [{key: value}], 'summary': {key: JSON}} of one offline run dir."""
  run = {"config": {}, "history": [], "summary": {}}
  for r in _wandb_records(next(run_dir.glob("run-*.wandb"))):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      run["id"] = r.run.run_id
      run["config"].update({_key(i): i.value_json for i in r.run.config.update})
    elif kind == "config":
      run["config"].update({_key(i): i.value_json for i in r.config.update})
    elif kind == "history":
      run["history"].append({_key(i): float(i.value_json) for i in r.history.item if not _key(i).startswith("_")})
    elif kind == "summary":
      run["summary"].update({_key(i): i.value_json for i in r.summary.update})
  return run


def test_an_offline_run_holds_the_records_and_a_resumed_run_continues_it(shared_data, tmp_path, monkeypatch):
  """Steps 1-6, then a resume to 10: two offline run directories with the workdir's one run id, each holding the
  config and exactly the records its process wrote to metrics.jsonl, and the goodput numbers in its summary."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  overrides = dict(total_steps=10, log_every=3, checkpoint_every=6, **{"wandb.project": "lm_jax_test",
                                                                       "wandb.tags": ("tiny",)})
  train.train(load_config("clm", shared_data, phase_end_step=6, **overrides), str(tmp_path))
  train.train(load_config("clm", shared_data, **overrides), str(tmp_path))
  first, resumed = [_offline_run(d) for d in sorted((tmp_path / "wandb").glob("offline-run-*"))]
  run_id = (tmp_path / wandb_log.ID_FILE).read_text()
  assert first["id"] == resumed["id"] == run_id
  assert first["config"]["objective"] == resumed["config"]["objective"] == '"clm"'
  assert [r["step"] for r in first["history"]] == [1, 3, 6, 6]   # train records, and the eval at the end
  assert [r["step"] for r in resumed["history"]] == [9, 10, 10]
  assert first["history"] + resumed["history"] == metrics_log.read(tmp_path / "metrics.jsonl")   # JSON: exact
  assert 0 < float(resumed["summary"]["goodput"]) < 1 and float(resumed["summary"]["goodput/compile_s"]) > 0


def test_bad_wandb_mode_is_one_line_naming_the_field(shared_data):
  config = load_config("clm", shared_data, **{"wandb.mode": "offlne"})
  with pytest.raises(config_lib.ConfigError, match=r"^config.wandb.mode='offlne' unknown; use online, offline"):
    checks.validate(config, 1)


def test_wandb_failing_mid_run_is_one_warning_and_training_goes_on(shared_data, tmp_path, monkeypatch, capsys):
  """W&B's log raising at the third record (a network gone mid-run): one warning line, no traceback, W&B never called
  again, and every record still in metrics.jsonl."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  start = wandb_log.start

  def failing_later(config, workdir):
    run, calls = start(config, workdir), []
    log = run.log

    def log_until_third(record):
      calls.append(record)
      if len(calls) == 3:
        raise ConnectionError("Network is unreachable\nmore lines")
      log(record)

    monkeypatch.setattr(run, "log", log_until_third)
    return run, calls

  runs = []
  monkeypatch.setattr(wandb_log, "start", lambda *a: runs.append(failing_later(*a)) or runs[-1][0])
  train.train(load_config("clm", shared_data, total_steps=10, log_every=2, checkpoint_every=10,
                          **{"wandb.project": "lm_jax_test"}), str(tmp_path))
  [(run, calls)] = runs
  run.finish()   # the run stopped using it; W&B's own process writes what it got
  err = capsys.readouterr().err
  warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
  assert warnings == ["warning: W&B stopped (ConnectionError: Network is unreachable); training goes on without it"]
  assert "Traceback" not in err
  records = metrics_log.read(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 4, 6, 8, 10] and len(calls) == 3

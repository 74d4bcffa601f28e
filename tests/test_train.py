"""The trainer in-process: config errors come before compiling. Also the tiny test setup (values / flags /
load_config) that test_cli.py, test_checkpoint.py and test_mesh.py use."""
import os
import pathlib
import subprocess
import sys

import pytest

from lm_jax import config_lib, metrics_log, train

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = {"clm": "gpt1.py:tiny", "mlm": "bert.py:tiny", "span_corruption": "t5.py:tiny"}
# Tiny enough for seconds per run on a CPU; d_ff = 4 d_model so GPT exports to HF OpenAIGPT.
TINY = dict(model=dict(d_model=32, num_heads=2, d_ff=128, num_layers=1),
            data=dict(seq_len=32, max_predictions_per_seq=5, eval_batches=2), batch_size=8, phase_end_step=0)
VOCAB = {"clm": 256, "mlm": 256, "span_corruption": 384}  # T5: 284 SentencePiece pieces + 100 sentinels


def values(objective, data_dir, /, **overrides) -> dict:
  """Dotted config field -> value of the tiny test setup."""
  out = {"data.files": str(data_dir / "tiny_shakespeare" / "input.txt"), "model.vocab_size": VOCAB[objective]}
  for group, fields in TINY.items():
    if isinstance(fields, dict):
      out.update({f"{group}.{k}": v for k, v in fields.items()})
    else:
      out[group] = fields
  out.update(overrides)
  return out


def flags(objective, data_dir, /, **overrides) -> list[str]:
  """The tiny test setup as CLI flags."""
  return [f"--config=configs/{CONFIG[objective]}"] + [
      f"--config.{k}={v}" for k, v in values(objective, data_dir, **overrides).items()]


def load_config(objective, data_dir, /, **overrides):
  """The same config as flags(), built in-process."""
  return config_lib.load(f"configs/{CONFIG[objective]}", values(objective, data_dir, **overrides))


def cli(*args, env=None, timeout=900):
  return subprocess.run([sys.executable, "-m", "lm_jax.main", *args], cwd=REPO, capture_output=True, text=True,
                        env={**os.environ, **(env or {})}, timeout=timeout)


def records(workdir, kind="train"):
  recs = metrics_log.read(os.path.join(workdir, "metrics.jsonl"))
  return [r for r in recs if ("loss" in r) == (kind == "train")]


# ------------------------------------------------------------------------------------ config errors, early
BAD = [  # (objective, overrides, devices, error type, message fragment)
    ("clm", {"objective": "lm"}, 1, ValueError, "config.objective='lm' is unknown"),
    ("clm", {"objective": "mlm"}, 1, ValueError, "needs config.model.family='bert', got 'gpt'"),
    ("clm", {"data.seq_len": 512}, 1, ValueError, "config.data.seq_len=512 exceeds config.model.max_positions=128"),
    ("span_corruption", {"model.vocab_size": 100}, 1, ValueError, "no room for 100 sentinels"),
    ("span_corruption", {"model.vocab_size": 110}, 1, ValueError,
     "config.model.vocab_size=110 is too small for a t5 tokenizer plus 100 sentinels"),
    ("clm", {"data.files": "/nonexistent/*.txt"}, 1, FileNotFoundError, "config.data.files"),
    ("clm", {"batch_size": 10, "microbatches": 4}, 1, ValueError,
     "config.batch_size=10 is not divisible by config.microbatches * mesh.data * mesh.fsdp = 4*1*1"),
    ("clm", {"mesh.data": 2}, 1, ValueError, "config.mesh data*fsdp*tensor = 2*1*1 = 2, but there are 1 devices"),
    ("clm", {"mesh.data": -1, "mesh.fsdp": -1}, 1, ValueError, "at most one -1"),
    ("clm", {"mesh.fsdp": 2, "mesh.tensor": 2, "batch_size": 10}, 8, ValueError,
     "config.batch_size=10 is not divisible by config.microbatches * mesh.data * mesh.fsdp = 1*2*2 = 4"),
    ("clm", {"model.num_heads": 3, "model.head_dim": 16, "mesh.tensor": 2}, 8, ValueError,
     "config.model.num_heads=3 is not divisible by config.mesh.tensor=2"),
    ("clm", {"model.num_heads": 4, "model.d_ff": 130, "mesh.tensor": 4}, 8, ValueError,
     "dim 130 is not divisible by mesh axes ('tensor',) of size 4"),
    ("clm", {"optimizer.name": "sgd"}, 1, ValueError, "config.optimizer.name='sgd'"),
    ("clm", {"optimizer.schedule": "step"}, 1, ValueError, "config.optimizer.schedule='step'"),
    ("clm", {"model.activation": "swish"}, 1, ValueError, "swish"),
    ("clm", {"phase_end_step": 500}, 1, ValueError, "config.phase_end_step=500"),
    ("clm", {"log_every": 0}, 1, ValueError, "config.log_every must be >= 1"),
]


@pytest.mark.parametrize("objective,overrides,devices,error,message", BAD,
                         ids=[" ".join(f"{k}={v}" for k, v in b[1].items()) for b in BAD])
def test_bad_config_fails_before_compiling(objective, overrides, devices, error, message, shared_data, tmp_path,
                                           monkeypatch):
  def compiled(*args, **kwargs):
    raise AssertionError("reached the compile step")
  monkeypatch.setattr(train.step, "fresh_state", compiled)
  monkeypatch.setattr(train.step, "make_train_step", compiled)
  config = load_config(objective, shared_data, **overrides)
  with pytest.raises(error) as info:
    if devices == 1:
      train.train(config, str(tmp_path))
    else:
      config_lib.validate(config, num_devices=devices)
  assert message in str(info.value) and "\n" not in str(info.value)

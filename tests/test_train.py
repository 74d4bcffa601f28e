"""The trainer in-process: config errors come before compiling."""
import pytest

from lm_jax import checks, train
from conftest import load_config


# ------------------------------------------------------------------------------------ config errors, early
BAD = [  # (objective, overrides, devices, error type, message fragment)
    ("clm", {"objective": "lm"}, 1, ValueError, "config.objective='lm' is unknown"),
    ("clm", {"objective": "mlm"}, 1, ValueError,
     "needs config.model.family='bert' or config.model.family='modernbert', got 'gpt'"),
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
      checks.validate(config, num_devices=devices)
  assert message in str(info.value) and "\n" not in str(info.value)

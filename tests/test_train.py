"""The trainer in-process: meshes of 8 simulated devices give the single-device loss with really sharded state,
and a checkpoint restores onto another mesh; config errors come before compiling. Also the tiny test setup
(values / flags / load_config) that test_cli.py and test_checkpoint.py use."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

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


# -------------------------------------------------------------------------------------- 8 simulated devices
MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from test_train import load_config
    from lm_jax import train
    import pathlib
    data, work = pathlib.Path({data!r}), pathlib.Path({work!r})
    out = {{}}
    for mesh in [(1, 1, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2)]:
      config = load_config("clm", data, total_steps=5, log_every=5, eval_every=0, checkpoint_every=5,
                           batch_size=16, **{{"optimizer.warmup_steps": 2, "mesh.data": mesh[0],
                                              "mesh.fsdp": mesh[1], "mesh.tensor": mesh[2],
                                              "data.tokenizer": {tokenizer!r}}})
      name = "x".join(map(str, mesh))
      result = train.train(config, str(work / name), devices=jax.devices()[:int(np.prod(mesh))])
      state = result["state"]
      shards = lambda x: [list(x.sharding.spec), list(x.addressable_shards[0].data.shape)]
      mu = state["opt_state"].mu  # optim.adam: clipping, Adam and weight decay in one state
      out[name] = dict(loss=result["train"]["loss"],
                       wi=shards(state["params"]["layers_0"]["mlp"]["wi"]["kernel"]),
                       wi_mu=shards(mu["layers_0"]["mlp"]["wi"]["kernel"]),
                       embed=shards(state["params"]["word_embeddings"]["embedding"]))
    # Restore the (2, 2, 2) checkpoint onto a (1, 4, 2) mesh: same values, new shards.
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 4, 2
    again = train.train(config, str(work / "2x2x2"))["state"]["params"]["layers_0"]["mlp"]["wi"]["kernel"]
    out["restored"] = dict(shape=list(again.addressable_shards[0].data.shape), sum=float(np.asarray(again).sum()))
    print("RESULT" + json.dumps(out))
""")


def test_meshes_match_single_device(shared_data, tmp_path):
  tokenizer_dir = tmp_path / "tok"
  config = load_config("clm", shared_data)
  from lm_jax.data import tokenizer as tokenizer_lib
  tokenizer_lib.load_or_train(config, str(tokenizer_dir))  # train once, share with every mesh
  tokenizer = str(next(tokenizer_dir.glob("*.model")))
  script = MESH_SCRIPT.format(tests=str(REPO / "tests"), data=str(shared_data), work=str(tmp_path),
                              tokenizer=tokenizer)
  run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  single = out["1x1x1"]["loss"]
  for name in ("8x1x1", "2x4x1", "2x2x2", "1x4x2"):
    assert out[name]["loss"] == pytest.approx(single, rel=1e-5), name
  # d_model 32 x d_ff 128 kernel over (fsdp, tensor); embedding (vocab 256, 32) over (tensor, fsdp)
  expected = {"1x1x1": [32, 128], "8x1x1": [32, 128], "2x4x1": [8, 128], "2x2x2": [16, 64], "1x4x2": [8, 64]}
  for name, shape in expected.items():
    assert out[name]["wi"] == [["fsdp"], ["tensor"]] or out[name]["wi"][0] == ["fsdp", "tensor"]
    assert out[name]["wi"][1] == shape and out[name]["wi_mu"][1] == shape, (name, out[name])
  assert out["1x4x2"]["embed"][1] == [128, 8]
  assert out["restored"]["shape"] == [8, 64]


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

"""lm_jax.config_lib: loading with typed overrides, one-line errors with a suggestion for a misspelled field,
numeric ranges checked before anything is built, and the command line's one-line `error:` exits."""
import math
import os
import subprocess
import sys

import pytest

from lm_jax import checks, config_lib, models, objectives
from conftest import REPO, flags

VARIANTS = {"bert": ["base", "large", "base_512", "large_512", "tiny", "tiny_512"], "gpt1": ["gpt1", "tiny"],
            "gpt2": ["small", "medium", "tiny"],
            "t5": ["small", "base", "large", "v1_1_small", "v1_1_base", "v1_1_large", "v1_1_xl", "v1_1_xxl", "tiny"]}


def test_load_applies_dict_and_string_overrides_with_the_fields_types(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # not the repository: the path falls back to the repo root
  c = config_lib.load("configs/gpt1.py:tiny", {"optimizer.lr": 3e-4, "batch_size": 4, "optimizer.b1": 0,
                                               "model.scan_layers": True, "data.seq_len": "64"})
  assert (c.optimizer.lr, c.batch_size, c.model.scan_layers, c.data.seq_len) == (3e-4, 4, True, 64)
  assert type(c.optimizer.b1) is float and c.optimizer.b1 == 0.0  # an int for a float field is fine
  c = config_lib.load("configs/gpt1.py:tiny", [
      "--config.optimizer.lr=3e-4", "batch_size=4", "model.scan_layers=false", "data.files=/data/{split}.txt",
      "--config.logical_axis_rules=(('batch', ('data', 'fsdp')), ('vocab', 'tensor'))", "mesh.data=-1",
      "optimizer.b2=1", "data.tfds_name="])
  assert (c.optimizer.lr, c.batch_size, c.model.scan_layers, c.data.files) == (3e-4, 4, False, "/data/{split}.txt")
  assert c.logical_axis_rules == (("batch", ("data", "fsdp")), ("vocab", "tensor"))
  assert (c.mesh.data, c.optimizer.b2, c.data.tfds_name) == (-1, 1.0, "") and type(c.optimizer.b2) is float
  assert config_lib.load(str(REPO / "configs" / "gpt1.py")).model.d_model == 768  # no variant: the default
  with pytest.raises(AttributeError):
    c.new_field = 1  # locked, like the command line's config


@pytest.mark.parametrize("field,suggestion", [
    ("optimizer.learning_rate", "optimizer.lr"),  # initials
    ("optimiser.lr", "optimizer.lr"),             # misspelled group
    ("lr", "optimizer.lr"),                       # right name, wrong group
    ("model.num_layer", "model.num_layers"),
    ("batch", "batch_size"),
])
def test_unknown_field_is_one_line_with_a_suggestion(field, suggestion):
  for overrides in ({field: 1}, [f"--config.{field}=1"]):
    with pytest.raises(config_lib.ConfigError) as info:
      config_lib.load("configs/gpt1.py:tiny", overrides)
    assert str(info.value) == f"config field {field!r} does not exist; did you mean {suggestion!r}?"


@pytest.mark.parametrize("overrides,message", [
    (["batch_size=abc"], "config field 'batch_size' expects an int, got 'abc'"),
    (["batch_size=2.5"], "config field 'batch_size' expects an int, got '2.5'"),
    ({"batch_size": 2.5}, "config field 'batch_size' expects an int, got float 2.5"),
    ({"data.seq_len": True}, "config field 'data.seq_len' expects an int, got bool True"),
    (["optimizer.lr=fast"], "config field 'optimizer.lr' expects a float, got 'fast'"),
    (["data.nsp=yes"], "config field 'data.nsp' expects a bool (true/false), got 'yes'"),
    ({"data.files": 3}, "config field 'data.files' expects a string, got int 3"),
    (["logical_axis_rules=(('batch',"], "config field 'logical_axis_rules' expects a tuple"),
    (["model=3"], "config field 'model' is a group of fields"),
    (["optimizer.lr"], "config override 'optimizer.lr' is not FIELD=VALUE"),
])
def test_wrong_type_names_the_field_and_its_type(overrides, message):
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.load("configs/gpt1.py:tiny", overrides)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_unknown_variant_are_config_errors():
  with pytest.raises(config_lib.ConfigError, match="config file 'configs/gpt3.py' not found"):
    config_lib.load("configs/gpt3.py:tiny")
  with pytest.raises(config_lib.ConfigError, match="unknown variant 'huge'"):
    config_lib.load("configs/t5.py:huge")


@pytest.mark.parametrize("file", VARIANTS)
def test_every_variant_loads_and_validates(file):
  for variant in VARIANTS[file]:
    config = config_lib.load(f"configs/{file}.py:{variant}", {"model.scan_layers": True})  # a fast eval_shape
    checks.validate(config, num_devices=8)
    assert models.family(config.model).layout in objectives.get(config.objective).layouts


BAD_NUMBERS = [  # (field, value, message fragment)
    ("optimizer.lr", -1e-3, "config.optimizer.lr must be > 0, got -0.001"),
    ("optimizer.lr", 0.0, "config.optimizer.lr must be > 0"),
    ("optimizer.lr", math.nan, "config.optimizer.lr must be finite, got nan"),
    ("optimizer.lr", math.inf, "config.optimizer.lr must be finite, got inf"),
    ("optimizer.b1", -0.1, "config.optimizer.b1 must be in [0, 1)"),
    ("optimizer.b2", 1.0, "config.optimizer.b2 must be in [0, 1), got 1.0"),
    ("optimizer.eps", 0.0, "config.optimizer.eps must be > 0"),
    ("optimizer.weight_decay", -0.01, "config.optimizer.weight_decay must be >= 0"),
    ("optimizer.warmup_steps", -1, "config.optimizer.warmup_steps must be >= 0"),
    ("optimizer.clip_norm", -1.0, "config.optimizer.clip_norm must be >= 0"),
    ("keep_checkpoints", 0, "config.keep_checkpoints must be >= 1"),
    ("peak_tflops", -1.0, "config.peak_tflops must be >= 0"),
    ("seed", -1, "config.seed must be >= 0"),
    ("eval_every", -1, "config.eval_every must be >= 0"),
    ("data.eval_batches", -1, "config.data.eval_batches must be >= 0"),
    ("data.target_len", -1, "config.data.target_len must be >= 0"),
    ("model.initializer_range", 0.0, "config.model.initializer_range must be > 0"),
    ("model.eos_token_id", 2048, "config.model.eos_token_id=2048 must be in [0, model.vocab_size=2048)"),
    ("z_loss", math.inf, "config.z_loss must be finite"),
    ("label_smoothing", math.nan, "config.label_smoothing must be in [0, 1), got nan"),
    ("model.dropout_rate", math.nan, "model.dropout_rate must be in [0, 1), got nan"),
]


@pytest.mark.parametrize("field,value,message", BAD_NUMBERS, ids=[f"{f}={v}" for f, v, _ in BAD_NUMBERS])
def test_numbers_out_of_range_are_rejected(field, value, message):
  config = config_lib.load("configs/gpt1.py:tiny", {field: value})
  with pytest.raises(config_lib.ConfigError) as info:
    checks.validate(config, num_devices=1)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_edge_values_in_range_pass():
  """0 = off / default for clip_norm, peak_tflops, target_len; no eval needs no eval batches; warmup may
  outlast a short schedule (rsqrt uses it as a constant)."""
  checks.validate(config_lib.load("configs/gpt1.py:tiny", {
      "optimizer.clip_norm": 0.0, "peak_tflops": 0.0, "optimizer.b1": 0.0, "optimizer.weight_decay": 0.0,
      "eval_every": 0, "data.eval_batches": 0, "total_steps": 5, "optimizer.warmup_steps": 20}), num_devices=1)


def _raise(error):
  raise error


@pytest.mark.parametrize("make,code", [
    (lambda: config_lib.ConfigError("config.seed must be >= 0, got -1"), 2),
    (lambda: FileNotFoundError("no checkpoint in /w/checkpoints; train first"), 1),
    (lambda: PermissionError(13, "Permission denied", "/w/metrics.jsonl"), 1),
])
def test_user_errors_print_one_line_and_exit(make, code, capsys):
  with pytest.raises(SystemExit) as info, config_lib.user_errors():
    _raise(make())
  assert info.value.code == code
  assert capsys.readouterr().err == f"error: {make()}\n"


def test_ctrl_c_outside_training_is_one_line(capsys, monkeypatch):
  with pytest.raises(SystemExit) as info, config_lib.user_errors():
    raise KeyboardInterrupt
  assert info.value.code == 130 and capsys.readouterr().err == "interrupted\n"
  monkeypatch.setenv("LM_JAX_TRACEBACK", "1")
  with pytest.raises(KeyboardInterrupt), config_lib.user_errors():
    raise KeyboardInterrupt


def test_user_errors_keep_tracebacks_for_bugs(capsys, monkeypatch):
  with pytest.raises(SystemExit) as info, config_lib.user_errors():
    objectives.get("lm")  # a ValueError raised by lm_jax: the user's
  assert info.value.code == 1 and capsys.readouterr().err.startswith("error: config.objective='lm' is unknown")
  with pytest.raises(ValueError), config_lib.user_errors():
    int("x")  # a ValueError from outside lm_jax: a bug, with its traceback
  with pytest.raises(KeyError), config_lib.user_errors():
    {}["x"]
  monkeypatch.setenv("LM_JAX_TRACEBACK", "1")
  with pytest.raises(config_lib.ConfigError), config_lib.user_errors():
    _raise(config_lib.ConfigError("x"))


# ------------------------------------------------------------------------------- the command line (subprocesses)
@pytest.mark.parametrize("args,fragment", [
    (["--config.optimizer.lr=-1e-3"], "config.optimizer.lr must be > 0, got -0.001"),
    (["--config.optimizer.lr=nan"], "config.optimizer.lr must be finite, got nan"),
    # the other override syntaxes parse, so the misspelled field is the error
    (["--config.mesh.data", "-1", "--config.logical_axis_rules=(('batch', ('data', 'fsdp')),)",
      "--config.optimizer.learning_rate=1"],
     "config field 'optimizer.learning_rate' does not exist; did you mean 'optimizer.lr'?"),
    (["--wokdir=x"], "Unknown command line flag 'wokdir'"),
])
def test_cli_prints_one_line_and_exits_2_before_building_anything(args, fragment, shared_data, tmp_path):
  workdir = tmp_path / "run"
  run = subprocess.run([sys.executable, "-m", "lm_jax.main", *flags("clm", shared_data), f"--workdir={workdir}",
                        *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 2, run.stderr[-3000:]
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], run.stderr[-3000:]
  assert not workdir.exists()  # nothing built: no tokenizer, no checkpoint

"""lm_jax.plan.input_rate: the tokens/s per host a planned step needs, beside the cached per-core measurement of the
same objective at the nearest seq_len, and the cores each input takes."""
import json

import pytest

from lm_jax import config_lib
from lm_jax.plan import input_rate


def _row(objective, nsp, seq_len, kind, rate, load=2.0):
  return dict(case="x", objective=objective, nsp=nsp, seq_len=seq_len, input=kind, workers=1, tokens_per_s=rate,
              processes=1, tokens_per_s_per_process=rate, load=load)


@pytest.fixture
def rates(tmp_path, monkeypatch):
  path = tmp_path / "rates.json"
  path.write_text(json.dumps([
      _row("mlm", True, 128, "on the fly", 96_500.0, 2.5), _row("mlm", True, 128, "prepared", 400_000.0, 3.0),
      _row("clm", False, 512, "on the fly", 688_000.0), _row("clm", False, 512, "prepared", 2_000_000.0),
      dict(_row("clm", False, 512, "on the fly", 1_000_000.0), workers=2, processes=3)]))
  monkeypatch.setenv("LM_JAX_INPUT_RATES", str(path))
  return path


def test_bert_large_on_v4_32_needs_three_cores_on_the_fly_and_one_prepared(rates):
  config = config_lib.load("configs/bert.py:large")
  p = input_rate.plan(config, 940_000.0, hosts=4)
  assert p["need_per_host"] == 235_000.0 and p["cores_on_the_fly"] == 3 and p["cores_prepared"] == 1
  line = input_rate.describe(p)
  assert line.startswith("input: 235,000 tokens/s per host needed; this pipeline per core: on the fly 96,500 -> 3 "
                         "cores, prepared 400,000 -> 1 cores (") and line.endswith("seq_len 128, load 3.0)")
  short = input_rate.describe(input_rate.plan(config, 3_130_000.0, hosts=4))     # v6e-16: 782,500 per host
  assert short.endswith("SHORT: the pipeline builds rows in one process, 400,000 tokens/s prepared, 51% of the need")


def test_the_nearest_seq_len_of_the_same_objective_and_one_process(rates):
  config = config_lib.load("configs/gpt1.py:gpt1", {"data.seq_len": 1024})
  m = input_rate.measured(config)
  assert (m["seq_len"], m["on_the_fly"], m["prepared"]) == (512, 688_000.0, 2_000_000.0)   # not the 2-worker row
  assert input_rate.measured(config_lib.load("configs/bert.py:base", {"data.nsp": False})) is None


def test_nothing_measured_is_said(tmp_path, monkeypatch):
  monkeypatch.setenv("LM_JAX_INPUT_RATES", str(tmp_path / "none.json"))
  p = input_rate.plan(config_lib.load("configs/t5.py:base"), 1e6, hosts=2)
  assert p["measured"] is None and "not measured" in input_rate.describe(p) and "500,000 tokens/s" in \
      input_rate.describe(p)

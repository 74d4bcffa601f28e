"""The MFU denominator: where the peak comes from, and the CPU measurement taken once per machine and cached."""
import json
import types

import pytest

from lm_jax.plan import hardware


@pytest.fixture
def measured(tmp_path, monkeypatch) -> list:
  """The cache under tmp_path, and a fake matmul measurement: each call appends to the returned list."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv(hardware.REMEASURE, raising=False)
  calls = []
  monkeypatch.setattr(hardware, "matmul_flops_per_s", lambda dtype: calls.append(dtype) or 1e11 * len(calls))
  return calls


def _cpus(n, hosts=1):
  return [types.SimpleNamespace(device_kind="cpu", process_index=i % hosts) for i in range(n)]


def test_cpu_peak_is_measured_once_per_machine_then_read_from_the_cache(measured, tmp_path, monkeypatch):
  flops, source = hardware.cpu_peak()
  assert flops == 1e11 and len(measured) == 1 and source.startswith("measured float32 matmul, now cached in ")
  path = tmp_path / "lm_jax" / "cpu_peak.json"
  assert json.loads(path.read_text()) == {hardware.cache_key(): 1e11}
  assert hardware.cpu_peak() == (1e11, f"measured float32 matmul, cached in {path}; LM_JAX_MEASURE_PEAK=1 "
                                       "measures again")
  assert len(measured) == 1
  monkeypatch.setattr(hardware, "cpu_model", lambda: "another CPU")   # another machine: its own entry
  assert hardware.cpu_peak()[0] == 2e11 and len(json.loads(path.read_text())) == 2
  monkeypatch.setenv(hardware.REMEASURE, "1")
  assert hardware.cpu_peak()[0] == 3e11 and json.loads(path.read_text())[hardware.cache_key()] == 3e11


def test_an_unwritable_cache_costs_only_the_caching(measured, tmp_path):
  (tmp_path / "lm_jax").write_text("a file where the cache directory would be")
  flops, source = hardware.cpu_peak()
  assert flops == 1e11 and "not cached" in source


def test_the_peak_says_where_it_comes_from(measured):
  assert hardware.peak(_cpus(8), peak_tflops=2.0) == (16e12, "config.peak_tflops x 8")
  tpus = [types.SimpleNamespace(device_kind="TPU v4", process_index=0)] * 8
  assert hardware.peak(tpus) == (8 * 275e12, "table: TPU v4 x 8")
  flops, source = hardware.peak(_cpus(4, hosts=2))   # one measurement per host, the same machine on each
  assert flops == 2e11 and source.endswith(" x 2 hosts") and len(measured) == 1
  assert hardware.describe(2.9e11, "config.peak_tflops x 1") == "peak 0.29 TFLOP/s (config.peak_tflops x 1)"


def test_the_measurement_is_the_best_of_several_runs(monkeypatch):
  """Load only slows a matmul down: the fastest run is the measurement, not the median."""
  times = iter([0.0, 1.0, 1.0, 1.5])   # timed runs of 1 s and 0.5 s (the warm-ups are not timed)
  monkeypatch.setattr(hardware, "time", types.SimpleNamespace(perf_counter=lambda: next(times)))   # hardware's clock only
  assert hardware.matmul_flops_per_s.__wrapped__(n=8, repeats=2) == 2 * 8**3 / 0.5

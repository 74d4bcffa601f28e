"""--mode=compile (lm_jax.plan: aot, planner, topology): the real steps compiled for TPU / GPU topologies.

The compile runs in a subprocess under the interpreter of LM_JAX_AOT_PYTHON (a virtual environment with
requirements-aot.txt; .ci/run makes it): libtpu and the CUDA plugin stay out of the environment the rest of the
suite runs in. Without it these tests skip.
"""
import json
import os
import subprocess

import pytest

from conftest import REPO, user_env

AOT_PYTHON = os.environ.get("LM_JAX_AOT_PYTHON", "")
pytestmark = pytest.mark.skipif(not AOT_PYTHON, reason="LM_JAX_AOT_PYTHON (a venv with requirements-aot.txt) unset")
# The configs' tiny models (d_model 128: TPU's (8, 128) tiles pad a narrower model's vectors beyond the 5% the
# memory check allows) on short rows.
TINY = ["--config.model.num_layers=1", "--config.data.seq_len=32", "--config.data.max_predictions_per_seq=5",
        "--config.batch_size=16"]
CONFIGS = {"bert": "configs/bert.py:tiny", "gpt1": "configs/gpt1.py:tiny", "t5": "configs/t5.py:tiny"}
# The newer families once each for v4-8, where XLA's FLOP count is checked against the family's own
# (lm_jax/flops.py), ModernBERT with a global and a local layer; and ModernBERT's scanned groups for v5e-16 (layer 0,
# then one group of local, local, global).
NEWER = [("configs/llama.py:tiny", "v4-8", []), ("configs/qwen3.py:tiny", "v4-8", []),
         ("configs/modernbert.py:tiny", "v4-8", ["model.num_layers=2"]),
         ("configs/modernbert.py:tiny", "v5e-16", ["model.num_layers=4", "model.scan_layers=True"])]
# 16384 rows of 128 tokens per device: their logits alone outgrow a v5e's 16 GiB.
OVERSIZED = ["--config=configs/gpt1.py:tiny", "--config.model.num_layers=1", "--config.batch_size=262144",
             "--config.eval_every=0"]

# One process compiles every tiny family for every topology (JAX starts once) and checks each report against
# lm_jax.plan.memory's count of params + optimizer state.
DRIVER = """
import json, sys
from lm_jax.plan import topology
topology.prepare()
from lm_jax import config_lib
from lm_jax.plan import aot, memory
out = []
for spec, name, flags in json.loads(sys.argv[1]):
  config = config_lib.load(spec, flags)
  topo = topology.get(name)
  lay, train, evaluate = aot.compile_steps(config, topo)
  r = aot.report(lay, topo, train, evaluate, 0.4)
  est = memory.estimate(lay.config, mesh=tuple(lay.mesh.shape.values()))   # planned apart from the compiled layout
  out.append({"spec": spec, "topology": name, "report": r, "estimate": est.params + est.opt_state})
from lm_jax import sharding
hybrid = sharding.make_mesh(config_lib.load("configs/gpt1.py:tiny", {"mesh.data": 4, "mesh.fsdp": 8}),
                            topology.get("2xv5e-16").devices)
slices = [sorted({d.slice_index for d in hybrid.devices[i].flat}) for i in range(4)]
print("JSON" + json.dumps({"compiled": out, "slices": slices}))
"""


def aot(*args, timeout=600):
  return subprocess.run([AOT_PYTHON, *args], cwd=REPO, capture_output=True, text=True,
                        env=user_env(PYTHONPATH=str(REPO)), timeout=timeout)


def compile_cli(*args):
  return aot("-m", "lm_jax.main", "--mode=compile", *args)


def test_tiny_families_compile_for_tpu_and_gpu_and_match_the_memory_model():
  tiny = [f.removeprefix("--config.") for f in TINY] + ["eval_every=0"]   # the eval step: once, the first job
  jobs = [(spec, name, tiny) for spec in CONFIGS.values() for name in ("v4-8", "v5e-16")]
  jobs[0] = (jobs[0][0], jobs[0][1], tiny[:-1])
  jobs.append((CONFIGS["gpt1"], "h100-8", tiny))
  jobs += [(spec, name, tiny + extra) for spec, name, extra in NEWER]
  splash = ["model.num_layers=1", "data.seq_len=128", "batch_size=16", "model.attention=splash", "eval_every=0"]
  jobs += [(CONFIGS["gpt1"], "v5e-16", splash), (CONFIGS["bert"], "v4-8", [*splash, "mesh.tensor=2"])]
  result = aot("-c", DRIVER, json.dumps(jobs))
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.split("JSON", 1)[1])
  assert out["slices"] == [[0], [0], [1], [1]], "mesh.data spans the 2 slices; fsdp stays inside one"
  out = out["compiled"]
  assert [o["report"]["attention"] for o in out[-2:]] == ["splash", "splash"]
  assert out[0]["report"]["memory_per_device"]["eval_total"] > 0
  kinds = {o["topology"]: o["report"]["device_kind"] for o in out}
  assert kinds == {"v4-8": "TPU v4", "v5e-16": "TPU v5 lite", "h100-8": "NVIDIA H100 80GB HBM3"}
  for o in out:
    r, m = o["report"], o["report"]["memory_per_device"]
    assert r["devices"] == {"v4-8": 4, "v5e-16": 16, "h100-8": 8}[o["topology"]]
    compiled = m["params_and_optimizer_compiled"]
    assert abs(compiled - o["estimate"]) <= 0.05 * o["estimate"], (o["spec"], o["topology"], compiled, o["estimate"])
    assert m["total"] >= m["arguments"] + m["temporaries"] + m["code"]
    assert r["step_seconds"] == pytest.approx(r["step_seconds_at_peak"] / 0.4)
    assert r["days"] == pytest.approx(r["steps"] * r["step_seconds"] / 86400)
    if o["topology"] == "v4-8" and r["attention"] == "xla":   # unrolled, no scan: XLA's count = ours + elementwise
      assert r["flops_per_device_ours"] <= r["flops_per_device_xla"] <= 1.3 * r["flops_per_device_ours"]
  # Two of these compiles are tests/goldens/compile_memory.json's (tests/test_goldens.py): within 5% of it.
  from test_goldens import compile_memory_moved
  moved = compile_memory_moved({(spec, tuple(flags), topo): o["report"]["memory_per_device"]
                                for (spec, topo, flags), o in zip(jobs, out)})
  assert moved is None, moved


def test_oversized_config_fails_in_one_line_and_plan_makes_it_fit(tmp_path):
  result = compile_cli(*OVERSIZED, "--topology=v5e-16")
  assert result.returncode == 1, result.stderr[-3000:]
  error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(error) == 1 and "needs" in error[0], result.stderr[-2000:]
  assert "TPU v5 lite has 15.75G available to XLA of 16.00 GiB" in error[0]
  assert "--plan" in error[0]

  report = tmp_path / "plan.json"
  result = compile_cli(*OVERSIZED, "--topology=v5e-16", "--plan", "--plan_fits=1", f"--report_json={report}")
  assert result.returncode == 0, result.stderr[-3000:]
  best = [line for line in result.stdout.splitlines() if line.startswith("best: ")]
  assert len(best) == 1 and "--config.microbatches=" in best[0], result.stdout
  r = json.loads(report.read_text())
  assert r["memory_per_device"]["total"] < r["memory_per_device"]["device"]
  assert r["microbatches"] > 1 or r["remat_policy"] != "none"
  assert f"--config.microbatches={r['microbatches']}" in best[0]


def test_unknown_topology_is_one_line():
  result = compile_cli("--config=configs/gpt1.py:tiny", "--topology=v9-8")
  assert result.returncode == 2   # a flag's value (docs/runs.md's exit codes)
  assert result.stderr.strip().splitlines()[-1].startswith("error: --topology='v9-8' unknown")


def test_cudnn_attention_for_gpu_says_why_it_cannot_compile_here():
  """The compile-only CUDA plugin brings no cuDNN: the cudnn kernel fails in one line that says so (docs/scale.md)."""
  result = compile_cli("--config=configs/gpt1.py:tiny", *TINY, "--config.model.attention=cudnn", "--topology=h100-8")
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1].startswith("error: model.attention='cudnn' cannot be compiled for "
                                                             "NVIDIA H100 80GB HBM3 on this host: cuDNN not found.")

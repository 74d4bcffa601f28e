"""The trainer's start-up memory line (issue 23 part 3): the compiled train step's per-device memory, as
compiled.memory_analysis() gives it, next to lm_jax.plan.memory's estimate; the step is compiled once and trains.
A scanned Llama layer's and ModernBERT group's activation estimate against what autodiff saves from its scan."""
import re

import jax
import pytest

from conftest import load_config
from lm_jax import setup as setup_lib, step, train
from lm_jax.plan import aot, memory


def test_memory_line_is_the_compiled_steps_memory_analysis(shared_data, tmp_path, capsys):
  config = load_config("clm", shared_data, total_steps=2, log_every=1, eval_every=0, checkpoint_every=100)
  result = train.train(config, str(tmp_path))
  assert result["step"] == 2 and jax.numpy.isfinite(result["train"]["loss"])
  line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory per device (MiB):")]
  assert len(line) == 1, "compiled once, one line"
  compiled_part, estimate_part = line[0].split(" | ")
  shown = dict(re.findall(r"(arguments|outputs|aliased|temporaries|code|total) (\d+\.\d)", compiled_part))

  s = setup_lib.setup(config, str(tmp_path))
  jitted = step.make_train_step(s.config, s.objective, s.tx, s.lr_schedule, s.state_sharding, s.mesh)
  a = jitted.lower(*aot.abstract_inputs(s.config, s.objective, s.abstract_state, s.state_sharding,
                                        s.mesh)).compile().memory_analysis()
  expected = {"arguments": a.argument_size_in_bytes, "outputs": a.output_size_in_bytes,
              "aliased": a.alias_size_in_bytes, "temporaries": a.temp_size_in_bytes,
              "code": a.generated_code_size_in_bytes}
  expected["total"] = (expected["arguments"] + expected["outputs"] - expected["aliased"] + expected["temporaries"]
                       + expected["code"])
  assert shown == {k: f"{v / 2**20:.1f}" for k, v in expected.items()}
  assert "lm_jax.plan.memory: params" in estimate_part


def test_device_memory_in_log_records_where_the_device_reports_it():
  class Accelerator:
    def memory_stats(self):
      return {"bytes_in_use": 3 * 2**30, "peak_bytes_in_use": 5 * 2**30, "bytes_limit": 16 * 2**30}

  assert memory.device_stats(Accelerator()) == {"device_memory_gib": 3.0, "device_memory_peak_gib": 5.0}
  assert memory.device_stats(jax.devices("cpu")[0]) == {}   # the CPU reports none: no fields


def _scan_residuals(config, steps: int = 0, per_step: int = 1) -> float:
  """Bytes per token per layer of the activations that autodiff saves from a scanned layer stack of `steps` steps
  (default num_layers) of `per_step` layers: the outputs of the forward scan with a leading step axis, less the
  weights (no batch axis)."""
  from lm_jax import models, objectives
  m, rows, seq = config.model, config.batch_size, config.data.seq_len
  objective = objectives.get(config.objective)
  batch = {k: jax.ShapeDtypeStruct((rows, *shape), dtype) for k, (shape, dtype) in objective.features(config).items()}
  loss = lambda p, b: objective.loss(config, p, b, objective.denominators(b), rng=jax.random.key(0), train=True)[0]
  jaxpr = jax.make_jaxpr(jax.grad(loss))(models.abstract_params(m), batch)
  steps = steps or m.num_layers
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == steps]
  outs = [v.aval for v in scans[0].outvars]
  kept = [a for a in outs if len(a.shape) > 2 and a.shape[0] == steps and a.shape[1] in (rows, rows * seq)]
  return sum(a.size * a.dtype.itemsize for a in kept) / (steps * per_step * rows * seq)


@pytest.mark.parametrize("fields", [{}, {"model.num_kv_heads": 0, "model.dtype": "bfloat16"}])
def test_scanned_llama_layer_estimate_is_what_its_scan_saves(fields):
  """Family.activation_bytes of a scanned Llama layer (costs.stack + costs.scanned_extra) against the residuals
  jax.grad keeps from the scan, GQA in float32 and multi-head attention in bfloat16, within 5%."""
  from lm_jax import config_lib
  from lm_jax.models import costs
  config = config_lib.load("configs/llama.py:tiny", {"model.scan_layers": True, "model.remat_policy": "none",
                                                     "data.seq_len": 40, "batch_size": 2, **fields})
  m, div = config.model, {"heads": 1, "mlp": 1, "vocab": 1}   # 2 x 40 = 80 tokens: no weight has a dim of 80
  ours = costs.stack(m, div, 1, 40, 40) / 40 + costs.scanned_extra(m, div, 40)
  assert costs.scanned_extra(m, div, 40) > 0
  assert ours == pytest.approx(_scan_residuals(config), rel=0.05)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scanned_modernbert_group_estimate_is_what_its_scan_saves(dtype):
  """ModernBERT's scanned groups (local, local, global; GeGLU, a 16-position window in 40 tokens): costs.stack +
  costs.grouped_extra per layer equal the residuals jax.grad keeps from the group scan, and the family's count
  holds them for every grouped layer without remat."""
  from lm_jax import config_lib, models
  from lm_jax.flops import Lengths
  from lm_jax.models import costs, modernbert
  config = config_lib.load("configs/modernbert.py:tiny", {
      "model.scan_layers": True, "model.remat_policy": "none", "model.num_layers": 10, "model.dtype": dtype,
      "data.seq_len": 40, "data.max_predictions_per_seq": 12, "batch_size": 2})
  m, div = config.model, {"heads": 1, "mlp": 1, "vocab": 1}
  assert m.gated_ffn and m.sliding_window < 40 and len(modernbert.grouped_layers(m)) == 9
  per_layer = costs.stack(m, div, 1, 40, 40) / 40 + costs.grouped_extra(m, div, 40)
  assert per_layer == pytest.approx(_scan_residuals(config, steps=3, per_step=3), rel=0.01)
  lengths, looped = Lengths(inputs=40, targets=0, scored=12), config_lib.load("configs/modernbert.py:tiny", {
      "model.remat_policy": "none", "model.num_layers": 10, "model.dtype": dtype}).model
  fam = models.family(m)
  assert fam.activation_bytes(m, lengths, div) - fam.activation_bytes(looped, lengths, div) == (
      9 * 40 * costs.grouped_extra(m, div, 40))

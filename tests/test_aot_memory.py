"""The trainer's start-up memory line (issue 23 part 3): the compiled train step's per-device memory, as
compiled.memory_analysis() gives it, next to lm_jax.plan.memory's estimate; the step is compiled once and trains."""
import re

import jax

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

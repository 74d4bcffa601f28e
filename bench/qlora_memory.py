"""Train-step memory of QLoRA against LoRA on a float32 base, from XLA's own accounting of the compiled step.

  python bench/qlora_memory.py                      # GPT, d_model 1024, 8 layers, scanned
  python bench/qlora_memory.py --layers 24 --d_model 2048 --dtype bfloat16

Both runs are the same config but for config.lora.qlora: LoRA r=8 on the attention query / value kernels, the rest
frozen. `args` is what the step is handed (the train state, mostly the frozen base), `temp` what XLA allocates
inside it; their sum is the step's peak on one device. QLoRA stores the base as NF4 (lm_jax/models/nf4.py) and
dequantises each kernel inside its matmul (layers.Dense, nf4.matmul, recomputed in the backward pass), so its
temp should stay at LoRA's: a step that dequantised the whole model first would add a float copy of the base.
Nothing runs: the step is only compiled (jax.jit(...).lower(...).compile().memory_analysis()).
"""
import argparse
import os
import sys

import jax
from flax import linen as nn


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from lm_jax import config_lib, layout, objectives, sharding, step  # noqa: E402


def measure(args, qlora: bool) -> dict:
  config = config_lib.load(os.path.join(REPO, "configs", "gpt1.py:tiny"), {
      "model.d_model": args.d_model, "model.num_heads": args.d_model // 64, "model.d_ff": 4 * args.d_model,
      "model.num_layers": args.layers, "model.scan_layers": True, "model.dtype": args.dtype,
      "batch_size": args.batch, "data.seq_len": args.seq_len, "model.max_positions": args.seq_len,
      "lora.rank": 8, "lora.targets": ("attention/(query|value)/",), "lora.qlora": qlora})
  mesh = sharding.make_mesh(config)
  lay = layout.build(config, mesh, sharding.RULES)
  tx, lr, abstract, shardings = lay.tx, lay.lr_schedule, lay.abstract_state, lay.state_sharding
  objective = objectives.get(config.objective)
  batch = {name: jax.ShapeDtypeStruct((config.batch_size, *shape), dtype)
           for name, (shape, dtype) in objective.features(config).items()}
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    train_step = step.make_train_step(config, objective, tx, lr, shardings, mesh)
    stats = train_step.lower(abstract, batch).compile().memory_analysis()
  mib = lambda n: n / 2**20
  return {"args_mib": mib(stats.argument_size_in_bytes), "temp_mib": mib(stats.temp_size_in_bytes),
          "peak_mib": mib(stats.argument_size_in_bytes + stats.temp_size_in_bytes)}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--d_model", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--dtype", default="float32", help="compute dtype (model.dtype); params stay float32")
  args = parser.parse_args()
  lora, qlora = measure(args, False), measure(args, True)
  print(f"{'':8} {'args MiB':>10} {'temp MiB':>10} {'peak MiB':>10}")
  for name, row in (("LoRA", lora), ("QLoRA", qlora)):
    print(f"{name:8} {row['args_mib']:10.1f} {row['temp_mib']:10.1f} {row['peak_mib']:10.1f}")
  print(f"QLoRA / LoRA peak: {qlora['peak_mib'] / lora['peak_mib']:.3f}   temp: "
        f"{qlora['temp_mib'] / lora['temp_mib']:.3f}")


if __name__ == "__main__":
  main()

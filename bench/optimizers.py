"""Optimizers and schedules on nanoGPT's CPU recipe (configs/nanogpt.py:shakespeare_char_cpu), several seeds each:
AdamW with its cosine schedule (the recipe), Muon (shakespeare_char_cpu_muon, at full length and at 75% of the
steps), schedule-free AdamW at a constant rate, Lion, and AdamW with WSD (20% 1-sqrt cooldown).

  python bench/optimizers.py                          # 2000 steps, 3 seeds, every optimizer (hours on 2 cores)
  python bench/optimizers.py --steps=300 --only=muon --set=optimizer.lr=0.04   # one row of a sweep
  python bench/optimizers.py --quick                  # 1 layer, 10 steps, 1 seed: a smoke test

Printed per optimizer: the final exact validation loss (the whole split, lm_jax/data/windows.py) as mean ± sd over
the seeds; the steps it needs to reach AdamW's final mean loss (the first eval at or below it, evals every
--eval_every steps); its median step time against AdamW's (the log windows, eval and checkpoints left out); and
modded-nanogpt's significance margin (target - mean) * sqrt(n), the target being AdamW's mean. The load average is
printed before and after: on a shared machine the times say little.
"""
import argparse
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from lm_jax import config_lib, train  # noqa: E402
from lm_jax.obs import metrics_log  # noqa: E402

DATA = os.environ.get("LM_JAX_DATA", str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))
# name -> (variant, overrides, fraction of the steps)
RUNS = {
    "adamw_cosine": ("shakespeare_char_cpu", {}, 1.0),
    "muon": ("shakespeare_char_cpu_muon", {}, 1.0),
    "muon_75%": ("shakespeare_char_cpu_muon", {}, 0.75),
    "schedule_free": ("shakespeare_char_cpu",
                      {"optimizer.name": "schedule_free_adamw", "optimizer.schedule": "constant"}, 1.0),
    "lion": ("shakespeare_char_cpu", {"optimizer.name": "lion", "optimizer.lr": 1e-4, "optimizer.weight_decay": 1.0},
             1.0),
    "adamw_wsd": ("shakespeare_char_cpu", {"optimizer.schedule": "wsd", "optimizer.cooldown_shape": "1-sqrt"}, 1.0),
}


def run(name: str, seed: int, args, workdir: str) -> dict:
  """{'final': exact val loss, 'evals': [(step, val loss)], 'ms': median ms per step} of one trained run."""
  variant, overrides, fraction = RUNS[name]
  steps = max(1, round(args.steps * fraction))
  values = {"data.files": f"{DATA}/tiny_shakespeare/input.txt", "seed": seed, "total_steps": steps,
            "eval_every": args.eval_every, "log_every": args.eval_every, "checkpoint_every": 10 ** 9,
            "optimizer.warmup_steps": min(100, steps // 10), **overrides, **dict(kv.split("=", 1) for kv in args.set)}
  if args.quick:
    values.update({"model.num_layers": 1, "data.eval_batches": 2})
  config = config_lib.load(f"configs/nanogpt.py:{variant}", values)
  train.train(config, workdir)
  recs = metrics_log.read(os.path.join(workdir, "metrics.jsonl"))
  evals = [(r["step"], r["eval_loss"]) for r in recs if "eval_loss" in r]
  tokens = config.batch_size * config.data.seq_len
  times = [1e3 * tokens / r["tokens_per_sec"] for r in recs if "tokens_per_sec" in r][1:]   # the first compiles
  return {"final": evals[-1][1], "evals": evals, "ms": statistics.median(times) if times else float("nan")}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=2000)
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--eval_every", type=int, default=100)
  ap.add_argument("--only", default="", help="comma-separated names of RUNS (default: all)")
  ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE config override for every run")
  ap.add_argument("--quick", action="store_true", help="1 layer, 10 steps, 1 seed, 2 eval batches")
  args = ap.parse_args()
  if args.quick:
    args.steps, args.seeds, args.eval_every = 10, 1, 5
  names = ["adamw_cosine"] + [n for n in RUNS if n != "adamw_cosine" and (not args.only or n in args.only.split(","))]
  print(f"load average before: {os.getloadavg()}", flush=True)
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      results[name] = [run(name, seed, args, f"{tmp}/{name}-{seed}") for seed in range(args.seeds)]
      finals = [r["final"] for r in results[name]]
      print(f"{name}: final val loss {finals}", flush=True)
  print(f"load average after: {os.getloadavg()}")
  n = args.seeds
  target = statistics.mean(r["final"] for r in results["adamw_cosine"])
  base_ms = statistics.mean(r["ms"] for r in results["adamw_cosine"])
  print(f"\n{args.steps} steps, {n} seed(s); target: AdamW cosine's mean final val loss {target:.4f}")
  print("| optimizer | steps | val loss mean ± sd | steps to target (per seed) | ms/step vs AdamW | margin |")
  print("|---|---|---|---|---|---|")
  for name, rs in results.items():
    finals = [r["final"] for r in rs]
    sd = statistics.stdev(finals) if n > 1 else 0.0
    reach = [next((s for s, v in r["evals"] if v <= target), None) for r in rs]
    ms = statistics.mean(r["ms"] for r in rs)
    steps = max(1, round(args.steps * RUNS[name][2]))
    print(f"| {name} | {steps} | {statistics.mean(finals):.4f} ± {sd:.4f} | "
          f"{', '.join('-' if s is None else str(s) for s in reach)} | {ms / base_ms:.2f}x ({ms:.0f} ms) | "
          f"{(target - statistics.mean(finals)) * n ** 0.5:+.4f} |")


if __name__ == "__main__":
  main()

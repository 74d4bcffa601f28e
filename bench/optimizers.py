"""Optimizers and schedules on nanoGPT's CPU recipe (configs/nanogpt.py:shakespeare_char_cpu), several seeds each:
AdamW with its cosine schedule (the recipe, the target), Muon (shakespeare_char_cpu_muon, at full length and at 75% of
the steps), schedule-free AdamW at a constant rate, Lion, AdamW with WSD (20% 1-sqrt cooldown), and the recipe at the
rate a sweep found best for it (4e-3 instead of nanoGPT's 1e-3). Muon's and schedule-free's rates come from sweeps
too (bench/README.md).

  python bench/optimizers.py                          # 2000 steps, 3 seeds, every optimizer (hours on 2 cores)
  python bench/optimizers.py --steps=300 --only=muon --set=optimizer.lr=0.04   # one row of a sweep
  python bench/optimizers.py --quick                  # 1 layer, 10 steps, 1 seed: a smoke test
  python bench/optimizers.py --out=DIR --only=lion    # keeps each run's result in DIR; a rerun skips those done

With --out, every finished run is DIR/<name>-<seed>.json, so a killed bench loses only the run in flight, and
any number of benches started on DIR share its runs as workers (each takes the runs no other holds, seed by seed);
the table covers every result in DIR, and --seeds=0 only prints it.

Printed per optimizer: the final exact validation loss (the whole split, lm_jax/data/windows.py) as mean ± sd over
the seeds; the steps it needs to reach AdamW's final mean loss (the first eval at or below it, evals every
--eval_every steps: each exact eval costs about 50 training steps); its step time against AdamW's (the median of
the log windows, eval and checkpoints left out, then the median over seeds) with the median load average of its
runs (on a shared machine the times say little); and modded-nanogpt's significance margin (target - mean) * sqrt(n),
the target being AdamW's mean.
"""
import argparse
import fcntl
import json
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
RUNS = {   # in the order run for each seed: the bars first
    "adamw_cosine": ("shakespeare_char_cpu", {}, 1.0),
    "muon_75%": ("shakespeare_char_cpu_muon", {}, 0.75),
    "adamw_wsd": ("shakespeare_char_cpu", {"optimizer.schedule": "wsd", "optimizer.cooldown_shape": "1-sqrt"}, 1.0),
    "schedule_free": ("shakespeare_char_cpu",
                      {"optimizer.name": "schedule_free_adamw", "optimizer.schedule": "constant", "optimizer.lr": 8e-3},
                      1.0),
    "muon": ("shakespeare_char_cpu_muon", {}, 1.0),
    "lion": ("shakespeare_char_cpu", {"optimizer.name": "lion", "optimizer.lr": 1e-4, "optimizer.weight_decay": 1.0},
             1.0),
    "adamw_cosine_4e-3": ("shakespeare_char_cpu", {"optimizer.lr": 4e-3}, 1.0),   # the recipe at its tuned rate
}


def run(name: str, seed: int, args, workdir: str) -> dict:
  """{'final': exact val loss, 'evals': [(step, val loss)], 'ms': median ms per step, 'load': load averages before
  and after} of one trained run."""
  load = os.getloadavg()[0]
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
  return {"final": evals[-1][1], "evals": evals, "ms": statistics.median(times) if times else float("nan"),
          "load": [load, os.getloadavg()[0]]}


def kept(path: str, args):
  """The result saved at `path` by a run with this call's settings, else None."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    saved = json.load(f)
  return saved["result"] if saved["key"] == settings(args) else None


def settings(args) -> dict:
  return {"steps": args.steps, "eval_every": args.eval_every, "set": args.set, "quick": args.quick}


def cached_run(name: str, seed: int, args, tmp: str):
  """run(), kept in args.out when given: a result already there is read, and one another worker holds (its lock
  file) is skipped (None)."""
  if not args.out:
    return run(name, seed, args, f"{tmp}/{name}-{seed}")
  path = os.path.join(args.out, f"{name}-{seed}.json")
  with open(path + ".lock", "w") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the kernel's: released however the worker ends
    except BlockingIOError:
      return None
    if (result := kept(path, args)) is None:
      result = run(name, seed, args, f"{tmp}/{name}-{seed}")
      with open(path + ".tmp", "w") as f:
        json.dump({"key": settings(args), "result": result}, f)
      os.replace(path + ".tmp", path)
  return result


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=2000)
  ap.add_argument("--seeds", type=int, default=3)
  ap.add_argument("--eval_every", type=int, default=250, help="each eval reads the whole split: ~50 steps' time")
  ap.add_argument("--only", default="", help="comma-separated names of RUNS (default: all); adamw_cosine, the target, "
                  "runs too unless --out (where another worker may run it)")
  ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE config override for every run")
  ap.add_argument("--quick", action="store_true", help="1 layer, 10 steps, 1 seed, 2 eval batches")
  ap.add_argument("--out", default="", help="a folder keeping each run's result: resume, or split "
                  "a bench over workers")
  args = ap.parse_args()
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  if args.quick:
    args.steps, args.seeds, args.eval_every = 10, 1, 5
  names = [n for n in RUNS if not args.only or n in args.only.split(",") or (n == "adamw_cosine" and not args.out)]
  print(f"load average before: {os.getloadavg()}", flush=True)
  results = {name: [] for name in names}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in range(args.seeds):   # seed-major: a bench cut short still has every row
      for name in names:
        if (r := cached_run(name, seed, args, tmp)) is not None:
          results[name].append(r)
          print(f"{name} seed {seed}: final val loss {r['final']:.4f}", flush=True)
  print(f"load average after: {os.getloadavg()}")
  if args.out:   # every result kept in the folder with these settings, this call's or another worker's
    results = {name: [r for seed in range(10) if (r := kept(f"{args.out}/{name}-{seed}.json", args))]
               for name in RUNS}
  results = {name: rs for name, rs in results.items() if rs}
  if "adamw_cosine" not in results:
    return
  target = statistics.mean(r["final"] for r in results["adamw_cosine"])
  base_ms = statistics.median(r["ms"] for r in results["adamw_cosine"])
  print(f"\n{args.steps} steps; target: AdamW cosine's mean final val loss {target:.4f}")
  print("| optimizer | steps | seeds | val loss mean ± sd | steps to target (per seed) | ms/step vs AdamW (load) "
        "| margin |")
  print("|---|---|---|---|---|---|---|")
  for name, rs in results.items():
    finals = [r["final"] for r in rs]
    n = len(finals)
    sd = statistics.stdev(finals) if n > 1 else 0.0
    reach = [next((s for s, v in r["evals"] if v <= target), None) for r in rs]
    ms = statistics.median(r["ms"] for r in rs)   # one run slowed by a busy machine moves no median
    load = statistics.median(x for r in rs for x in r.get("load", [float("nan")]))
    steps = max(1, round(args.steps * RUNS[name][2]))
    print(f"| {name} | {steps} | {n} | {statistics.mean(finals):.4f} ± {sd:.4f} | "
          f"{', '.join('-' if s is None else str(s) for s in reach)} | {ms / base_ms:.2f}x ({ms:.0f} ms, "
          f"load {load:.1f}) | {(target - statistics.mean(finals)) * n ** 0.5:+.4f} |")

if __name__ == "__main__":
  main()

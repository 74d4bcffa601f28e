"""nanoGPT's own train.py against lm_jax's configs/nanogpt.py, one after the other on this machine.

  python bench/nanogpt.py --nanogpt=DIR                 # the README's CPU line (2000 iterations), both sides
  python bench/nanogpt.py --nanogpt=DIR --gpu           # config/train_shakespeare_char.py on one GPU
  python bench/nanogpt.py --quick                       # a 1-layer, 10-step smoke test (nanoGPT too with --nanogpt)

DIR is a checkout of karpathy/nanoGPT (not copied into this project). Its data/shakespeare_char/prepare.py runs
first when train.bin is missing, on --data copied to its input.txt (prepare.py downloads the file only when
input.txt is absent). nanoGPT runs as its README says (CPU: --device=cpu --compile=False --eval_iters=20
--log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0); ours runs python -m lm_jax.main with configs/nanogpt.py:shakespeare_char_cpu
(or shakespeare_char). For each: the whole process's wall time (imports, compilation and evals included), the
median time of a training step (nanoGPT's per-iteration 'time' lines; our log windows, which leave out eval and
checkpoint time), tokens per second at that step time, and the final validation loss: nanoGPT's estimate (mean of
eval_iters random batches) and ours exact over the whole split. --threads=N pins both processes to the first N
cores (and sets OMP_NUM_THREADS). The load average is printed before and after each side.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = {"cpu": 1.88, "gpu": 1.4697}   # nanoGPT's README: val loss of the CPU line, best val loss on one A100
SHAPE = {"cpu": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12, max_iters=2000),
         "gpu": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, max_iters=5000)}
QUICK = dict(n_layer=1, max_iters=10)


def shape(args) -> dict:
  s = dict(SHAPE["gpu" if args.gpu else "cpu"])
  if args.quick:
    s.update(QUICK)
  return s


def nanogpt_command(args) -> list[str]:
  s = shape(args)
  cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--max_iters={s['max_iters']}",
         f"--lr_decay_iters={s['max_iters']}", "--log_interval=1", "--always_save_checkpoint=False"]
  if args.gpu:
    cmd += ["--device=cuda"]
  else:
    cmd += ["--device=cpu", "--compile=False", "--eval_iters=20", "--dropout=0.0"]
    cmd += [f"--{k}={s[k]}" for k in ("block_size", "batch_size", "n_layer", "n_head", "n_embd")]
  if args.quick:
    cmd += ["--eval_iters=2", f"--eval_interval={s['max_iters']}"] + ([f"--n_layer={s['n_layer']}"] if args.gpu else [])
  return cmd


def ours_command(args, workdir: str) -> list[str]:
  s = shape(args)
  variant = "shakespeare_char" if args.gpu else "shakespeare_char_cpu"
  cmd = [sys.executable, "-m", "lm_jax.main", f"--config=configs/nanogpt.py:{variant}", f"--workdir={workdir}",
         f"--config.data.files={args.data}"]
  if args.quick:
    cmd += [f"--config.model.num_layers={s['n_layer']}", f"--config.total_steps={s['max_iters']}",
            "--config.log_every=2", f"--config.eval_every={s['max_iters']}", "--config.data.eval_batches=2"]
  return cmd + args.set


def prepare(args):
  """nanoGPT's train.bin / val.bin / meta.pkl from --data, by its own prepare.py."""
  folder = os.path.join(args.nanogpt, "data", "shakespeare_char")
  if os.path.exists(os.path.join(folder, "train.bin")):
    return
  target = os.path.join(folder, "input.txt")
  if not os.path.exists(target):
    shutil.copyfile(args.data, target)
  subprocess.run([sys.executable, "prepare.py"], cwd=folder, check=True, stdout=subprocess.DEVNULL)


def run(cmd: list[str], cwd: str, args) -> tuple[float, str]:
  """(wall seconds, stdout + stderr) of one side, pinned to --threads cores."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if args.threads:
    env["OMP_NUM_THREADS"] = str(args.threads)
  pin = (lambda: os.sched_setaffinity(0, range(args.threads))) if args.threads else None
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        preexec_fn=pin)
  wall = time.perf_counter() - start
  if proc.returncode:
    sys.exit(f"bench/nanogpt.py: {' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
  return wall, proc.stdout


def nanogpt_result(out: str) -> dict:
  """Step times from 'iter N: loss L, time T ms' (the first 5 and the ones right after an eval left out) and the
  last and lowest 'step N: train loss A, val loss B'."""
  times = {int(i): float(t) for i, t in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", out)}
  evals = [(int(i), float(v)) for i, v in re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", out)]
  kept = [t for i, t in times.items() if i >= 5 and i not in dict(evals)]
  return {"ms_step": statistics.median(kept or list(times.values())), "val_loss": evals[-1][1],
          "best": min(v for _, v in evals)}


def ours_result(workdir: str, tokens_per_step: int) -> dict:
  """Median step time over the log windows after the first (which holds compilation); the last eval's loss."""
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  rates = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r]
  rates = rates[1:] or rates
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  return {"ms_step": 1000 * tokens_per_step / statistics.median(rates), "val_loss": evals[-1], "best": min(evals)}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--nanogpt", default="", help="a karpathy/nanoGPT checkout; '' = ours only")
  p.add_argument("--data", default=os.path.join(os.environ.get("LM_JAX_DATA", os.path.join(REPO, "..", "shared",
                                                                                          "data")),
                                                "tiny_shakespeare", "input.txt"), help="Tiny Shakespeare's input.txt")
  p.add_argument("--gpu", action="store_true", help="the GPU recipe (config/train_shakespeare_char.py) on one GPU")
  p.add_argument("--quick", action="store_true", help="1 layer, 10 steps: a smoke test")
  p.add_argument("--threads", type=int, default=0, help="pin both sides to this many cores; 0 = all")
  p.add_argument("--set", action="append", default=[], help="extra --config.FIELD=VALUE for our side")
  p.add_argument("--json", default="", help="write the results here too")
  args = p.parse_args(argv)
  if not os.path.exists(args.data):
    sys.exit(f"bench/nanogpt.py: --data={args.data} does not exist")
  s = shape(args)
  tokens = s["batch_size"] * s["block_size"]
  kind = "gpu" if args.gpu else "cpu"
  print(f"{'GPU' if args.gpu else 'CPU'} recipe: {s['n_layer']} layers x {s['n_embd']}, {s['n_head']} heads, "
        f"batch {s['batch_size']} x {s['block_size']}, {s['max_iters']} steps; nanoGPT's published val loss "
        f"{PUBLISHED[kind]}")
  results = {}
  if args.nanogpt:
    prepare(args)
    with tempfile.TemporaryDirectory() as out_dir:
      load = os.getloadavg()[0]
      wall, out = run(nanogpt_command(args) + [f"--out_dir={out_dir}"], args.nanogpt, args)
      results["nanoGPT"] = dict(nanogpt_result(out), wall_s=wall, load=(load, os.getloadavg()[0]))
  with tempfile.TemporaryDirectory() as workdir:
    load = os.getloadavg()[0]
    wall, out = run(ours_command(args, workdir), REPO, args)
    results["lm_jax"] = dict(ours_result(workdir, tokens), wall_s=wall, load=(load, os.getloadavg()[0]))
  print(f"{'':8} {'wall s':>7} {'ms/step':>8} {'tokens/s':>9} {'val loss':>9} {'best':>7}  {'load before/after':>17}  "
        "val loss is")
  for name, r in results.items():
    what = "mean of eval_iters random batches" if name == "nanoGPT" else \
        "exact, first 2 batches" if args.quick else "exact, whole val split"
    print(f"{name:8} {r['wall_s']:7.1f} {r['ms_step']:8.1f} {1000 * tokens / r['ms_step']:9,.0f} "
          f"{r['val_loss']:9.4f} {r['best']:7.4f}  {r['load'][0]:8.2f}/{r['load'][1]:.2f}  {what}")
  print(f"lm_jax's best val loss - nanoGPT's published {PUBLISHED[kind]}: "
        f"{results['lm_jax']['best'] - PUBLISHED[kind]:+.4f} nats/char")
  if "nanoGPT" in results:
    n, o = results["nanoGPT"], results["lm_jax"]
    print(f"lm_jax / nanoGPT: wall {o['wall_s'] / n['wall_s']:.2f}x, step {o['ms_step'] / n['ms_step']:.2f}x; "
          f"val loss difference {o['val_loss'] - n['val_loss']:+.4f} nats/char")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return results


if __name__ == "__main__":
  main()

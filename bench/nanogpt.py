"""nanoGPT's own train.py against lm_jax's configs/nanogpt.py, one after the other on this machine.

  python bench/nanogpt.py --nanogpt=DIR                 # the README's CPU line (2000 iterations), both sides
  python bench/nanogpt.py --nanogpt=DIR --gpu           # config/train_shakespeare_char.py on one GPU
  python bench/nanogpt.py --quick                       # a 1-layer, 10-step smoke test (nanoGPT too with --nanogpt)
  python bench/nanogpt.py --nanogpt=DIR --shapes=grid   # the CPU recipe on a grid of shapes, with our step's split
  python bench/nanogpt.py --shapes=tiny --steps=20      # 2 shapes, ours only (tests/test_bench_smoke.py)

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

--shapes=grid runs the CPU recipe (dropout 0, eval left out of the step times) on GRID's shapes, nanoGPT then ours
back to back for each, --steps steps each, and then splits our step in this process (ms per step, the best of
3 repeats): `fb`, a minimal jax.jit of the model's forward and backward (value_and_grad of the loss, no optimizer);
`opt`, the same jit with clipping and AdamW applied; `step`, lm_jax's compiled train step (grad norm, lr and loss
metrics, donated state) fed each step from the numpy batch as the loop does; `bare`, that step in a minimal Python
loop of --steps steps on fresh batches of the run's iterator, right after our run (one window, no logs); `disp`, the
host CPU time of one step call with its batch (not its wall time: with 32 steps queued, XLA:CPU's limit of
computations in flight, a call waits for a slot); `host`, the run's step less `bare`, what our loop adds. The
differences are what the optimizer, the metrics and the loop each cost.
`matmul %`: the step's matmul FLOPs at XLA:CPU's rate for a jitted (B*T, D) x (D, 4D) product measured in the
same run, as a share of our step.
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
GRID = {   # (n_layer, n_head, n_embd, block_size, batch_size): the CPU recipe's layers 2-6, width 128-384, ...
    "grid": [(4, 4, 128, 64, 12),     # the README's CPU line
             (2, 4, 128, 64, 8), (6, 6, 192, 64, 8), (3, 6, 384, 64, 8), (3, 4, 256, 128, 8),
             (2, 4, 128, 256, 8), (2, 4, 128, 64, 64)],
    "tiny": [(1, 4, 64, 32, 4), (1, 4, 64, 64, 8)]}


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


KEYS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size")


def grid_nanogpt_command(sh: dict, steps: int) -> list[str]:
  return [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
          "--dropout=0.0", "--log_interval=1", "--always_save_checkpoint=False", f"--max_iters={steps}",
          f"--lr_decay_iters={steps}", f"--eval_interval={steps}", "--eval_iters=2"] + [f"--{k}={sh[k]}" for k in KEYS]


def grid_overrides(sh: dict, steps: int, data: str) -> dict:
  return {"data.files": data, "model.num_layers": sh["n_layer"], "model.num_heads": sh["n_head"],
          "model.d_model": sh["n_embd"], "model.d_ff": 4 * sh["n_embd"], "data.seq_len": sh["block_size"],
          "model.max_positions": sh["block_size"], "batch_size": sh["batch_size"], "total_steps": steps,
          "log_every": max(steps // 4, 1), "eval_every": steps, "data.eval_batches": 2, "checkpoint_every": steps}


def _ms(fn, n: int, repeats: int = 3) -> float:
  """The best over repeats of the ms per call of n calls of fn (which returns what to wait for), after one warm-up:
  on a shared machine the least disturbed repeat."""
  import jax
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t, out = time.perf_counter(), [fn() for _ in range(n)]
    jax.block_until_ready(out)
    times.append(1000 * (time.perf_counter() - t) / n)
  return min(times)


def train_ours(sh: dict, args) -> float:
  """Our run's median ms per step (log windows after the first), trained in this process (lm_jax.train, as
  `python -m lm_jax.main` does, its console quiet): no second interpreter's imports per shape."""
  sys.path.insert(0, REPO)
  import contextlib
  from lm_jax import config_lib, train
  config = config_lib.override(config_lib.load("configs/nanogpt.py:shakespeare_char_cpu",
                                               grid_overrides(sh, args.steps, args.data)), args.set)
  with tempfile.TemporaryDirectory() as workdir, open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
    train.train(config, workdir)
    return ours_result(workdir, sh["batch_size"] * sh["block_size"])["ms_step"]


def split_step(sh: dict, n: int, steps: int, data: str) -> dict:
  """Our step in parts (ms per step): fb, opt, step, bare (a minimal loop of `steps` steps) and dispatch (the host
  CPU time of one step call with its batch), the matmul rate."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import linen as nn
  from lm_jax import config_lib, setup as setup_lib, sharding, step as step_lib
  from lm_jax.data import pipeline
  config = config_lib.load("configs/nanogpt.py:shakespeare_char_cpu", grid_overrides(sh, 10, data))
  with tempfile.TemporaryDirectory() as workdir:
    s = setup_lib.setup(config, workdir)
  it = pipeline.make_train_iterator(config, s.tokenizer, s.objective)
  host_batch = next(it)
  tokens, d = sh["batch_size"] * sh["block_size"], sh["n_embd"]
  x, w = jnp.ones((tokens, d), jnp.float32), jnp.ones((d, 4 * d), jnp.float32)
  mm = jax.jit(jnp.dot)
  matmul_rate = 2 * tokens * d * 4 * d / (_ms(lambda: mm(x, w), 20, 5) / 1000)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    batch_sh = sharding.batch_sharding(s.mesh)
    batch = sharding.global_batch(host_batch, batch_sh)
    state = step_lib.fresh_state(s.policy, s.tx, s.state_sharding)
    loss = lambda p, b: s.objective.loss(config, p, b, s.objective.denominators(b), rng=jax.random.key(0),
                                         train=True)[0]
    grad = jax.jit(jax.value_and_grad(loss))
    params, opt_state = state["params"], state["opt_state"]
    fb = _ms(lambda: grad(params, batch), n)

    def update(p, o, b):
      l, g = jax.value_and_grad(loss)(p, b)
      u, o = s.tx.update(g, o, p)
      return optax.apply_updates(p, u), o, l
    update = jax.jit(update)
    opt = _ms(lambda: update(params, opt_state, batch), n)
    train_step = step_lib.make_train_step(s.policy, s.objective, s.tx, s.lr_schedule, s.state_sharding, s.mesh)
    held = [state]

    def one():
      held[0], metrics = train_step(held[0], host_batch)   # numpy rows, as lm_jax.train passes them
      return metrics
    full = _ms(one, n)
    bare, calls = [], []
    start = time.perf_counter()
    for _ in range(steps):   # the run's steps, each on a fresh batch: what our loop adds is ours - bare
      t = time.thread_time()
      held[0], metrics = train_step(held[0], next(it))
      calls.append(1000 * (time.thread_time() - t))
      bare.append(metrics)
    jax.block_until_ready((held, bare))
    bare = 1000 * (time.perf_counter() - start) / steps
  return {"fb": fb, "opt": opt, "step": full, "bare": bare, "dispatch": statistics.median(calls),
          "matmul_tflops": matmul_rate / 1e12, "flops": config.batch_size * s.objective.flops_per_example(config)}


def grid(args):
  """Each shape of GRID[args.shapes]: nanoGPT (with --nanogpt) and ours back to back, then our step's split."""
  rows = []
  if args.threads:   # ours trains in this process: pinned as run() pins nanoGPT's
    os.sched_setaffinity(0, range(args.threads))
  if args.nanogpt:
    prepare(args)
  print(f"{len(GRID[args.shapes])} shapes, {args.steps} steps each; load {os.getloadavg()[0]:.2f}", flush=True)
  for shape_tuple in GRID[args.shapes]:
    sh = dict(zip(KEYS, shape_tuple))
    row = dict(sh, load=[os.getloadavg()[0]])
    if args.nanogpt:
      with tempfile.TemporaryDirectory() as out_dir:
        _, out = run(grid_nanogpt_command(sh, args.steps) + [f"--out_dir={out_dir}"], args.nanogpt, args)
      row["nanogpt"] = nanogpt_result(out)["ms_step"]
    row["ours"] = train_ours(sh, args)
    row.update(split_step(sh, max(args.steps // 10, 5), args.steps, args.data))
    row["load"].append(os.getloadavg()[0])
    rows.append(row)
    print(grid_line(row), flush=True)
  print_grid(rows)
  return rows


HEADER = (f"{'L x D, heads':>13} {'T x B':>8} {'nanoGPT':>8} {'lm_jax':>7} {'ratio':>6} {'matmul %':>8} {'fb':>6} "
          f"{'opt':>6} {'step':>6} {'bare':>6} {'disp':>5} {'host':>5}  load")


def grid_line(r: dict) -> str:
  ratio = f"{r['nanogpt'] / r['ours']:6.2f}" if "nanogpt" in r else f"{'-':>6}"
  nano = f"{r['nanogpt']:8.1f}" if "nanogpt" in r else f"{'-':>8}"
  floor = 100 * r["flops"] / (r["matmul_tflops"] * 1e12) * 1000 / r["ours"]
  return (f"{r['n_layer']:>4} x {r['n_embd']:3}, {r['n_head']} {r['block_size']:>4} x {r['batch_size']:<3} {nano} "
          f"{r['ours']:7.1f} {ratio} {floor:7.0f}% {r['fb']:6.1f} {r['opt']:6.1f} {r['step']:6.1f} {r['bare']:6.1f} "
          f"{r['dispatch']:5.2f} {r['ours'] - r['bare']:5.1f}  {r['load'][0]:.2f}-{r['load'][1]:.2f}")


def print_grid(rows: list[dict]):
  print("ms per step (nanoGPT: median 'time' of its iterations; lm_jax: median log window). ratio = nanoGPT / lm_jax "
        "(> 1: ours faster). fb / opt / step: a minimal jit of forward+backward / + clip and AdamW / our train step "
        "with metrics fed from numpy (best of 3); bare: our step in a minimal loop of the run's steps, fresh batches; "
        "disp: host CPU ms of one step call with its batch; host: lm_jax - bare, what our loop adds")
  print(HEADER)
  for r in rows:
    print(grid_line(r))
  ratios = [r["nanogpt"] / r["ours"] for r in rows if "nanogpt" in r]
  if ratios:
    print(f"nanoGPT / lm_jax: median {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x; "
          f"load {os.getloadavg()[0]:.2f} at the end")


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
  p.add_argument("--shapes", default="", choices=["", *GRID], help="a grid of CPU shapes instead of one run")
  p.add_argument("--steps", type=int, default=200, help="steps per shape of --shapes")
  args = p.parse_args(argv)
  if not os.path.exists(args.data):
    sys.exit(f"bench/nanogpt.py: --data={args.data} does not exist")
  if args.shapes:
    rows = grid(args)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return rows
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

"""µP's learning-rate transfer (Tensor Programs V, Yang et al. 2022, Fig. 1) as an lm_jax.sweep: Adam learning rates
2^-12 ... 2^-5 at widths 64 ... 512 under µP (model.mup_base_width = the narrowest width) and the standard
parametrization, each trial an ordinary `python -m lm_jax.main` run under one sweep root; then each width's best
rate. Under µP the optimum should stay within one grid step (2x) from the narrowest width to the widest; under SP it
moves toward smaller rates as the model widens.

  python bench/mup_transfer.py --root=DIR [--workers=2]    # the grid: 8 lrs x 4 widths x {µP, SP}, 300 steps
  python bench/mup_transfer.py --root=DIR --variant=cpu     # the same lrs at widths 32, 256, batch 8 x 32
  python bench/mup_transfer.py --root=DIR --variant=quick   # 3 trials of 2 steps (CI)

The file is also the sweep's config (`get_config`, `get_sweep`): more workers, on this machine or others sharing DIR,
join with `python -m lm_jax.sweep run --config=bench/mup_transfer.py[:VARIANT] --root=DIR`, and a killed one's trial
is resumed by the next (docs/sweeps.md). Each trial trains configs/gpt2.py:tiny (2 layers, 4 heads) at d_model =
width, d_ff = 4 width, on Tiny Shakespeare's characters ($LM_JAX_DATA/tiny_shakespeare/input.txt; nanoGPT's 90/10
split and random windows), batch 16 x 64 (`cpu`: 8 x 32), AdamW without weight decay or clipping (both would couple
the widths), 10% linear warmup then cosine; the score is the loss on the whole held-out 10% (`cpu`: its first 32
batches) after the last step. µP at the base width is SP's model, so that trial runs once. Printed: the table of
loss per lr and width, each width's optimum, and how far (in 2x grid steps) it moves from the narrowest width to
the widest; DIR/mup_transfer.json holds the numbers and DIR/mup_transfer.png the paper's plot (loss against lr, a
line per width, µP beside SP). `python -m lm_jax.sweep collect --root=DIR` writes results.csv.
"""
import os

VARIANTS = {   # eval_batches 0: the whole held-out split
    "full": dict(lrs=range(-12, -4), widths=(64, 128, 256, 512), steps=300, batch=16, seq_len=64, eval_batches=0),
    "cpu": dict(lrs=range(-12, -4), widths=(32, 256), steps=300, batch=8, seq_len=32, eval_batches=32),
    "quick": dict(lrs=(-7,), widths=(16, 32), steps=2, batch=4, seq_len=16, eval_batches=2)}
NAMES = {"mup": "µP", "sp": "SP"}


def _variant(arg: str) -> dict:
  if arg not in VARIANTS:
    raise ValueError(f"bench/mup_transfer.py: unknown variant {arg!r}; use {' or '.join(VARIANTS)}")
  return VARIANTS[arg]


def get_config(arg="full"):
  from lm_jax import config_lib
  v = _variant(arg)
  c = config_lib.load("configs/gpt2.py:tiny")
  c.model.vocab_size = 65                     # Tiny Shakespeare's distinct characters
  c.model.d_model, c.model.d_ff = v["widths"][0], 4 * v["widths"][0]
  c.data.tfds_name = ""
  c.data.files = os.path.join(os.environ.get("LM_JAX_DATA", "data"), "tiny_shakespeare", "input.txt")
  c.data.tokenizer_type, c.data.split_fraction, c.data.windows = "char", 0.9, True
  c.data.seq_len = c.model.max_positions = v["seq_len"]
  c.data.eval_batches = v["eval_batches"]
  o = c.optimizer
  o.name, o.weight_decay, o.clip_norm = "adamw", 0.0, 0.0
  o.schedule, o.warmup_steps = "cosine", v["steps"] // 10
  c.batch_size, c.total_steps = v["batch"], v["steps"]
  c.log_every, c.eval_every, c.checkpoint_every = max(1, v["steps"] // 6), v["steps"], v["steps"]
  return c


def get_sweep(arg="full"):
  """lr x width x {µP, SP}; µP's trial at the base width is SP's (mup_base_width 0: the same model, named once)."""
  v = _variant(arg)
  base = v["widths"][0]
  return [{"optimizer.lr": 2.0 ** e, "model.d_model": w, "model.d_ff": 4 * w, "model.mup_base_width": b}
          for e in v["lrs"] for w in v["widths"] for b in dict.fromkeys((0, base if w != base else 0))]


def table(rows: list[dict], widths, lrs) -> dict:
  """{parametrization: {width: {log2 lr: final eval loss or None}}} from lm_jax.sweep.results.read's rows."""
  import math
  by = {(r["model.d_model"], r["model.mup_base_width"], round(math.log2(r["optimizer.lr"]))): r["final_eval_loss"]
        for r in rows if r["status"] == "done"}
  base = widths[0]
  return {name: {w: {e: by.get((w, base if name == "mup" and w != base else 0, e)) for e in lrs} for w in widths}
          for name in NAMES}


def optimum(losses: dict):
  """The log2 lr of the lowest finite loss in {log2 lr: loss}, or None."""
  import math
  finite = {e: v for e, v in losses.items() if v is not None and math.isfinite(v)}
  return min(finite, key=finite.get) if finite else None


def plot(losses: dict) -> bytes:
  import io
  from matplotlib.figure import Figure
  fig = Figure(figsize=(9, 3.6))
  axes = fig.subplots(1, 2, sharey=True)
  for ax, (name, per_width) in zip(axes, losses.items()):
    for w, by_lr in per_width.items():
      points = sorted((e, v) for e, v in by_lr.items() if v is not None)
      ax.plot([e for e, _ in points], [v for _, v in points], marker="o", label=f"width {w}")
    ax.set_title(NAMES[name])
    ax.set_xlabel("log2 learning rate")
  axes[0].set_ylabel("held-out loss")
  axes[0].legend(fontsize="small")
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=80)
  return buffer.getvalue()


def main(argv=None):
  import argparse
  import pathlib
  import subprocess
  import sys

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--root", required=True, help="the sweep's folder (local or gs://); a rerun resumes it")
  p.add_argument("--variant", default="full", choices=list(VARIANTS), help="full: the issue's grid; cpu: 8 lrs x "
                 "widths 32, 256 at batch 8 x 32 (what a loaded 2-core machine ran); quick: 3 trials of 2 steps (CI)")
  p.add_argument("--workers", type=int, default=1, help="sweep workers started here")
  args = p.parse_args(argv)
  if args.workers < 1:
    p.error(f"--workers={args.workers} must be at least 1")
  repo = pathlib.Path(__file__).resolve().parents[1]
  sys.path.insert(0, str(repo))
  from lm_jax.sweep import results, worker

  arg = args.variant
  v = VARIANTS[arg]
  cmd = [sys.executable, "-m", "lm_jax.sweep", "run", f"--config={repo / 'bench' / 'mup_transfer.py'}:{arg}",
         f"--root={args.root}"]
  workers = [subprocess.Popen(cmd, cwd=repo) for _ in range(args.workers)]
  codes = [w.wait() for w in workers]
  if any(codes):
    sys.exit(f"error: a sweep worker exited {max(codes)}; see its lines above (rerun to resume)")
  rows, _ = results.read(args.root, "eval_loss")
  widths, lrs = list(v["widths"]), list(v["lrs"])
  losses = table(rows, widths, lrs)
  print(f"\n{v['steps']} steps, batch {v['batch']} x {v['seq_len']} characters; held-out loss per log2 lr")
  print(f"{'':4} {'width':>5} " + " ".join(f"{f'2^{e}':>7}" for e in lrs) + "   optimum")
  summary = {}
  for name, per_width in losses.items():
    best = {w: optimum(by_lr) for w, by_lr in per_width.items()}
    for w, by_lr in per_width.items():
      cells = " ".join(f"{x:7.4f}" if x is not None else f"{'-':>7}" for x in by_lr.values())
      print(f"{NAMES[name]:4} {w:>5} {cells}   2^{best[w]}")
    shift = None if None in (best[widths[0]], best[widths[-1]]) else best[widths[-1]] - best[widths[0]]
    summary[name] = {"optimum_log2_lr": best, "shift_grid_steps": shift}
  for name, s in summary.items():
    print(f"{NAMES[name]}: the optimum moves {s['shift_grid_steps']} grid step(s) (2x each) from width {widths[0]} "
          f"to {widths[-1]}")
  worker.write_json(worker.path(args.root, "mup_transfer.json"), {"variant": arg, **v, "lrs": lrs,
                                                                   "losses": losses, "summary": summary})
  results._write(worker.path(args.root, "mup_transfer.png"), plot(losses))
  print(f"wrote {worker.path(args.root, 'mup_transfer.json')} and mup_transfer.png")


if __name__ == "__main__":
  main()

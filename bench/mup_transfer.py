"""µP's learning-rate transfer (Tensor Programs V, Yang et al. 2022, Fig. 1): sweep Adam learning rates 2^-12 ... 2^-5
at widths 64 ... 512 under µP (model.mup_base_width = the narrowest width) and the standard parametrization, on Tiny
Shakespeare bytes, and report each width's best rate. Under µP the optimum should stay within one grid step (2x)
from the narrowest width to the widest; under SP it moves toward smaller rates as the model widens.

  python bench/mup_transfer.py                                   # the full grid: 8 lrs x 4 widths x 2, 300 steps
  python bench/mup_transfer.py --lrs=-10,-8,-6 --widths=64,256 --steps=50   # a reduced grid

Each trial trains configs/gpt2.py:tiny widened by lm_jax.scaling.coord_check.widen (d_model, d_ff together; 4
heads, 2 layers) on byte tokens (vocab 256), batch --batch of --seq_len, constant lr after --warmup steps, with the
config's optimizer and the µP multipliers of lm_jax.optim; the score is the mean loss on --eval_batches held-out
batches (the last 10% of the text). Printed: a line per trial, a table of loss per lr and width, each width's
optimum, and the shift of the optimum (in grid steps of 2x) from the narrowest width to the widest; --out writes the
numbers as JSON.
"""
import argparse
import json
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from lm_jax import config_lib, models, optim, params as params_lib  # noqa: E402
from lm_jax.models import layers  # noqa: E402
from lm_jax.scaling import coord_check  # noqa: E402

DATA = os.environ.get("LM_JAX_DATA", str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"))


def byte_batches(text: bytes, batch: int, length: int, seed: int):
  """An endless stream of (batch, length + 1) windows of `text` at random offsets."""
  data, rng = np.frombuffer(text, np.uint8).astype(np.int32), np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - length - 1, batch)
    yield jnp.asarray(np.stack([data[s:s + length + 1] for s in starts]))


def trial(config, model_cfg, lr: float, train: bytes, held_out: bytes, args) -> float:
  """Held-out loss after args.steps steps at `lr` (NaN if the run diverged)."""
  run = config.copy_and_resolve_references()
  run.unlock()
  run.model = model_cfg
  run.optimizer.update(lr=lr, schedule="constant", warmup_steps=args.warmup)
  run.total_steps = args.steps
  model = models.family(model_cfg).Model(layers.frozen(model_cfg))
  p = params_lib.init(run, jax.random.key(args.seed))
  tx, _ = optim.make(run, models.logical_axes(model_cfg))

  def loss(p, ids):
    logits = model.apply({"params": p}, {"input_ids": ids[:, :-1]})["logits"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

  @jax.jit
  def step(p, state, ids):
    grads = jax.grad(loss)(p, ids)
    updates, state = tx.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  state, batches = tx.init(p), byte_batches(train, args.batch, args.seq_len, args.seed)
  for _ in range(args.steps):
    p, state = step(p, state, next(batches))
  held = byte_batches(held_out, args.batch, args.seq_len, args.seed + 1)
  score = jax.jit(loss)
  value = float(np.mean([score(p, next(held)) for _ in range(args.eval_batches)]))
  return value if math.isfinite(value) else float("nan")


def optimum(losses: dict) -> int | None:
  """The log2 lr of the lowest finite loss in {log2 lr: loss}."""
  finite = {k: v for k, v in losses.items() if math.isfinite(v)}
  return min(finite, key=finite.get) if finite else None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="configs/gpt2.py:tiny")
  p.add_argument("--widths", default="64,128,256,512")
  p.add_argument("--lrs", default="-12,-11,-10,-9,-8,-7,-6,-5", help="log2 of the learning rates")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--layers", type=int, default=0, help="model.num_layers (0: the config's)")
  p.add_argument("--warmup", type=int, default=0)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=64)
  p.add_argument("--eval_batches", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--data", default=os.path.join(DATA, "tiny_shakespeare", "input.txt"))
  p.add_argument("--out", help="write the results here as JSON")
  args = p.parse_args(argv)
  widths, lrs = [int(w) for w in args.widths.split(",")], [int(v) for v in args.lrs.split(",")]
  text = pathlib.Path(args.data).read_bytes()
  cut = len(text) * 9 // 10
  overrides = {"model.vocab_size": 256, "model.max_positions": args.seq_len}
  config = config_lib.load(args.config, {**overrides, **({"model.num_layers": args.layers} if args.layers else {})})
  results, done = {}, {}   # done: loss by (model config, lr); µP at the base width is SP's model (widen)
  for name in coord_check.PARAMETRIZATIONS:
    results[name] = {}
    for w in widths:
      model_cfg = coord_check.widen(config.model, w, widths[0] if name == "mup" else 0)
      results[name][w] = {}
      for e in lrs:
        start, key = time.perf_counter(), (model_cfg.to_json(), e)
        if key not in done:
          done[key] = trial(config, model_cfg, 2.0 ** e, text[:cut], text[cut:], args)
        results[name][w][e] = done[key]
        print(f"{name} width {w} lr 2^{e}: held-out loss {results[name][w][e]:.4f} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
  print(f"\n{args.steps} steps, batch {args.batch} x {args.seq_len} bytes; held-out loss per log2 lr")
  print(f"{'':4} {'width':>5} " + " ".join(f"{f'2^{e}':>7}" for e in lrs) + "   optimum")
  summary = {}
  for name, per_width in results.items():
    best = {w: optimum(losses) for w, losses in per_width.items()}
    for w, losses in per_width.items():
      print(f"{name:4} {w:>5} " + " ".join(f"{losses[e]:7.4f}" for e in lrs) + f"   2^{best[w]}")
    shift = None if None in (best[widths[0]], best[widths[-1]]) else best[widths[-1]] - best[widths[0]]
    summary[name] = {"optimum_log2_lr": best, "shift_grid_steps": shift}
  for name, s in summary.items():
    print(f"{name}: optimum moves {s['shift_grid_steps']} grid step(s) (2x each) from width {widths[0]} to "
          f"{widths[-1]}")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "losses": results, "summary": summary},
                                                 indent=1))


if __name__ == "__main__":
  main()

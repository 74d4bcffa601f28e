"""python -m lm_jax.scaling {fit, allocate, predict, sweep, coord_check}: each prints one JSON object on stdout.

  fit      --runs runs.csv [--plot fit.png] [--bootstrap 200]   Hoffmann Approach 3 (+ Approach 2 when >= 2
                                                                IsoFLOP budgets have >= 3 sizes)
  allocate --flops C [--law chinchilla|epoch|kaplan]            compute-optimal N, D and predicted loss
  predict  --params N --tokens D [--law ...]                    predicted loss
  sweep    --workdir DIR [--budgets ...] [--sizes ...]          train tiny decoders, write runs.csv, fit, plot
  coord_check --config FILE[:VARIANT] --widths 64,128,256,512 --out DIR   µP's coordinate check (docs/mup.md)
"""
import argparse
import json
import os
import sys

from lm_jax.scaling import laws

DATA = os.environ.get("LM_JAX_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))


def fit_runs(runs, *, plot=None, bootstrap=0, seed=0, level=0.95):
  """The fit JSON for a dict of run arrays (see fit.read_runs); writes the plot when asked."""
  from lm_jax.scaling import fit
  if len(runs["N"]) < 5:
    print(f"warning: {len(runs['N'])} runs for 5 parameters: the fit is underdetermined", file=sys.stderr)
  law, huber = fit.fit_approach3(runs["N"], runs["D"], runs["loss"])
  approach2 = fit.fit_approach2(runs["N"], runs["D"], runs["loss"], runs["C"])
  out = {**law.to_dict(), "huber": huber, "runs": len(runs["N"]), "approach2": approach2}
  if bootstrap:
    ci, _ = fit.bootstrap(runs["N"], runs["D"], runs["loss"], num=bootstrap, seed=seed, level=level, law=law)
    out.update(ci=ci, ci_level=level, bootstrap=bootstrap)
  if plot:
    from lm_jax.scaling import plot as plotting
    plotting.plot_fit(runs, law, approach2, plot)
    out["plot"] = plot
  return out


def coord_check(args) -> dict:
  """Runs the check and writes its files; a wrong flag or config value is one line and exit 2."""
  from lm_jax import config_lib
  from lm_jax.scaling import coord_check as check
  try:
    widths = [int(w) for w in args.widths.split(",")]
    if args.steps < 1 or not args.lr > 0:
      raise ValueError(f"--steps must be >= 1 and --lr > 0, got {args.steps} and {args.lr}")
    config = config_lib.load(args.config)
    results = check.run(config, widths, steps=args.steps, lr=args.lr, seed=args.seed)
  except (ValueError, config_lib.ConfigError) as e:
    print(f"lm_jax.scaling coord_check: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  return {"out": check.write(results, args.out),
          **{name: {"logits": r["layers"]["logits"]} for name, r in results.items()}}


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m lm_jax.scaling", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  f = sub.add_parser("fit", help="fit L(N, D) = E + A/N^alpha + B/D^beta to runs")
  f.add_argument("--runs", required=True, help="CSV: N, loss and D (tokens) or C (= 6ND)")
  f.add_argument("--plot", help="write a PNG here")
  f.add_argument("--bootstrap", type=int, default=0, help="resamples for confidence intervals (0 = none)")
  f.add_argument("--ci", type=float, default=0.95, help="confidence level of the bootstrap intervals")
  f.add_argument("--seed", type=int, default=0)
  a = sub.add_parser("allocate", help="compute-optimal N and D for a FLOP budget")
  a.add_argument("--flops", type=float, required=True)
  a.add_argument("--law", choices=laws.LAWS, default="chinchilla")
  r = sub.add_parser("predict", help="predicted loss for N params and D tokens")
  r.add_argument("--params", type=float, required=True)
  r.add_argument("--tokens", type=float, required=True)
  r.add_argument("--law", choices=laws.LAWS, default="chinchilla")
  s = sub.add_parser("sweep", help="train an IsoFLOP grid of tiny decoders, then fit and plot")
  s.add_argument("--workdir", required=True)
  s.add_argument("--budgets", default="1e11,3e11,1e12", help="compute budgets C in FLOPs, comma-separated")
  s.add_argument("--sizes", default="1x16,1x32,2x48,3x64,4x96", help="LAYERSxD_MODEL,... (heads = d/16, d_ff = 4d)")
  s.add_argument("--data", default=os.path.join(DATA, "wikitext-2-raw", "wiki.{split}.raw"),
                 help="text files (glob; {split} -> split name)")
  s.add_argument("--train_split", default="train")
  s.add_argument("--eval_split", default="valid")
  s.add_argument("--vocab", type=int, default=512)
  s.add_argument("--seq_len", type=int, default=128)
  s.add_argument("--batch", type=int, default=4, help="sequences per step (small: tiny models need updates)")
  s.add_argument("--lr", type=float, default=2e-3)
  s.add_argument("--eval_batches", type=int, default=32)
  s.add_argument("--min_steps", type=int, default=300,
                 help="skip (budget, size) pairs with fewer steps (still on the unigram plateau)")
  s.add_argument("--bootstrap", type=int, default=0)
  c = sub.add_parser("coord_check", help="mean |activation| per layer across widths under µP and SP")
  c.add_argument("--config", required=True, help="configs/FILE.py[:VARIANT], e.g. configs/gpt2.py:tiny")
  c.add_argument("--widths", default="64,128,256,512", help="d_model values, increasing; µP's base is the first")
  c.add_argument("--out", required=True, help="folder for mup.json, sp.json and coord_check.png")
  c.add_argument("--steps", type=int, default=3, help="Adam steps before recording")
  c.add_argument("--lr", type=float, default=3e-3, help="Adam lr (SP's logits blow up above ~1e-2 at 512)")
  c.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  if args.command == "allocate":
    out = laws.allocate(args.flops, args.law)
  elif args.command == "predict":
    out = laws.predict(args.params, args.tokens, args.law)
  elif args.command == "coord_check":
    out = coord_check(args)
  elif args.command == "fit":
    from lm_jax.scaling import fit
    out = fit_runs(fit.read_runs(args.runs), plot=args.plot, bootstrap=args.bootstrap, seed=args.seed,
                   level=args.ci)
  else:
    from lm_jax import storage
    from lm_jax.scaling import fit, sweep
    sweep.run_sweep(args.workdir, [float(v) for v in args.budgets.split(",")], sweep.parse_sizes(args.sizes),
                    min_steps=args.min_steps, data_files=args.data, train_split=args.train_split,
                    eval_split=args.eval_split, vocab_size=args.vocab, seq_len=args.seq_len, batch_size=args.batch,
                    lr=args.lr, eval_batches=args.eval_batches)
    runs_csv = os.path.join(args.workdir, "runs.csv")
    out = fit_runs(fit.read_runs(runs_csv), plot=os.path.join(args.workdir, "fit.png"), bootstrap=args.bootstrap)
    out["runs_csv"] = runs_csv
    fit_json = storage.write_new(args.workdir, ".fit-", json.dumps(out, indent=1).encode())   # never through a link
    os.replace(fit_json, os.path.join(args.workdir, "fit.json"))
  print(json.dumps(out))


if __name__ == "__main__":
  main()

"""python -m lm_jax.obs.plot WORKDIR [WORKDIR ...] [--out FILE]: the train and eval curves of one or several runs, from
their metrics.jsonl, in one PNG (matplotlib's Figure, without pyplot: no display, no global state).

Panels, for the fields the records have: loss (train `loss`, eval `eval_loss` and a data mixture's `eval_SOURCE_loss`),
perplexity (every *perplexity field, and exp(`token_loss`) in training), accuracy (every *accuracy field) and
tokens/s. The first row is over steps, the second
over training tokens (train records' `tokens`; eval records at the same step's count). Each run has its colour, train
curves are solid, eval curves dashed.

Dependencies: metrics_log and storage; the scaling fit's plot writes through `save`.
"""
import argparse
import io
import math
import os
import pathlib
import sys

import matplotlib
from matplotlib.figure import Figure

from lm_jax import storage
from lm_jax.obs import metrics_log

PANELS = ("loss", "perplexity", "accuracy", "tokens/s")


def curves(records: list[dict]) -> dict:
  """{panel: {label: [(step, tokens or None, value), ...]}} of one run's records."""
  out = {p: {} for p in PANELS}
  per_step = next((r["tokens"] / r["step"] for r in records if "tokens" in r and r["step"]), None)

  def add(panel, label, record, value):
    tokens = per_step * record["step"] if per_step else None
    out[panel].setdefault(label, []).append((record["step"], tokens, value))
  for r in records:
    train = "loss" in r
    for k, v in r.items():
      if k == "step" or not isinstance(v, (int, float)):
        continue
      if k == "loss" or (k.startswith("eval_") and k.endswith("_loss") and not k.endswith("token_loss")):
        add("loss", k, r, v)
      elif k.endswith("perplexity"):
        add("perplexity", k, r, v)
      elif k == "token_loss" and train:
        add("perplexity", "perplexity", r, math.exp(min(v, 50.0)))
      elif k.endswith("accuracy"):
        add("accuracy", k, r, v)
      elif k == "tokens_per_sec":
        add("tokens/s", "tokens/s", r, v)
  return {p: c for p, c in out.items() if c}


def figure(runs: dict[str, list[dict]]):
  """The figure of {run name: records}: a row over steps, and one over tokens when some run logs them."""
  per_run = {name: curves(records) for name, records in runs.items()}
  panels = [p for p in PANELS if any(p in c for c in per_run.values())]
  if not panels:
    raise ValueError("no loss, perplexity, accuracy or tokens/s in the records")
  with_tokens = any(t is not None for c in per_run.values() for lines in c.values() for points in lines.values()
                    for _, t, _ in points)
  rows = 2 if with_tokens else 1
  fig = Figure(figsize=(4.5 * len(panels), 3.5 * rows), layout="tight")
  axes = fig.subplots(rows, len(panels), squeeze=False)
  colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
  for n, (name, c) in enumerate(per_run.items()):
    for col, panel in enumerate(panels):
      for label, points in c.get(panel, {}).items():
        style = dict(color=colours[n % len(colours)], linestyle="--" if label.startswith("eval_") else "-",
                     marker="o" if len(points) < 20 else None, markersize=3, label=f"{name}: {label}")
        axes[0, col].plot([s for s, _, _ in points], [v for *_, v in points], **style)
        if with_tokens and points[0][1] is not None:
          axes[1, col].plot([t for _, t, _ in points], [v for *_, v in points], **style)
  for col, panel in enumerate(panels):
    for row in range(rows):
      ax = axes[row, col]
      ax.set_title(panel)
      ax.set_xlabel(("step", "tokens")[row])
      if panel == "perplexity":
        ax.set_yscale("log")
      ax.grid(alpha=0.3)
    axes[0, col].legend(fontsize=7)
  return fig


def out_path(out: str) -> pathlib.Path:
  """The image --out names: an existing directory gets curves.png inside it (as `cp FILE DIR`); the format is the
  extension's, one matplotlib writes (ValueError otherwise: matplotlib would add .png to a name without one)."""
  path = pathlib.Path(out)
  if path.is_dir():
    path = path / "curves.png"
  formats = Figure().canvas.get_supported_filetypes()
  if path.suffix[1:].lower() not in formats:
    raise ValueError(f"--out={out}: {f'unknown image format {path.suffix!r}' if path.suffix else 'no extension'}; "
                     f"use one of {' '.join(f'.{f}' for f in sorted(formats))}")
  return path


def save(fig, path, **kwargs):
  """fig as a local image file (its format from the extension), written under a new name and renamed over `path`:
  never through a link placed at `path` (savefig would open the link's target)."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format=pathlib.Path(path).suffix[1:].lower(), **kwargs)
  tmp = storage.write_new(os.path.dirname(path) or ".", f".{os.path.basename(path)}.", buffer.getvalue())
  try:
    os.replace(tmp, path)
  except OSError:
    os.remove(tmp)
    raise


def step_records(path) -> list[dict]:
  """The records of a metrics.jsonl that have a numeric `step` (x-axis); one warning for those without."""
  records = metrics_log.read(path)
  kept = [r for r in records if isinstance(r.get("step"), (int, float)) and not isinstance(r["step"], bool)]
  if len(kept) < len(records):
    metrics_log.warn(f"{path}: {len(records) - len(kept)} record(s) without a numeric step skipped")
  return kept


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m lm_jax.obs.plot", description=__doc__.split("\n\n")[0])
  parser.add_argument("workdirs", nargs="+", metavar="WORKDIR")
  parser.add_argument("--out", default="curves.png", help="the image to write, its format from the extension (.png, "
                      ".pdf, .svg, ...); a directory: DIR/curves.png (default: ./curves.png)")
  args = parser.parse_args(argv)
  try:
    out = out_path(args.out)
  except ValueError as e:   # a flag's value: exit 2, as lm_jax.main's
    print(f"lm_jax.obs.plot: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  runs = {}
  for workdir in args.workdirs:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    records = step_records(path)
    if not records:
      sys.exit(f"lm_jax.obs.plot: no records in {path}")
    runs[workdir] = records
  try:
    fig = figure(runs)
  except ValueError as e:
    sys.exit(f"lm_jax.obs.plot: {e} ({', '.join(args.workdirs)})")
  try:
    save(fig, out, dpi=120)
  except OSError as e:
    sys.exit(f"lm_jax.obs.plot: cannot write --out={out} ({e.strerror or e})")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()

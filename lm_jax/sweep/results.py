"""A sweep's results: ROOT/results.csv with one row per trial (its swept values, the final and best value of a metric,
steps, training seconds, status), read from each trial's own metrics.jsonl; a table of the groups of trials that
differ only in their seed (mean ± sd, n, the best group, and with a target modded-nanogpt's margin
(target − mean) · sqrt(n): at least 0.004 there to accept a record); ROOT/results.png, the metric against the first
swept field, one line per value of the others. Lower is better.
"""
import csv
import io
import json
import math
import os
import statistics

from matplotlib.figure import Figure

from lm_jax import storage
from lm_jax.obs import metrics_log
from lm_jax.sweep import grid, worker


def collect(root: str, metric: str = "eval_loss", target: float | None = None) -> list[dict]:
  """Writes results.csv and results.png into root, prints the table; returns the groups."""
  rows, fields = read(root, metric)
  if not rows:
    raise ValueError(f"{root}: no trials (no */{worker.TRIAL}); run `python -m lm_jax.sweep run` first")
  buffer = io.StringIO()
  out = csv.DictWriter(buffer, ["trial", *fields, f"final_{metric}", f"best_{metric}", "steps", "wall_s", "status"])
  out.writeheader()
  out.writerows(rows)
  _write(worker.path(root, "results.csv"), buffer.getvalue().encode())
  found = groups(rows, fields, metric)
  print(table(found, metric, target))
  swept = [f for f in fields if f != grid.SEED]
  if swept and found:
    _write(worker.path(root, "results.png"), plot(found, swept, metric))
  print(f"wrote {worker.path(root, 'results.csv')}" + (" and results.png" if swept and found else ""))
  return found


def read(root: str, metric: str) -> tuple[list[dict], list[str]]:
  """(a row per trial, the swept fields in order of appearance)."""
  rows, fields = [], {}
  for url in storage.glob(worker.path(root, "*", worker.TRIAL)):
    folder = url.rpartition("/")[0]
    with storage.open(url, "rb") as f:
      swept = json.load(f)["swept"]
    fields.update(dict.fromkeys(swept))
    records = metrics_log.read(worker.path(folder, "metrics.jsonl"))
    values = [r[metric] for r in records if metric in r]
    status = worker.recorded(folder) or "unfinished"
    rows.append({"trial": folder.rpartition("/")[2], **swept,
                 f"final_{metric}": values[-1] if values else None, f"best_{metric}": min(values, default=None),
                 "steps": max((r.get("step", 0) for r in records), default=0),
                 "wall_s": round(sum(r.get(k, 0.0) for r in records for k in metrics_log.TIME_SPLIT), 3),
                 "status": status})
  return rows, list(fields)


def margin(target: float, values: list[float]) -> float:
  """modded-nanogpt's acceptance margin (target − mean) · sqrt(n) of n seeds' values."""
  return (target - statistics.fmean(values)) * math.sqrt(len(values))


def groups(rows: list[dict], fields: list[str], metric: str) -> list[dict]:
  """The done trials grouped by their swept values other than the seed: {"values", "n", "mean", "sd", "finals"}."""
  out = {}
  for row in rows:
    if row["status"] == "done" and row[f"final_{metric}"] is not None:
      key = tuple((f, row.get(f)) for f in fields if f != grid.SEED)
      out.setdefault(key, []).append(row[f"final_{metric}"])
  return [{"values": dict(key), "n": len(v), "mean": statistics.fmean(v), "sd": statistics.stdev(v) if len(v) > 1
           else 0.0, "finals": v} for key, v in out.items()]


def table(found: list[dict], metric: str, target: float | None) -> str:
  label = lambda g: " ".join(f"{f}={grid.text(v)}" for f, v in g["values"].items()) or "(all)"
  lines = [f"final {metric} over seeds (mean ± sd, n)" + (f"; margin = ({target} − mean) · sqrt(n)"
                                                           if target is not None else "")]
  width = max((len(label(g)) for g in found), default=0)
  for g in found:
    line = f"  {label(g):<{width}}  {g['mean']:.4f} ± {g['sd']:.4f}  n={g['n']}"
    lines.append(line + (f"  margin {margin(target, g['finals']):+.4f}" if target is not None else ""))
  if found:
    best = min(found, key=lambda g: g["mean"])
    lines.append(f"best: {label(best)}: {best['mean']:.4f} ± {best['sd']:.4f} (n={best['n']})")
  else:
    lines.append(f"no finished trial has {metric}")
  return "\n".join(lines)


def _write(url: str, data: bytes):
  """A remote object uploaded at once; a local file written beside and renamed over (never through a link placed
  there)."""
  if storage.is_remote(url):
    with storage.open(url, "wb") as f:
      f.write(data)
  else:
    os.replace(storage.write_new(os.path.dirname(url) or ".", ".results-", data), url)


def plot(found: list[dict], swept: list[str], metric: str) -> bytes:
  """PNG: mean ± sd of the metric against swept[0], a line per combination of the other swept fields."""
  x_field, others = swept[0], swept[1:]
  fig = Figure(figsize=(6, 4))
  ax = fig.add_subplot()
  xs = [g["values"][x_field] for g in found]
  numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
  if numeric and min(xs) > 0 and max(xs) >= 2 * min(xs):
    ax.set_xscale("log")
  ticks = {x: i for i, x in enumerate(dict.fromkeys(map(grid.text, xs)))}
  lines = {}
  for g in found:
    key = " ".join(f"{f.rpartition('.')[2]}={grid.text(g['values'][f])}" for f in others)
    lines.setdefault(key, []).append(g)
  for key, line in lines.items():
    line.sort(key=lambda g: g["values"][x_field] if numeric else ticks[grid.text(g["values"][x_field])])
    x = [g["values"][x_field] if numeric else ticks[grid.text(g["values"][x_field])] for g in line]
    ax.errorbar(x, [g["mean"] for g in line], yerr=[g["sd"] for g in line], marker="o", capsize=3, label=key or None)
  if not numeric:
    ax.set_xticks(list(ticks.values()), list(ticks))
  ax.set_xlabel(x_field)
  ax.set_ylabel(metric)
  if others:
    ax.legend(fontsize="small")
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png", dpi=100)
  return buffer.getvalue()

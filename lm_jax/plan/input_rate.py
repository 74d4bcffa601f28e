"""Does the input keep up with the planned step? The tokens/s per host that a predicted step time needs, beside
this pipeline's measured tokens/s per core, on the fly and from prepared shards, and the cores each takes.

The measurement is a table beside this module, input_rates.json (or the file $LM_JAX_INPUT_RATES names), that
bench/data_throughput.py writes: per objective (and NSP) and seq_len, the single-process rate on WikiText-2 with the
paper's config, and the load of the machine it ran on. The row of the same objective and the nearest seq_len is
used; a loaded machine makes it a lower bound, so the cores are an upper bound. The cores assume the work spreads
over processes; on the fly only tokenizing does (data.workers), and prepared input (for MLM + NSP its pairs and
masks made ahead by lm_jax.prepare's processes) is read and batched in one process, so a need above one process's
prepared rate is reported as short.
"""
import json
import math
import os
import pathlib

RATES = pathlib.Path(__file__).resolve().with_name("input_rates.json")   # the library's table; bench/ measures it


def _rows() -> tuple[list, str]:
  path = os.environ.get("LM_JAX_INPUT_RATES") or str(RATES)
  if not os.path.exists(path):
    return [], path
  with open(path) as f:
    return json.load(f), path


def measured(config) -> dict | None:
  """{'on_the_fly': tokens/s of one process, 'prepared': ..., 'seq_len', 'load', 'source'} of the cached row
  closest to config (same objective and NSP, nearest seq_len), or None when nothing was measured for it."""
  rows, path = _rows()
  by_run = {}   # the measurements of one process, by (objective, NSP)
  for r in rows:
    if r["workers"] == 1:
      by_run.setdefault((r["objective"], r["nsp"]), []).append(r)
  same = by_run.get((config.objective, bool(config.data.get("nsp"))), [])
  if not same:
    return None
  seq_len = min({r["seq_len"] for r in same}, key=lambda s: abs(s - config.data.seq_len))
  pick = {r["input"]: r for r in same if r["seq_len"] == seq_len}
  if not {"on the fly", "prepared"} <= pick.keys():
    return None
  return dict(on_the_fly=pick["on the fly"]["tokens_per_s_per_process"],
              prepared=pick["prepared"]["tokens_per_s_per_process"], seq_len=seq_len,
              load=max(p["load"] for p in pick.values()), source=os.path.relpath(path))


def plan(config, tokens_per_second: float, hosts: int) -> dict:
  """The input a step of tokens_per_second (all hosts) needs per host, and the cores that takes."""
  need = tokens_per_second / max(hosts, 1)
  rates = measured(config)
  out = dict(need_per_host=need, measured=rates)
  if rates:
    out.update(cores_on_the_fly=math.ceil(need / rates["on_the_fly"]),
               cores_prepared=math.ceil(need / rates["prepared"]))
  return out


def describe(p: dict) -> str:
  """One line for the compile report."""
  head = f"input: {p['need_per_host']:,.0f} tokens/s per host needed"
  m = p["measured"]
  if not m:
    return f"{head}; this pipeline's rate is not measured for this objective (run bench/data_throughput.py)"
  line = (f"{head}; this pipeline per core: on the fly {m['on_the_fly']:,.0f} -> {p['cores_on_the_fly']} cores, "
          f"prepared {m['prepared']:,.0f} -> {p['cores_prepared']} cores ({m['source']}, seq_len {m['seq_len']}, "
          f"load {m['load']:.1f})")
  if p["cores_prepared"] > 1:   # rows, masks and batches are built in one process (data.workers only tokenize)
    line += (f"; SHORT: the pipeline builds rows in one process, {m['prepared']:,.0f} tokens/s prepared, "
             f"{m['prepared'] / p['need_per_host']:.0%} of the need")
  return line

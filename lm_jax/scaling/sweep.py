"""IsoFLOP sweep with our own trainer: tiny decoders (configs/gpt1.py:tiny, width and depth varied) trained
at a few compute budgets, D = C / 6N tokens each, final eval losses -> runs.csv.

N counts the parameters a token's forward pass multiplies by: non-embedding (Kaplan) plus the tied LM head
(V d), which dominates at this size; 6N per token then equals our exact training FLOPs less the
attention-context term (the `flops` column has the exact count). Every run uses the same tokenizer
(trained once into the sweep dir), the same eval batches, and a cosine schedule that ends at its own
length (Chinchilla §3.1). Finished runs are read back, so an interrupted sweep resumes.
"""
import contextlib
import csv
import glob
import io
import os
import pathlib
import sys
import time

from lm_jax import config_lib, flops, models, objectives, storage, train
from lm_jax.data import tokenizer
from lm_jax.obs import metrics_log

CONFIG_FILE = pathlib.Path(__file__).resolve().parents[2] / "configs" / "gpt1.py"
COLUMNS = ("budget", "N", "D", "C", "flops", "loss", "layers", "d_model", "steps", "seconds")


def parse_sizes(text):
  """'1x32,2x48' -> [(layers, d_model), ...]."""
  try:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
  except ValueError:
    raise ValueError(f"--sizes: expected LAYERSxD_MODEL,... (e.g. 1x32,2x64), got {text!r}") from None


def base_config(*, data_files, train_split, eval_split, vocab_size, seq_len, batch_size, lr, eval_batches):
  return config_lib.load(f"{CONFIG_FILE}:tiny", {
      "data.tfds_name": "", "data.files": data_files, "data.train_split": train_split, "data.eval_split": eval_split,
      "data.seq_len": seq_len, "data.eval_batches": eval_batches, "model.vocab_size": vocab_size,
      "model.max_positions": seq_len, "batch_size": batch_size, "optimizer.lr": lr, "optimizer.schedule": "cosine"})


def sized(config, layers, d_model, steps):
  c = config.copy_and_resolve_references()
  m = c.model
  m.num_layers, m.d_model, m.num_heads, m.d_ff, m.head_dim = layers, d_model, max(1, d_model // 16), 4 * d_model, 0
  c.total_steps = c.eval_every = c.checkpoint_every = steps
  c.log_every = max(1, steps // 5)
  c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, steps // 10)
  return c


def matmul_params(m):
  """Non-embedding params (Kaplan) plus the LM head: 6 N per token ~ training FLOPs."""
  return flops.kaplan_params(m.num_layers, m.d_model, flops.attention_width(m), m.d_ff) + m.d_model * m.vocab_size


def shared_tokenizer(config, workdir):
  """Train the tokenizer once into workdir and point every run at it."""
  tokenizer.load_or_train(config, workdir, models.family(config.model))
  config.data.tokenizer = sorted(glob.glob(os.path.join(workdir, "tokenizer_*.model")))[0]


def final_eval_loss(run_dir, steps):
  records = [r for r in metrics_log.read(os.path.join(run_dir, "metrics.jsonl")) if "eval_loss" in r]
  return records[-1]["eval_loss"] if records and records[-1]["step"] == steps else None


def plan(config, budgets, sizes, min_steps):
  """[(budget, layers, d_model, steps)] for every pair with >= min_steps steps of D = C / 6N."""
  tokens_per_step = config.batch_size * config.data.seq_len
  runs = []
  for budget in budgets:
    for layers, d_model in sizes:
      n = matmul_params(sized(config, layers, d_model, 1).model)
      steps = round(budget / (6 * n) / tokens_per_step)
      if steps >= min_steps:
        runs.append((budget, layers, d_model, steps))
  return runs


def run_sweep(workdir, budgets, sizes, *, min_steps=20, log=sys.stderr, **data_and_optim):
  """Trains every planned run (trainer output -> log) and writes workdir/runs.csv. Returns the rows."""
  os.makedirs(workdir, exist_ok=True)
  config = base_config(**data_and_optim)
  with contextlib.redirect_stdout(log):
    shared_tokenizer(config, workdir)
  runs = plan(config, budgets, sizes, min_steps)
  if not runs:
    raise ValueError(f"sweep: no (budget, size) pair gives >= {min_steps} steps; raise --budgets or shrink --sizes")
  rows = []
  for budget, layers, d_model, steps in runs:
    c = sized(config, layers, d_model, steps)
    run_dir = os.path.join(workdir, f"C{budget:.3g}_L{layers}_d{d_model}")
    t = time.perf_counter()
    loss = final_eval_loss(run_dir, steps)
    if loss is None:
      print(f"sweep: C={budget:.3g} layers={layers} d_model={d_model}: {steps} steps", file=log, flush=True)
      with contextlib.redirect_stdout(log):
        train.train(c, run_dir)
      loss = final_eval_loss(run_dir, steps)
    n, d = matmul_params(c.model), steps * c.batch_size * c.data.seq_len
    rows.append(dict(budget=budget, N=n, D=d, C=6.0 * n * d, loss=loss, layers=layers, d_model=d_model, steps=steps,
                     flops=steps * c.batch_size * objectives.get(c.objective).flops_per_example(c),
                     seconds=round(time.perf_counter() - t, 1)))
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, COLUMNS)
  writer.writeheader()
  writer.writerows(rows)
  # under a new name, then renamed: never written through a link placed at runs.csv
  os.replace(storage.write_new(workdir, ".runs-", text.getvalue().encode()), os.path.join(workdir, "runs.csv"))
  return rows

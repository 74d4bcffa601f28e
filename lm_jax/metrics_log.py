"""workdir/metrics.jsonl (one JSON object per line), TensorBoard events (tensorboardX, no TensorFlow) and the
console line. Only process 0 writes.

On resume the file is cut back to the restored step, so an interrupted-and-resumed run leaves exactly the
records of an uninterrupted one (wall-clock fields such as tokens_per_sec aside).
"""
import datetime
import json
import logging
import os

import jax
from absl import logging as absl_logging

WALL_CLOCK = ("tokens_per_sec", "mfu")  # fields that depend on timing, not on the computation


class _QuietLibraries(logging.Filter):
  """Drops orbax's and jax's INFO lines (dozens per checkpoint) so the console shows the training log;
  their warnings and errors still print."""

  def filter(self, record):
    return record.levelno >= logging.WARNING or not any(f"/{lib}/" in record.pathname for lib in ("orbax", "jax"))


def quiet_libraries():
  handler = absl_logging.get_absl_handler()
  if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
    handler.addFilter(_QuietLibraries())


def read(path: str) -> list[dict]:
  """Records of a metrics.jsonl; a torn last line (killed mid-write) is dropped."""
  records = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:
          break
  return records


class MetricsLog:

  def __init__(self, workdir: str, resume_step: int, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.active = jax.process_index() == 0
    self.tb = None
    if not self.active:
      return
    kept = [r for r in read(self.path) if r.get("step", 0) <= resume_step]
    with open(self.path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    if tensorboard:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

  def write(self, record: dict):
    """Appends one record (must have 'step') to metrics.jsonl and TensorBoard."""
    if not self.active:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self.tb:
      for k, v in record.items():
        if k != "step":
          self.tb.add_scalar(k, v, record["step"])
      self.tb.flush()

  def close(self):
    if self.tb:
      self.tb.close()


def console(record: dict, total_steps: int, seconds_per_step: float | None = None) -> str:
  """'step 120/200 | loss 4.1234 | lr 1.0e-03 | ...' for a train or eval record."""
  parts = [f"step {record['step']}/{total_steps}"]
  for k, v in record.items():
    if k == "step":
      continue
    if k == "tokens_per_sec":
      parts.append(f"{v:,.0f} tok/s")
    elif k == "mfu":
      parts.append(f"mfu {100 * v:.1f}%")
    elif k in ("lr", "eval_perplexity"):
      parts.append(f"{k} {v:.3g}")
    else:
      parts.append(f"{k} {v:.4f}")
  if seconds_per_step is not None:
    eta = datetime.timedelta(seconds=round(seconds_per_step * (total_steps - record["step"])))
    parts.append(f"eta {eta}")
  return " | ".join(parts)

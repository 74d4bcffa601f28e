"""workdir/metrics.jsonl (one JSON object per line), TensorBoard events (tensorboardX, no TensorFlow) and the
console line. Only process 0 writes.

On resume the file is cut back to the restored step, so an interrupted-and-resumed run leaves exactly the
records of an uninterrupted one (wall-clock fields such as tokens_per_sec aside). Workdirs may be remote
(gs://...; etils.epath, TensorBoard there needs google-cloud-storage): remote files cannot be appended to,
so they are rewritten whole.
"""
import datetime
import json
import logging
import os

import jax
from absl import logging as absl_logging
from etils import epath

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


def read(path) -> list[dict]:
  """Records of a metrics.jsonl; a torn last line (killed mid-write) is dropped."""
  path, records = epath.Path(path), []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return records


class MetricsLog:

  def __init__(self, workdir: str, resume_step: int, tensorboard: bool = True):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.remote = "://" in str(workdir)
    self.active = jax.process_index() == 0
    self.tb = None
    if not self.active:
      return
    self.records = [r for r in read(self.path) if r.get("step", 0) <= resume_step]
    self._rewrite()
    if tensorboard:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(str(epath.Path(workdir) / "tensorboard"), purge_step=resume_step + 1)

  def _rewrite(self):
    text = "".join(json.dumps(r) + "\n" for r in self.records)
    if self.remote:
      self.path.write_text(text)
    else:  # atomic: a kill during the rewrite leaves the old file
      tmp = f"{self.path}.tmp{os.getpid()}"
      with open(tmp, "w") as f:
        f.write(text)
      os.replace(tmp, self.path)

  def write(self, record: dict):
    """Appends one record (must have 'step') to metrics.jsonl and TensorBoard."""
    if not self.active:
      return
    self.records.append(record)
    if self.remote:
      self._rewrite()
    else:
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

"""workdir/metrics.jsonl (one JSON object per line), TensorBoard events (tensorboardX, no TensorFlow), Weights &
Biases with config.wandb.project (lm_jax.obs.wandb_log) and the console line. Only process 0 writes.

On resume the file is cut back to the restored step, so an interrupted-and-resumed run leaves exactly the
records of an uninterrupted one (wall-clock fields such as tokens_per_sec aside). Workdirs may be remote
(gs://..., through lm_jax.storage; TensorBoard there uses google-cloud-storage). Remote objects cannot be appended
to, so there metrics.jsonl is a folder of segments: each write uploads one object NNNNNNNN.jsonl with its record
(the cost grows with the new records, not with the run), and a run's start that cuts records back (or finds more
than one segment) writes NNNNNNNN.base.jsonl, which replaces every segment before it, then deletes those. `read`
joins them into the one list of records a local file gives. An evaluator beside the trainer (resume_step None) only
appends: locally to the file, remotely as NNNNNNNN.ID.jsonl segments (ID its own), so no two writers ever write one
object or cut each other's records. Nothing is written through a symbolic link at metrics.jsonl (one line). A
workdir that cannot be written (read-only, full) costs the file, with one warning, never the run's results: the
console line is printed either way; TensorBoard or W&B failing costs only itself, with one warning. A damaged line
in the middle of metrics.jsonl is skipped by name, never a reason to drop the records after it.
"""
import contextlib
import datetime
import functools
import json
import logging
import os
import sys
import threading
import traceback
import uuid

from absl import logging as absl_logging
from etils import epath

from lm_jax import distributed, storage
from lm_jax.obs import goodput, wandb_log

TIME_SPLIT = tuple(f"{k}_s" for k in goodput.SPLIT)   # a train record's time split (lm_jax.loop)
WALL_CLOCK = ("tokens_per_sec", "mfu", *TIME_SPLIT)    # fields that depend on timing, not on the computation


def warn(message: str, remote: bool = False):
  """'warning: ...' on stderr, from process 0 only; `remote`: about a gs:// workdir's storage (storage.hold)."""
  if distributed.is_lead() and not (remote and storage.hold(message)):
    print(f"warning: {message}", file=sys.stderr, flush=True)



def _summary_writer():
  """tensorboardX's SummaryWriter class. Its module imports torch when torch is installed, only to accept torch
  tensors (1.5-3 s of every run's start; lm_jax logs floats), so torch reads as absent while it loads."""
  if "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None   # `import torch` raises ImportError, which tensorboardX catches
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter

class _QuietLibraries(logging.Filter):
  """Drops orbax's and jax's INFO lines (dozens per checkpoint) so the console shows the training log, and
  orbax's errors: each comes with an exception that lm_jax.checkpoint reports in one line (a failed save
  otherwise prints its traceback three times). Warnings still print."""

  def filter(self, record):
    if "/orbax/" in record.pathname:
      return record.levelno == logging.WARNING
    return record.levelno >= logging.WARNING or "/jax/" not in record.pathname


def _in_orbax(filename: str) -> bool:
  return f"{os.sep}orbax{os.sep}" in filename


def _drop_orbax_leftovers(previous, unraisable):
  """orbax's read of a damaged checkpoint abandons its other reads: once lm_jax.checkpoint has reported the failed
  read in one line, each abandoned read coroutine prints a 30-line traceback when collected (500 lines for a tiny
  model), and TensorStore callbacks aimed at the closed asyncio loop print 'Event loop is closed'."""
  error, code = unraisable.exc_value, getattr(unraisable.object, "cr_code", None)
  closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
  if not (closed_loop or (code is not None and _in_orbax(code.co_filename))):
    previous(unraisable)


class _OrbaxUnretrievedTasks(logging.Filter):
  """The same abandoned reads, when they ran as asyncio tasks or gathers that failed too: asyncio logs each one's
  30-line traceback ("... exception was never retrieved") whenever the collector frees it, often at exit."""

  def filter(self, record):
    if "exception was never retrieved" not in record.getMessage() or not record.exc_info:
      return True
    error = record.exc_info[1]
    while error is not None:
      if any(_in_orbax(frame.filename) for frame in traceback.extract_tb(error.__traceback__)):
        return False
      error = error.__cause__ or error.__context__
    return True


def quiet_libraries():
  quiet = _QuietLibraries()
  for target in (absl_logging.get_absl_handler(), logging.getLogger("absl")):  # the logger: also without app.run
    if not any(isinstance(f, _QuietLibraries) for f in target.filters):
      target.addFilter(quiet)
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _OrbaxUnretrievedTasks) for f in asyncio_log.filters):
    asyncio_log.addFilter(_OrbaxUnretrievedTasks())
  if getattr(sys.unraisablehook, "func", None) is not _drop_orbax_leftovers:
    sys.unraisablehook = functools.partial(_drop_orbax_leftovers, sys.unraisablehook)


def read(path) -> list[dict]:
  """Records of a metrics.jsonl (a local file, or a remote folder of segments). A torn last line (killed
  mid-write) is dropped; a damaged line before others is skipped with one warning naming it, and the records after
  it are kept."""
  if storage.is_remote(path):
    text = b"".join(_segment_texts(str(path)).values())
  else:
    path = epath.Path(path)
    text = path.read_bytes() if path.exists() else b""
  records, bad = [], []
  lines = text.decode("utf-8", "replace").splitlines()
  for n, line in enumerate(lines, 1):
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      record = None
    if isinstance(record, dict):
      records.append(record)
    elif n < len(lines) and line.strip():
      bad.append(n)
  if bad:
    warn(f"{path}: line{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} not a JSON record; skipped, the "
         "records after kept")
  return records


def _segments(folder: str) -> list[tuple[int, str]]:
  """(number, URL) of a remote metrics.jsonl's segments, in order: by number, then a base, the trainer's, the
  evaluators' (an evaluator's segment numbered as the trainer's next one sorts after it)."""
  out = []
  for url in storage.list_files(folder):
    number, _, rest = url.rsplit("/", 1)[1].partition(".")
    if number.isdigit() and rest.endswith("jsonl"):
      out.append(((int(number), rest != "base.jsonl", rest != "jsonl", rest), url))
  return [(key[0], url) for key, url in sorted(out)]


def _next_segment(segments: list[tuple[int, str]]) -> int:
  return segments[-1][0] + 1 if segments else 0


def _segment_texts(folder: str) -> dict[str, bytes]:
  """The segments from the last base on, in order."""
  segments = [url for _, url in _segments(folder)]
  bases = [i for i, url in enumerate(segments) if url.endswith(".base.jsonl")]
  texts = storage.read_many(segments[bases[-1] if bases else 0:])
  return {url: texts[url] for url in segments if url in texts}


class MetricsLog:
  """The run's records from resume_step on; with a config whose wandb.project is set, in W&B as well."""

  def __init__(self, workdir: str, resume_step: int | None, tensorboard: bool = True, config=None):
    """resume_step None: an evaluator's log, which appends its records and leaves the others alone."""
    self.workdir = workdir
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.remote = "://" in str(workdir)
    self.active = distributed.is_lead()
    self.writable = self.active
    self.tb = self.wandb = None
    self.records, self.segment, self.writer = [], 0, ""
    if not self.active:
      return
    if not self.remote:
      storage.refuse_link(self.path)
    with self._unless_unwritable():
      if resume_step is None:
        self.writer = f".{uuid.uuid4().hex[:12]}"
        self.segment = _next_segment(_segments(str(self.path))) if self.remote else 0
      elif self.remote:
        self._start_segments(resume_step)
      else:
        self.records = [r for r in read(self.path) if r.get("step", 0) <= resume_step]
        self._rewrite()
    if tensorboard:
      with self._observer("tb", "TensorBoard"):
        self.tb = _summary_writer()(str(epath.Path(workdir) / "tensorboard"), purge_step=resume_step + 1)
        self._catch_writer_thread()
    if config is not None and config.wandb.project:
      with self._observer("wandb", "W&B"):
        self.wandb = wandb_log.start(config, workdir)

  @contextlib.contextmanager
  def _observer(self, attr: str, name: str):
    """TensorBoard or W&B failing (an unwritable folder, the network): one warning, then the run goes on without it:
    observability never costs training."""
    try:
      yield
    except Exception as e:  # noqa: BLE001 - tensorboardX and wandb raise their own types
      warn(f"{name} stopped ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
           "training goes on without it", remote=self.remote and attr == "tb")
      setattr(self, attr, None)

  def _catch_writer_thread(self):
    """tensorboardX uploads from a thread of its own; an upload that fails there (a gs:// workdir whose server is
    gone) would print a 40-line traceback. It becomes the one warning the main thread gives instead."""
    previous = threading.excepthook

    def hook(args):
      if not type(args.thread).__module__.startswith("tensorboardX"):
        return previous(args)
      if self.tb is None:   # already warned
        return None
      with self._observer("tb", "TensorBoard"):
        raise args.exc_value

    threading.excepthook = hook

  def _rewrite(self):
    """Local: the file replaced atomically (a kill during the rewrite leaves the old one)."""
    text = "".join(json.dumps(r) + "\n" for r in self.records)
    os.replace(storage.write_new(str(self.path.parent), "metrics.jsonl.", text.encode()), self.path)

  def _start_segments(self, resume_step: int):
    """Remote: the records up to resume_step; a new base segment when that cuts any or there are several (each
    object is replaced atomically, so a kill leaves the old segments or the new base), then the old ones go."""
    folder = str(self.path)
    segments = _segments(folder)
    old = [url for _, url in segments]
    every = read(folder)
    self.records = [r for r in every if r.get("step", 0) <= resume_step]
    self.segment = _next_segment(segments)
    if len(self.records) < len(every) or len(old) > 1:
      self._upload(self.records, base=True)
      storage.remove(old)

  def _upload(self, records: list[dict], base: bool = False):
    name = f"{self.segment:08d}.base.jsonl" if base else f"{self.segment:08d}{self.writer}.jsonl"
    (self.path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    self.segment += 1

  @contextlib.contextmanager
  def _unless_unwritable(self):
    """An OSError on metrics.jsonl (read-only or full workdir) -> one warning, and the file is left alone."""
    try:
      yield
    except OSError as e:
      warn(f"cannot write {self.path} ({e.strerror or e}); this run's metrics are not recorded there",
           remote=self.remote)
      self.writable = False

  def write(self, record: dict):
    """Appends one record (must have 'step') to metrics.jsonl and TensorBoard."""
    if not self.active:
      return
    self.records.append(record)
    if self.writable:
      with self._unless_unwritable():
        if self.remote:
          self._upload([record])
        else:
          with storage.open_append(str(self.path)) as f:
            f.write(json.dumps(record) + "\n")
    if self.tb:
      with self._observer("tb", "TensorBoard"):
        for k, v in record.items():
          if k != "step":
            self.tb.add_scalar(k, v, record["step"])
        self.tb.flush()
    if self.wandb:
      with self._observer("wandb", "W&B"):
        self.wandb.log(record)

  def close(self, goodput_summary: dict | None = None):
    """Closes TensorBoard's writer and the W&B run, whose summary keeps the goodput numbers as goodput/..."""
    if self.tb:
      with self._observer("tb", "TensorBoard"):
        self.tb.close()
    if self.wandb:
      with self._observer("wandb", "W&B"):
        summary = goodput_summary or {}
        self.wandb.summary.update({k if k == "goodput" else f"goodput/{k}": v for k, v in summary.items()})
        self.wandb.finish()


def console(record: dict, total_steps: int, seconds_per_step: float | None = None) -> str:
  """'step 120/200 | loss 4.1234 | lr 1.0e-03 | ... | time step 91% data 6% | eta 0:01:02' for a train or eval
  record; the time split shows its parts of 1% or more."""
  parts = [f"step {record['step']}/{total_steps}"]
  for k, v in record.items():
    if k == "step" or k in TIME_SPLIT:
      continue
    if k == "tokens":
      parts.append(f"{v:,} tokens")
    elif k == "tokens_per_sec":
      parts.append(f"{v:,.0f} tok/s")
    elif k == "mfu":
      parts.append(f"mfu {100 * v:.1f}%")
    elif k == "bad_records":
      parts.append(f"{v:,} bad records skipped")
    elif k in ("lr", "eval_perplexity"):
      parts.append(f"{k} {v:.3g}")
    else:
      parts.append(f"{k} {v:.4f}")
  split = {k.removesuffix("_s"): record[k] for k in TIME_SPLIT if k in record}
  if split and sum(split.values()) > 0:
    shares = [f"{k} {v / sum(split.values()):.0%}" for k, v in split.items() if v >= 0.01 * sum(split.values())]
    parts.append("time " + " ".join(shares))
  if seconds_per_step is not None:
    eta = datetime.timedelta(seconds=round(seconds_per_step * (total_steps - record["step"])))
    parts.append(f"eta {eta}")
  return " | ".join(parts)

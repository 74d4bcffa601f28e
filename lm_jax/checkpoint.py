"""Orbax checkpoints in workdir/checkpoints: train state + data-iterator state + config, one step per folder.

Orbax writes each step to a temporary folder and renames it when complete, so a run killed mid-save
resumes from the previous complete step. Restoring takes an abstract target carrying the CURRENT
mesh's shardings, so a checkpoint written on one mesh loads onto another
(docs/toolchain.md#restoring-onto-another-mesh).

What real runs hit, each reported in one line: a complete step that cannot be read back (a file truncated
or emptied by a full disk or an interrupted copy) is skipped for the newest readable one (restore_latest);
a save that fails in the background (a full disk) stops the run at the next step (check_save), with the
failed step's temporary folder removed and the previous steps untouched. On a bucket (no rename) orbax marks a
finished step with commit_success.txt instead: a step folder without it is removed when a run opens its checkpoints,
and a checkpoints folder the storage fails to list stops the run rather than reading as empty.
"""
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from lm_jax import distributed, params as params_lib, storage
from lm_jax.data import mixture
from lm_jax.obs import metrics_log

# Model fields that change how the model runs, not which parameters it has: free to differ on resume.
RUNTIME_MODEL_FIELDS = ("dtype", "dropout_rate", "attention_dropout_rate", "remat_policy")
# Data fields the train iterator's position does not depend on.
EVAL_DATA_FIELDS = ("eval_split", "eval_batches", "tfds_data_dir")


def directory(workdir: str) -> epath.Path:
  """workdir/checkpoints (gs://... stays as it is)."""
  return epath.Path(workdir if storage.is_remote(workdir) else os.path.abspath(workdir)) / "checkpoints"


@functools.cache
def _one_writer_per_array():
  """With one process, every replica of an array is ours: orbax's replica-parallel save (each replica writes a slice)
  would only add a jit(slice) compile per replicated shape (108 for a tiny BERT on 8 devices: 3 s of its 9 s run)
  to write the same bytes. orbax takes ArrayHandler's options through its global type-handler registry, and a
  process's count never changes, so this runs once (without orbax's warning that it overrides the default)."""
  if jax.process_count() == 1:
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
      ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                                              override=True)
    finally:
      absl.setLevel(level)


def manager(workdir: str, keep: int, *, read_only: bool = False) -> ocp.CheckpointManager:
  """The run's checkpoints. read_only: one that neither creates workdir/checkpoints nor removes the temporary folders
  in it, for reading another run's workdir (init_from, reward_from: it may be training) or an eval's."""
  _one_writer_per_array()
  handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
              "config": ocp.JsonCheckpointHandler()}  # registered so item_metadata() can read the state's tree
  # Multi-host barrier keys of this directory's own: two managers saving at once (PPO's state and its policy) would
  # otherwise meet at the same orbax barrier and fail ('Barrier ... is already ongoing').
  key = hashlib.sha1(str(directory(workdir)).encode()).hexdigest()[:12]
  barriers = ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=key)
  if not read_only and storage.is_remote(workdir) and distributed.is_lead():
    _remove_unfinished_steps(directory(workdir))
  return _listing(lambda: ocp.CheckpointManager(
      directory(workdir), item_handlers=handlers,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           cleanup_tmp_directories=not read_only, multiprocessing_options=barriers)),
                  directory(workdir))


def _remove_unfinished_steps(folder: epath.Path):
  """A bucket has no atomic rename, so orbax marks a finished step with commit_success.txt, and a run stopped mid-save
  leaves the step's folder without it. orbax lists only finished steps, but its own cleanup leaves such a folder, and
  the resumed run's save of that step number then failed ('Checkpoint directory does not exist: .../80/state')."""
  for step, urls in sorted(_remote_steps(folder).items()):
    if not _is_finished(folder, step, urls):
      metrics_log.warn(f"removing {folder}/{step}: a save that never finished")
      storage.remove(urls)


def _finished_steps(folder) -> list[int]:
  return sorted(s for s, urls in _remote_steps(folder).items() if _is_finished(folder, s, urls))


def _is_finished(folder, step: int, urls: list[str]) -> bool:
  """Whether orbax marked the step finished (its marker's name is a private constant of orbax's)."""
  return f"{folder}/{step}/commit_success.txt" in urls


def _remote_steps(folder) -> dict[int, list[str]]:
  """step -> the URLs of its files in a remote checkpoints folder, from a listing that raises when it fails. epath's
  exists() answers False on any error, and orbax takes a folder it cannot list for one without steps: a resumed run
  then started over from step 0 and, keeping few checkpoints, deleted the ones it could not see."""
  try:
    urls = storage.find(str(folder))
  except Exception as e:  # noqa: BLE001  (gcsfs and the server raise several classes)
    raise storage.StorageError(f"cannot list the checkpoints in {folder}: {storage.describe(e)}; not starting "
                               "over them (try again when the storage answers)") from None
  steps = {}
  for url in urls:
    step = url[len(str(folder)) + 1:].partition("/")[0]
    if step.isdigit():
      steps.setdefault(int(step), []).append(url)
  return steps


def bound_storage_retries(seconds: float):
  """Makes a checkpoint write to unreachable storage give up after about `seconds` of retries. TensorStore (orbax's
  array writer) retries a failed GCS request 32 times, up to 32 s apart, by default: a run whose storage is gone would
  sit a quarter of an hour in a save before its one-line error. orbax builds its TensorStore context from these
  module defaults and takes no argument for it (orbax-checkpoint 0.12)."""
  from orbax.checkpoint._src.serialization import tensorstore_utils
  max_delay = min(32.0, max(1.0, seconds / 8))
  waited, delay, retries = 0.0, 1.0, 0
  while waited + delay <= seconds:
    waited, delay, retries = waited + delay, min(2 * delay, max_delay), retries + 1
  retries = {"max_retries": max(retries, 1), "initial_delay": "1s", "max_delay": f"{max_delay:g}s"}
  for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
    context["gcs_request_retries"] = retries


def _listing(read, folder, tries: int = 20):
  """read() of orbax's step list in folder, listed afresh (storage.forget_listings), and again when a step vanished
  between its listing and its stat (a trainer beside this reader deleting an old step); a FileNotFoundError of another
  cause comes back every try."""
  for attempt in range(tries):
    storage.forget_listings(folder)
    try:
      return read()
    except FileNotFoundError:
      if attempt == tries - 1:
        raise
      time.sleep(0.05)


def has_checkpoint(workdir: str) -> bool:
  """Whether workdir holds a complete checkpoint step; writes nothing."""
  if not directory(workdir).is_dir():
    return False
  mngr = manager(workdir, 1, read_only=True)
  try:
    return _newest_untried(mngr, {}) is not None
  finally:
    mngr.close()


def _plain(config) -> dict:
  """ConfigDict -> what it reads back as from JSON (tuples become lists)."""
  return json.loads(config.to_json_best_effort())


def data_state(iterator) -> dict:
  """The data stream's position: every host's iterator state holds the shards it reads (orbax writes JSON from
  the primary host only), so the states are gathered and their shards merged."""
  local = iterator.get_state()
  if jax.process_count() == 1:
    return local
  raw = np.frombuffer(json.dumps(local).encode(), np.uint8)
  size = int(np.max(multihost_utils.process_allgather(np.int32(raw.size))))
  padded = np.zeros(size, np.uint8)
  padded[:raw.size] = raw
  states = [json.loads(bytes(r).rstrip(b"\0")) for r in multihost_utils.process_allgather(padded)]
  merged = dict(states[0], shards={})
  for state in states:
    merged["shards"].update(state["shards"])
  return merged


def save(mngr, step: int, state, iterator_state: dict, config):
  """Starts writing `step` in the background (orbax waits for the previous save first). A step already on disk
  is one restore_latest found unreadable and fell back from: this run has just computed it again."""
  with _save_errors(mngr):
    if step in mngr.all_steps():
      mngr.delete(step)
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(iterator_state),
                                            config=ocp.args.JsonSave(_plain(config))))


def check_save(mngr):
  """Raises a failed background save as soon as it has failed (call it every step): left alone, a full disk
  surfaces only at the next save, a whole interval of training later. Reads a flag while a save runs."""
  if not mngr.is_saving_in_progress():
    finish(mngr)


def finish(mngr):
  """Waits for the background save; its failure raises one line (see _save_errors)."""
  with _save_errors(mngr):
    mngr.wait_until_finished()


@contextlib.contextmanager
def _save_errors(mngr):
  """A failed save -> OSError naming the directory and the cause; the failed step's temporary folder is
  removed. Earlier steps are intact: orbax deletes old steps only after a save has succeeded."""
  try:
    yield
  except Exception as e:  # orbax and TensorStore raise ValueError, OSError or plain Exception
    try:
      if distributed.is_lead():
        _remove_temporary(mngr.directory)
      mngr.reload()  # the steps on disk: orbax has already forgotten the ones it would delete after this save
      last = mngr.latest_step()
      kept = f"the last complete checkpoint is step {last}" if last is not None else "no checkpoint was completed"
    except Exception:  # noqa: BLE001  the storage itself is gone (a remote workdir's server): nothing to list
      raise storage.Unreachable(f"saving a checkpoint in {mngr.directory} failed: {_os_cause(e)}; the storage cannot "
                                "be reached; the steps saved before are as they were") from e
    raise OSError(f"saving a checkpoint in {mngr.directory} failed: {_os_cause(e)}; {kept}") from e


def _remove_temporary(directory, quiet_s: float = 1.0, limit_s: float = 10.0):
  """Removes unfinished step folders until none reappears for quiet_s: after the first failed write surfaces,
  TensorStore's writes already in flight go on and recreate the folder for a moment."""
  start = quiet_since = time.monotonic()
  while time.monotonic() - quiet_since < quiet_s and time.monotonic() - start < limit_s:
    for path in directory.iterdir():
      if ocp.step.is_path_temporary(path):
        quiet_since = time.monotonic()
        with contextlib.suppress(OSError):  # the error to report is the one that failed the save
          path.rmtree()
    time.sleep(0.05)


def _chain(e: BaseException) -> list[BaseException]:
  """e and the exceptions it was raised from, outermost first."""
  out = []
  while e is not None and e not in out:
    out.append(e)
    e = e.__cause__ if e.__cause__ is not None or e.__suppress_context__ else e.__context__
  return out


def _first_line(e: BaseException) -> str:
  """'ErrorClass: first line' of the innermost exception (TensorStore wraps its one-line reason in a
  60-line spec dump), at most 300 characters."""
  inner = _chain(e)[-1]
  text = str(inner).strip().splitlines()
  line = f"{type(inner).__name__}: {text[0] if text else ''}"
  return line if len(line) <= 300 else line[:297] + "..."


def _os_cause(e: BaseException) -> str:
  """The operating system's reason ('No space left on device') when one is known, else _first_line."""
  for x in _chain(e):
    if isinstance(x, OSError) and x.strerror:
      return x.strerror
    code = re.search(r"os_error_code='(\d+)'", str(x))  # TensorStore: "... [os_error_code='28']"
    if code:
      return os.strerror(int(code.group(1)))
  return _first_line(e)


class Restored(NamedTuple):
  step: int
  state: Any
  data_state: dict | None  # None without with_data, or when data_changes is not empty
  data_changes: list[str]  # see data_changes()


class _Unreadable(Exception):
  """A checkpoint step whose files cannot be read back."""


def restore_latest(mngr, abstract_state, shardings, config, *, with_data: bool) -> Restored | None:
  """The newest readable checkpoint placed with `shardings`, or None when there is none; with_data: also the
  data-iterator state, unless data_changes() makes it meaningless.

  The steps are listed afresh before each try: a trainer beside this reader (an evaluator, an export) deletes old
  steps as it saves, so a step that vanishes mid-read is passed over for the newest one still there. A step that
  stays on disk and cannot be read (a file truncated or emptied) is skipped with one warning line naming the file
  and the error, and left on disk until save() replaces it (a read can fail for a moment on a remote file system);
  none readable -> a one-line FileNotFoundError naming the directory. A checkpoint of another model or optimizer
  is a one-line ValueError (check_model, check_state), not a reason to fall back."""
  failed = {}   # step -> why it could not be read
  while (step := _newest_untried(mngr, failed)) is not None:
    try:
      restored = _restore_step(mngr, step, abstract_state, shardings, config, with_data)
    except _Unreadable as e:
      failed[step] = str(e).replace(f"{mngr.directory}/", "")  # the directory is named once
      continue
    _warn_unreadable(mngr, failed, step)
    return restored
  if failed:
    raise FileNotFoundError(f"no readable checkpoint in {mngr.directory} ({next(iter(failed.values()))}); "
                            + _advice(mngr, failed))
  if storage.is_remote(mngr.directory) and (finished := _finished_steps(mngr.directory)):
    raise storage.StorageError(f"listing {mngr.directory} failed: orbax found no step, the storage holds the finished "
                               f"steps {', '.join(map(str, finished))}; not starting over them (try again)")
  return None


def _newest_untried(mngr, failed: dict, wait_s: float = 30.0) -> int | None:
  """The newest step on disk now (listed afresh) that has not failed yet; None when none is left. While none is left
  and a save is under way (a trainer keeping one step may delete it before its next one is complete), waits for it."""
  deadline = time.monotonic() + wait_s
  while True:
    _listing(mngr.reload, mngr.directory)
    step = max((s for s in mngr.all_steps() if s not in failed), default=None)
    if step is not None or time.monotonic() > deadline or not _saving(mngr.directory):
      return step
    time.sleep(0.1)


def _saving(folder, recent_s: float = 60.0) -> bool:
  """Whether a step is being written in folder: a temporary step folder changed in the last recent_s seconds (one
  older is what a killed run left)."""
  try:
    return any(ocp.step.is_path_temporary(p) and time.time() - p.stat().mtime < recent_s for p in folder.iterdir())
  except OSError:   # a temporary folder renamed or removed while listed: a save was under way
    return folder.exists()


def read_config(mngr) -> dict | None:
  """The saved config of the newest step whose config can be read, re-listing when a step vanishes mid-read (see
  restore_latest); None without a step."""
  failed = {}
  while (step := _newest_untried(mngr, failed)) is not None:
    try:
      return _read(mngr, step, "config", ocp.args.JsonRestore())
    except _Unreadable as e:
      failed[step] = str(e).replace(f"{mngr.directory}/", "")
  if failed:
    raise FileNotFoundError(f"no readable checkpoint config in {mngr.directory} ({next(iter(failed.values()))}); "
                            + _advice(mngr, failed))
  return None


def _warn_unreadable(mngr, failed: dict, step: int):
  """One warning for the steps that failed and are still on disk; those a trainer deleted mid-read are no fault."""
  kept = [s for s in failed if s in mngr.all_steps()]
  if kept:
    steps = ", ".join(map(str, kept))
    metrics_log.warn(f"checkpoint step{'s' * (len(kept) > 1)} {steps} in {mngr.directory} unreadable "
                     f"({'; '.join(failed[s] for s in kept)}); falling back to step {step}")


def _advice(mngr, failed: dict) -> str:
  _listing(mngr.reload, mngr.directory)
  if not set(failed) & set(mngr.all_steps()):
    return "every step was deleted while being read (a trainer keeping few checkpoints); try again"
  return "move the directory away or use a new --workdir"


def _restore_step(mngr, step, abstract_state, shardings, config, with_data) -> Restored:
  saved = _read(mngr, step, "config", ocp.args.JsonRestore())
  check_model(saved, config, mngr.directory)
  try:
    tree = mngr.item_metadata(step)["state"]
  except Exception as e:
    raise _Unreadable(f"{step}/state: {_first_line(e)}") from e
  if tree is None:
    raise _Unreadable(f"{step}/state: no tree metadata")
  check_state(tree, abstract_state, saved, config, f"checkpoint step {step} in {mngr.directory}")
  changes = data_changes(saved, config) if with_data else []
  data = _read(mngr, step, "data", ocp.args.JsonRestore()) if with_data and not changes else None
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
  state = _read(mngr, step, "state", ocp.args.StandardRestore(target))
  return Restored(step, state, data, changes)


def _read(mngr, step: int, item: str, args):
  try:
    return mngr.restore(step, args=ocp.args.Composite(**{item: args}))[item]
  except Exception as e:  # JSONDecodeError, FileNotFoundError, TensorStore's ValueError or plain Exception
    raise _Unreadable(f"{step}/{item}: {_first_line(e)}") from e


def check_state(saved_tree, abstract_state, saved_config: dict, config, what: str):
  """One-line error when the saved train state's arrays (names, shapes) are not the ones this config builds:
  with the model checked first, a different optimizer (Adam's two moments vs Adafactor's factored ones)."""
  saved = {leaf.name: tuple(leaf.shape) for leaf in jax.tree.leaves(saved_tree)}
  now = {jax.tree_util.keystr(path, simple=True, separator="."): tuple(x.shape)
         for path, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
  if saved == now:
    return
  _check_adapters(saved_config, config, what)
  old, new = saved_config.get("optimizer", {}), _plain(config.optimizer)
  fields = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
  if fields:
    show = lambda opt: ", ".join(f"optimizer.{k}={opt.get(k)!r}" for k in fields)
    raise ValueError(f"{what} was saved with {show(old)} but the config has {show(new)}: its optimizer state "
                     f"does not fit; resume with the checkpoint's optimizer settings or use a new --workdir")
  name = min(set(saved) ^ set(now) or {k for k in saved if saved[k] != now[k]})
  raise ValueError(f"{what} does not fit this config: {name} is {saved.get(name)} in the checkpoint and "
                   f"{now.get(name)} here; use a new --workdir")


def _check_adapters(saved_config: dict, config, what: str):
  """One-line error when the checkpoint was trained with other adapters (params.ADAPTER_GROUPS) than the
  config has: the usual cause of a state that does not fit when evaluating or exporting an adapter run."""
  now = _plain(config)
  for group in params_lib.ADAPTER_GROUPS:
    old, new = saved_config.get(group) or {}, now.get(group) or {}
    fields = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if fields:
      as_flags = lambda values: " ".join(f"--config.{group}.{k}={values.get(k)!r}" for k in fields)
      raise ValueError(f"{what} was trained with {as_flags(old)} but the config has {as_flags(new)}: pass the run's "
                       f"config (its {group} flags)")


def check_model(saved: dict, config, directory: str):
  """One-line error when the checkpoint holds a different model than config.model."""
  now = _plain(config.model)
  for k in sorted(set(saved["model"]) | set(now)):
    if k not in RUNTIME_MODEL_FIELDS and saved["model"].get(k) != now.get(k):
      raise ValueError(f"checkpoint in {directory} has model.{k}={saved['model'].get(k)!r} but the config has "
                       f"model.{k}={now.get(k)!r}; use a new --workdir or the checkpoint's model config")


def data_changes(saved: dict, config) -> list[str]:
  """Config differences that make the saved train-iterator position meaningless (e.g. BERT phase 2's
  seq_len 128 -> 512): 'field: old -> new' strings, empty when the position still applies."""
  now = _plain(config)
  old_data, new_data = saved["data"], now["data"]
  changes = [f"data.{k}: {old_data.get(k)!r} -> {new_data.get(k)!r}" for k in sorted(set(old_data) | set(new_data))
             if k not in (*EVAL_DATA_FIELDS, "mixture") and old_data.get(k) != new_data.get(k)]
  changes += mixture.changes(old_data.get("mixture", []), new_data.get("mixture", []))  # eval splits may change
  for k in ("batch_size", "seed"):
    if saved.get(k) != now.get(k):
      changes.append(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}")
  return changes


# -------------------------------------------------------------------------------------------------- best checkpoint
def copy_tokenizers(workdir, to):
  """The run's trained tokenizers (workdir/tokenizer_*.model) into `to`, a workdir of its own that later runs read
  like any other (WORKDIR/best, PPO's WORKDIR/policy). Process 0 writes."""
  if distributed.is_lead():
    for tokenizer in epath.Path(workdir).glob("tokenizer_*.model"):
      tokenizer.copy(epath.Path(to) / tokenizer.name, overwrite=True)


def check_best(config):
  """One-line ValueError for a config.finetune.best_metric that Best cannot keep."""
  best = config.finetune.best_metric
  if best and (not best.startswith("eval_") or not config.eval_every):
    raise ValueError(f"config.finetune.best_metric={best!r} must name an eval metric (eval_accuracy, eval_loss, ...) "
                     f"and needs config.eval_every > 0, got eval_every={config.eval_every}")


class Best:
  """The checkpoint of the best eval by config.finetune.best_metric (lower is better for losses, mse, perplexity
  and bits, higher for the rest), kept in WORKDIR/best: a workdir of its own with the run's tokenizer, so
  --init_from=WORKDIR/best evaluates, exports or predicts it. best/best.json holds its eval record, so a resumed
  run keeps comparing against it."""

  def __init__(self, workdir: str, config):
    self.metric, self.workdir = config.finetune.best_metric, epath.Path(workdir)
    self.dir = self.workdir / "best"
    self.mngr = manager(str(self.dir), 1)
    self._record_path = self.dir / "best.json"
    self.record = json.loads(self._record_path.read_text()) if self._record_path.exists() else None

  def _better(self, value: float) -> bool:
    if self.record is None:
      return True
    lower = any(word in self.metric for word in ("loss", "mse", "perplexity", "bits"))
    return value < self.record[self.metric] if lower else value > self.record[self.metric]

  def offer(self, record: dict, state, data_state: dict, config) -> bool:
    """Saves `state` when record (an eval record with its step) is the best so far; whether it was."""
    if self.metric not in record:
      raise ValueError(f"config.finetune.best_metric={self.metric!r} is not an eval metric of this run; it has "
                       f"{', '.join(k for k in record if k != 'step')}")
    if not self._better(record[self.metric]):
      return False
    save(self.mngr, record["step"], state, data_state, config)
    finish(self.mngr)
    copy_tokenizers(self.workdir, self.dir)
    if distributed.is_lead():
      self._record_path.write_text(json.dumps(record))
    self.record = record
    return True

  def close(self):
    self.mngr.close()

"""Orbax checkpoints in workdir/checkpoints: train state + data-iterator state + config, one step per folder.

Orbax writes each step to a temporary folder and renames it when complete, so a run killed mid-save
resumes from the previous complete step. Restoring takes an abstract target carrying the CURRENT
mesh's shardings, so a checkpoint written on one mesh loads onto another
(docs/toolchain.md#restoring-onto-another-mesh).
"""
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

# Model fields that change how the model runs, not which parameters it has: free to differ on resume.
RUNTIME_MODEL_FIELDS = ("dtype", "dropout_rate", "attention_dropout_rate", "remat_policy")
# Data fields the train iterator's position does not depend on.
EVAL_DATA_FIELDS = ("eval_split", "eval_batches", "tfds_data_dir")


def manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  root = workdir if "://" in workdir else os.path.abspath(workdir)  # gs://... stays as it is
  return ocp.CheckpointManager(
      epath.Path(root) / "checkpoints", item_names=("state", "data", "config"),
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True))


def _plain(config) -> dict:
  """ConfigDict -> what it reads back as from JSON (tuples become lists)."""
  return json.loads(config.to_json_best_effort())


def data_state(iterator) -> dict:
  """The data stream's position: every host's iterator state holds the shards it reads (orbax writes JSON from
  the primary host only), so the states are gathered and their shards merged."""
  local = iterator.get_state()
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
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
  mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(iterator_state),
                                          config=ocp.args.JsonSave(_plain(config))))


def saved_config(mngr, step: int) -> dict:
  return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config


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
             if k not in EVAL_DATA_FIELDS and old_data.get(k) != new_data.get(k)]
  for k in ("batch_size", "seed"):
    if saved.get(k) != now.get(k):
      changes.append(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}")
  return changes


def restore(mngr, step: int, abstract_state, shardings, with_data: bool = True):
  """(state placed with `shardings`, data-iterator state or None) of checkpoint `step`."""
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)
  items = {"state": ocp.args.StandardRestore(target)}
  if with_data:
    items["data"] = ocp.args.JsonRestore()
  restored = mngr.restore(step, args=ocp.args.Composite(**items))
  return restored.state, restored.data if with_data else None

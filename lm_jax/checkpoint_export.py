"""--mode=export: a run's latest checkpoint (or config.init_from's model) and its tokenizer as a Hugging Face
directory, written atomically through lm_jax.hf.export; an adapter run's adapters beside it in the PEFT format, or
merged in. An export never replaces a run (_check_export_target). Dependencies: main calls it; it builds on
evals.run_eval (which model), params (its plain form) and hf.export (the files)."""
import os
import pathlib

import jax
from jax.experimental import multihost_utils

from lm_jax import config_lib, distributed, loop, params as params_lib, storage, workdir_lock
from lm_jax.evals import run_eval
from lm_jax.hf import export


def export_checkpoint(config, workdir: str, export_dir: str, merged: bool = False, overwrite: bool = False):
  """The latest checkpoint's params and the run's tokenizer as a Hugging Face directory (lm_jax.hf.export.save_hf).
  An adapter run (LoRA, IA³) writes its base model there and its adapters in the PEFT format to export_dir/adapter,
  or with `merged` the model with the adapters merged in. Atomic (export.writing): a non-empty export_dir is refused
  before anything is read, unless `overwrite` replaces it whole; one that is or holds a run never is
  (_check_export_target)."""
  storage.check_bucket(export_dir)   # a missing bucket in one line, before any listing
  _check_export_target(config, workdir, export_dir, overwrite)
  export.check_target(export_dir, overwrite)
  s, params, latest = run_eval.restore_params(config, workdir)
  if jax.process_count() > 1:  # every host holds only its shards
    params = multihost_utils.process_allgather(params, tiled=True)
  if distributed.is_lead():
    params = jax.device_get(params)
    plain = jax.device_get(params_lib.folded(s.policy, params)) if merged else params_lib.base(s.policy, params)
    with export.writing(export_dir, overwrite) as out:
      export.save_hf(s.config.model, plain, out, tokenizer=s.tokenizer)
      if not merged:
        params_lib.save_adapter(s.policy, params, os.path.join(out, "adapter"))
  loop.say(f"exported step {latest} to {export_dir}")
  return export_dir


def _check_export_target(config, workdir: str, export_dir: str, overwrite: bool):
  """ConfigError for an export_dir that would replace a run: the run's workdir, one holding it, its init_from or
  adapter (nothing writes into them), a folder inside a run's checkpoints/, or with `overwrite` a folder holding any
  run (its run.lock or a checkpoint anywhere in it). Real paths: a symlink or '..' spells the same folder. A bucket's
  target is checked the same way on its objects (_check_remote_target)."""
  sources = {"the run's own workdir": workdir, "config.init_from": config.init_from,
             **{f"config.{g}.init_from": config[g].init_from for g in params_lib.ADAPTER_GROUPS}}
  if storage.is_remote(export_dir):
    return _check_remote_target(export_dir, sources, overwrite)
  target = os.path.realpath(export_dir)
  for what, path in sources.items():
    if path and "://" not in path and _within(os.path.realpath(path), target):
      raise _replaces(export_dir, f"would replace {what} {path}")
  for folder in (pathlib.Path(target), *pathlib.Path(target).parents):
    if folder.name == "checkpoints" and workdir_lock.holds_run(folder.parent):
      raise _replaces(export_dir, f"is inside the checkpoints of the run in {folder.parent}")
  if overwrite:   # without it a non-empty export_dir is refused anyway (export.check_target)
    for folder, _, files in os.walk(target):
      if workdir_lock.holds_run(pathlib.Path(folder), files):
        raise _replaces(export_dir, f"--overwrite would replace the run in {folder}")


def _check_remote_target(export_dir: str, sources: dict, overwrite: bool):
  """_check_export_target on a bucket: a prefix is a run's when it holds run.lock or a step folder under
  checkpoints/. Prefixes are compared as written and with '..' resolved (a storage may take either)."""
  for what, path in sources.items():
    if path and storage.is_remote(path) and storage.within(path, export_dir):
      raise _replaces(export_dir, f"would replace {what} {path}")
  for url in {str(export_dir).rstrip("/"), storage.normalized(export_dir)}:
    parts = url.split("/")   # ['gs:', '', bucket, *key]
    for i in range(len(parts), 3, -1):
      if parts[i - 1] == "checkpoints" and _remote_holds_run("/".join(parts[:i - 1])):
        raise _replaces(export_dir, f"is inside the checkpoints of the run in {'/'.join(parts[:i - 1])}")
  if overwrite:
    for url in {str(export_dir).rstrip("/"), storage.normalized(export_dir)}:
      runs = _remote_runs(storage.find(url))
      if runs:
        raise _replaces(export_dir, f"--overwrite would replace the run in {runs[0]}")


def _remote_holds_run(folder: str) -> bool:
  return workdir_lock.NAME in storage.entries(folder) or any(
      name.split(".")[0].isdigit() for name in storage.entries(f"{folder}/checkpoints"))


def _remote_runs(files: list[str]) -> list[str]:
  """The run folders among the URLs of `files`: those holding run.lock, or a step folder under checkpoints/."""
  runs = set()
  for f in files:
    parts = f.split("/")
    if parts[-1] == workdir_lock.NAME:
      runs.add("/".join(parts[:-1]))
    runs.update("/".join(parts[:i]) for i in range(3, len(parts) - 2)
                if parts[i] == "checkpoints" and parts[i + 1].split(".")[0].isdigit())
  return sorted(runs)


def _replaces(export_dir: str, why: str) -> config_lib.ConfigError:
  return config_lib.ConfigError(f"--export_dir={export_dir} {why}; choose another --export_dir")


def _within(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or inside it (both real paths)."""
  return os.path.commonpath([path, folder]) == folder

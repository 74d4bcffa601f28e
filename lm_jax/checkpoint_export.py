"""--mode=export: a run's latest checkpoint (or config.init_from's model) and its tokenizer as a Hugging Face
directory, written atomically through lm_jax.hf.export; an adapter run's adapters beside it in the PEFT format, or
merged in. An export never replaces a run (_check_export_target). Dependencies: main calls it; it builds on
evals.run_eval (which model), params (its plain form) and hf.export (the files)."""
import os
import pathlib

import jax
from jax.experimental import multihost_utils

from lm_jax import config_lib, distributed, loop, params as params_lib, workdir_lock
from lm_jax.evals import run_eval
from lm_jax.hf import export


def export_checkpoint(config, workdir: str, export_dir: str, merged: bool = False, overwrite: bool = False):
  """The latest checkpoint's params and the run's tokenizer as a Hugging Face directory (lm_jax.hf.export.save_hf).
  An adapter run (LoRA, IA³) writes its base model there and its adapters in the PEFT format to export_dir/adapter,
  or with `merged` the model with the adapters merged in. Atomic (export.writing): a non-empty export_dir is refused
  before anything is read, unless `overwrite` replaces it whole; one that is or holds a run never is
  (_check_export_target)."""
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
  run (its run.lock or a checkpoint anywhere in it). Real paths: a symlink or '..' spells the same folder."""
  target = os.path.realpath(export_dir)
  sources = {"the run's own workdir": workdir, "config.init_from": config.init_from,
             **{f"config.{g}.init_from": config[g].init_from for g in params_lib.ADAPTER_GROUPS}}
  for what, path in sources.items():
    if path and "://" not in path and _within(os.path.realpath(path), target):
      raise config_lib.ConfigError(f"--export_dir={export_dir} would replace {what} {path}; choose another "
                                   "--export_dir")
  for folder in (pathlib.Path(target), *pathlib.Path(target).parents):
    if folder.name == "checkpoints" and workdir_lock.holds_run(folder.parent):
      raise config_lib.ConfigError(f"--export_dir={export_dir} is inside the checkpoints of the run in "
                                   f"{folder.parent}; choose another --export_dir")
  if overwrite:   # without it a non-empty export_dir is refused anyway (export.check_target)
    for folder, _, files in os.walk(target):
      if workdir_lock.holds_run(pathlib.Path(folder), files):
        raise config_lib.ConfigError(f"--export_dir={export_dir} --overwrite would replace the run in {folder}; "
                                     "choose another --export_dir")


def _within(path: str, folder: str) -> bool:
  """Whether `path` is `folder` or inside it (both real paths)."""
  return os.path.commonpath([path, folder]) == folder

"""Weights & Biases for a run whose config.wandb.project is set: its config and every log record, from process 0
(lm_jax.obs.metrics_log calls this). One W&B run per workdir: the run id is kept in WORKDIR/wandb_run_id, so a resumed
run continues the same W&B run (wandb.init(id=..., resume="allow")).

Records carry their own `step` as W&B's x-axis (define_metric), not W&B's internal step: a resumed run logs again the
steps after its checkpoint, which W&B's monotonic step would drop. W&B's files go to WORKDIR/wandb (local workdirs).

wandb is optional: importlib loads it here, the one place, only for a run that asks for it (tests/test_imports.py
allows no function-level import statements; check() says before anything is built when it is missing);
requirements-test.txt installs it for the tests.
"""
import importlib
import importlib.util
import netrc
import os
import urllib.parse

from etils import epath

ID_FILE = "wandb_run_id"
MODES = ("", "online", "offline", "disabled")
ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")   # what wandb.init accepts as WANDB_MODE


def check(config):
  """One-line errors for config.wandb and the W&B environment it meets (checks.validate calls it before anything
  is built, the workdir included): an unknown mode, a mode that logs without a project (project '' is off: the run
  would log nothing), wandb missing, WANDB_MODE unknown, online without an API key."""
  w = config.wandb
  if w.mode not in MODES:
    raise ValueError(f"config.wandb.mode={w.mode!r} unknown; use online, offline or disabled ('' = WANDB_MODE)")
  if not w.project:
    if w.mode in ("online", "offline"):
      raise ValueError(f"config.wandb.mode={w.mode!r} without config.wandb.project logs nothing (no project = W&B "
                       "off): set --config.wandb.project=NAME")
    return
  if importlib.util.find_spec("wandb") is None:
    raise ValueError(f"config.wandb.project={w.project!r} needs wandb, which is not installed: pip install wandb")
  mode = w.mode or os.environ.get("WANDB_MODE", "") or "online"
  if mode not in ENV_MODES:
    raise ValueError(f"WANDB_MODE={mode!r} in the environment is not a W&B mode; use online, offline or disabled, "
                     "or set config.wandb.mode")
  if mode in ("online", "run", "shared") and not _has_key():
    raise ValueError(f"config.wandb.project={w.project!r} logs online but no W&B API key is set: set WANDB_API_KEY, "
                     "run `wandb login`, or pass --config.wandb.mode=offline")


def _has_key() -> bool:
  """Whether wandb will find an API key without asking: WANDB_API_KEY, or a netrc entry for its host (where
  `wandb login` writes it)."""
  if os.environ.get("WANDB_API_KEY"):
    return True
  host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
  path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
  try:
    return netrc.netrc(path).authenticators(host) is not None
  except (OSError, netrc.NetrcParseError):
    return False


def start(config, workdir: str):
  """The W&B run of workdir (a new one, or the one whose id workdir keeps), with the config logged."""
  wandb, w = importlib.import_module("wandb"), config.wandb
  id_file = epath.Path(workdir) / ID_FILE
  run_id = id_file.read_text().strip() if id_file.exists() else None   # None: W&B makes a new run and its id
  run = wandb.init(project=w.project, entity=w.entity or None, name=w.name or None, tags=list(w.tags),
                   mode=w.mode or None, id=run_id, resume="allow", dir=None if "://" in workdir else workdir,
                   settings=wandb.Settings(quiet=True))   # W&B's own lines stay short: the console is the run's log
  run.config.update(config.to_dict(), allow_val_change=True)   # a later phase may change fields (phase_end_step)
  run.define_metric("*", step_metric="step")
  id_file.write_text(run.id)
  return run

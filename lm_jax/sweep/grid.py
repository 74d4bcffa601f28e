"""A sweep's trials: the config file's `get_sweep(variant)` (built with lm_jax.sweep.hyper), or the product of the
`--grid=FIELD=V1,V2,...` flags, which replace it, times `--seeds=N` values of config.seed. Every value is typed as its
config field is on the command line (config_lib.override), so a mistake is one line before any trial starts. A trial
is named readably after its swept values plus a hash of its config and every override, so a trial of a changed base
(another --config.* value) is another trial, never a finished one found again.
"""
import copy
import dataclasses
import hashlib
import json
import pathlib
import re

from lm_jax import config_lib
from lm_jax.sweep import hyper

SEED = "seed"   # the config field --seeds sweeps (defaults.base_config)


@dataclasses.dataclass(frozen=True)
class Trial:
  name: str
  swept: dict          # {field: typed value}: what this trial varies
  fixed: dict          # {field: typed value}: the --config.* overrides every trial shares
  args: tuple          # lm_jax.main's --config.* flags for the trial
  end: int             # the step its run ends at (phase_end_step or total_steps)


def trials(spec: str, overrides: list[str], grid: list[str], seeds: int | None) -> list[Trial]:
  """The trials of `spec` with `overrides` on every one; ConfigError (one line) for an unknown field, a value of the
  wrong type, an empty grid or a seed count below 1."""
  config_lib.require(seeds is None or seeds >= 1, f"--seeds={seeds} must be at least 1")
  base = config_lib.load(spec, overrides)
  chosen = hyper.product(*[_grid_flag(base, g) for g in grid]) if grid else _config_sweep(spec, seeds)
  if seeds is not None:
    chosen = hyper.product(chosen, hyper.sweep(SEED, range(seeds)))
  given = config_lib.fields(base)
  fixed = {f: given[f] for f in (o.removeprefix("--config.").partition("=")[0] for o in overrides)}
  out = {}
  for swept in chosen:
    config = config_lib.override(copy.deepcopy(base), swept)
    values = config_lib.fields(config)
    swept = {f: values[f] for f in swept}
    args = (*overrides, *(f"--config.{f}={text(v)}" for f, v in swept.items()))
    t = Trial(_name(spec, fixed, swept), swept, fixed, args, config.phase_end_step or config.total_steps)
    out.setdefault(t.name, t)   # a trial given twice runs once
  return list(out.values())


def _grid_flag(base, flag: str) -> list[dict]:
  """--grid=FIELD=V1,V2,... as a sweep, each value typed (a tuple-valued field is swept in get_sweep instead)."""
  field, sep, values = flag.partition("=")
  config_lib.require(sep and field, f"--grid={flag} is not FIELD=V1,V2,... (e.g. --grid=optimizer.lr=1e-3,3e-3)")
  values = [v for v in values.split(",") if v.strip()]
  config_lib.require(values, f"--grid={flag}: no values (e.g. --grid={field}=1e-3,3e-3)")
  typed = [config_lib.fields(config_lib.override(copy.deepcopy(base), {field: v.strip()}))[field] for v in values]
  return hyper.sweep(field, typed)


def _config_sweep(spec: str, seeds: int | None) -> list[dict]:
  path, _, variant = spec.partition(":")
  file = next(p for p in (pathlib.Path(path), config_lib.REPO / path) if p.is_file())   # load() found it
  get_sweep = config_lib._get_config(file).__globals__.get("get_sweep")   # the config module's own function
  if get_sweep is None:
    config_lib.require(seeds is not None, f"nothing to sweep: config file {str(file)!r} defines no "
                       "get_sweep(variant); give --grid=FIELD=V1,V2,... or --seeds=N")
    return [{}]
  try:
    chosen = list(get_sweep(variant))
  except ValueError as e:
    raise config_lib.ConfigError(f"config file {str(file)!r}: get_sweep({variant!r}): {e}") from e
  config_lib.require(chosen and all(isinstance(t, dict) for t in chosen),
                     f"config file {str(file)!r}: get_sweep({variant!r}) returned no trials (a list of override dicts)")
  return chosen


def text(value) -> str:
  """A typed value as lm_jax.main's --config.FIELD=VALUE parses it back."""
  if isinstance(value, bool):
    return str(value).lower()
  return repr(value) if isinstance(value, (float, tuple)) else str(value)


def _name(spec: str, fixed: dict, swept: dict) -> str:
  """'lr0.003_d-model64_seed1-1a2b3c4d': the swept values (letters, digits, - . _ only: safe in a gs:// path), then
  a hash of the config and every override."""
  readable = "_".join(re.sub(r"[^A-Za-z0-9.-]+", "-", f"{f.rpartition('.')[2]}{text(v)}") for f, v in swept.items())
  digest = hashlib.sha256(json.dumps({"config": spec, "overrides": {**fixed, **swept}}, sort_keys=True,
                                     default=str).encode()).hexdigest()[:8]
  return f"{readable[:80]}-{digest}" if readable else digest

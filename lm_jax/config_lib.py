"""One way to get a config: `load("configs/gpt1.py:tiny", {"optimizer.lr": 3e-4})` for Python, the same
`--config=configs/gpt1.py:tiny --config.optimizer.lr=3e-4` on every command line; then `validate` checks it
against the devices before anything is built.

Mistakes come back as one line naming the field: an unknown field with the closest existing one, a value of
the wrong type with the field's type, a number out of range with its range. On the command line
(`user_errors`), such a mistake prints `error: ...` and exits 2, a data, checkpoint or file problem exits 1, and
only a bug in lm_jax shows a traceback (LM_JAX_TRACEBACK=1 shows every traceback).
"""
import ast
import contextlib
import difflib
import importlib.util
import math
import os
import pathlib
import sys
from typing import Iterable, Mapping

import ml_collections
from absl import app, flags

from lm_jax import checkpoint, init_from, models, objectives, optim, params, profiling, sharding, wandb_log
from lm_jax.data import mixture

REPO = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = str(pathlib.Path(__file__).resolve().parent) + os.sep


class ConfigError(ValueError):
  """A config or command line a run cannot start from (exit code 2 on the command line)."""


# --------------------------------------------------------------------------------------------------------- load
def load(spec: str, overrides: Mapping | Iterable[str] = ()) -> ml_collections.ConfigDict:
  """`configs/X.py[:variant]`'s get_config(variant), locked (no new fields), with overrides applied.

  The path is relative to the working directory, else to the repository. overrides: {"a.b": value} or
  ["--config.a.b=v" or "a.b=v", ...], see `override`.
  """
  path, _, variant = spec.partition(":")
  file = next((p for p in (pathlib.Path(path), REPO / path) if p.is_file()), None)
  if file is None:
    places = " or ".join(sorted({os.getcwd(), str(REPO)}))
    raise ConfigError(f"config file {path!r} not found in {places}")
  module_spec = importlib.util.spec_from_file_location(f"lm_jax_config_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  try:
    config = module.get_config(variant) if variant else module.get_config()
  except ValueError as e:  # configs/*.py reject unknown variants with a ValueError naming the known ones
    raise ConfigError(str(e)) from e
  config.lock()
  return override(config, overrides)


def override(config: ml_collections.ConfigDict, overrides: Mapping | Iterable[str]) -> ml_collections.ConfigDict:
  """Sets existing fields of `config` (in place; returned): {"a.b": value} or ["--config.a.b=v" / "a.b=v", ...].

  Strings are parsed to the field's type like ml_collections' config flags (int, float, bool as true/false/1/0,
  tuple as a Python literal, str as is); other values must have the field's type (an int for a float is fine).
  """
  items = overrides.items() if isinstance(overrides, Mapping) else map(_split, overrides)
  for field, value in items:
    *parents, leaf = field.split(".")
    node = config
    for key in parents:
      node = node.get(key) if isinstance(node, ml_collections.ConfigDict) else None
    if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
      raise ConfigError(f"config field {field!r} does not exist{_suggestion(config, field)}")
    node[leaf] = _convert(field, value, node[leaf])
  return config


def _split(item: str) -> tuple[str, str]:
  field, sep, value = item.removeprefix("--config.").partition("=")
  if not sep or not field:
    raise ConfigError(f"config override {item!r} is not FIELD=VALUE (e.g. --config.optimizer.lr=3e-4)")
  return field, value


def _convert(field: str, value, old):
  """`value` as the type of `old`, the field's current value; ConfigError naming the field and type if it is not."""
  kind = type(old)
  if isinstance(old, ml_collections.ConfigDict):
    raise ConfigError(f"config field {field!r} is a group of fields; set one of them, e.g. "
                      f"{field}.{next(iter(old.keys()), 'x')}")
  if isinstance(value, str) and kind is not str:
    try:
      value = _parse(value, kind)
    except (ValueError, SyntaxError, TypeError):
      raise ConfigError(f"config field {field!r} expects {_TYPE_NAMES.get(kind, kind.__name__)}, "
                        f"got {value!r}") from None
  if kind is float and type(value) is int:
    value = float(value)
  if kind is tuple and isinstance(value, list):
    value = tuple(value)
  if old is not None and type(value) is not kind:
    raise ConfigError(f"config field {field!r} expects {_TYPE_NAMES.get(kind, kind.__name__)}, got "
                      f"{type(value).__name__} {value!r}")
  return value


_TYPE_NAMES = {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string",
               tuple: "a tuple, e.g. \"(('batch', 'data'),)\""}
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def _parse(text: str, kind: type):
  if kind is bool:
    if text.lower() not in _BOOLS:
      raise ValueError(text)
    return _BOOLS[text.lower()]
  if kind in (int, float):
    return kind(text)
  value = ast.literal_eval(text)  # a tuple, or None-valued fields
  if kind is tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
  return value


def _suggestion(config, field: str) -> str:
  """'; did you mean X?': a close name in the same group, a name whose initials match (learning_rate -> lr),
  the same name in another group, or a close dotted path."""
  fields = _fields(config)
  paths = list(fields)
  parent, _, leaf = field.rpartition(".")
  siblings = {p.rpartition(".")[2]: p for p in paths   # fields, not groups: 'lr' is not the group 'lora'
              if p.rpartition(".")[0] == parent and not isinstance(fields[p], ml_collections.ConfigDict)}
  initials = lambda name: "".join(w[0] for w in name.split("_") if w)
  close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
  close = close or [s for s in siblings if initials(leaf) == s or initials(s) == leaf]
  best = [siblings[close[0]]] if close else [p for p in paths if p.rpartition(".")[2] == leaf]
  best = best or difflib.get_close_matches(field, paths, n=1, cutoff=0.6)
  return f"; did you mean {best[0]!r}?" if best else ""


def _fields(config, prefix="") -> dict:
  """Dotted path -> value of every field and group."""
  out = {}
  for key, value in config.items():
    out[prefix + key] = value
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_fields(value, f"{prefix}{key}."))
  return out


# ----------------------------------------------------------------------------------------------------- validate
def _at_least(low):
  return f">= {low}", lambda x: x >= low


def _above(low):
  return f"> {low}", lambda x: x > low


_UNIT = "in [0, 1)", lambda x: 0 <= x < 1

# Ranges of the numeric fields of lm_jax/defaults.py that objectives.check, models.validate and
# sharding.mesh_shape do not cover. Written as what is allowed, so NaN (every comparison is False) fails.
# warmup_steps may exceed total_steps: the rsqrt schedule uses it as a constant, and short runs stay in warmup.
RANGES = {
    "total_steps": _at_least(1), "microbatches": _at_least(1), "log_every": _at_least(1),
    "checkpoint_every": _at_least(1), "batch_size": _at_least(1), "keep_checkpoints": _at_least(1),
    "eval_every": _at_least(0), "seed": _at_least(0), "peak_tflops": _at_least(0),
    "optimizer.lr": _above(0), "optimizer.b1": _UNIT, "optimizer.b2": _UNIT, "optimizer.eps": _above(0),
    "optimizer.weight_decay": _at_least(0), "optimizer.warmup_steps": _at_least(0),
    "optimizer.clip_norm": _at_least(0),
    "data.target_len": _at_least(0), "data.eval_batches": _at_least(0), "data.shards": _at_least(1),
    "model.initializer_range": _above(0),
}


def validate(config, num_devices: int, process_count: int = 1):
  """ConfigError (one line, naming the field) for a config that cannot train on `num_devices` devices in
  `process_count` processes: checked before anything is built or compiled."""
  try:
    _validate(config, num_devices, process_count)
  except ConfigError:
    raise
  except ValueError as e:  # objectives, models and sharding raise plain ValueErrors naming the field
    raise ConfigError(str(e)) from e


def _require(ok, message):
  if not ok:
    raise ConfigError(message)


def _validate(config, num_devices, process_count):
  objectives.check(config)  # unknown objective, objective/family mismatch, seq_len vs positions, masking/noise
  models.validate(config.model)  # sizes, heads vs d_model, activation, dtypes, remat policy, dropout
  _check_numbers(config)
  params.check(config)  # what trains: freeze patterns, adapter methods, layer_decay
  init_from.check(config)  # reinit_top_layers
  checkpoint.check_best(config)  # best_metric
  mixture.sources(config)  # data.mixture: source fields, names, weights
  profiling.check(config)  # profile.steps
  wandb_log.check(config)  # wandb.mode; wandb installed when wandb.project is set
  m, o = config.model, config.optimizer
  _require(o.name in optim.OPTIMIZERS, f"config.optimizer.name={o.name!r} unknown; use {', '.join(optim.OPTIMIZERS)}")
  _require(o.schedule in optim.SCHEDULES,
           f"config.optimizer.schedule={o.schedule!r} unknown; use {', '.join(optim.SCHEDULES)}")
  _require(0 <= config.phase_end_step <= config.total_steps, f"config.phase_end_step={config.phase_end_step} "
           f"must be in [0, total_steps={config.total_steps}] (0 = total_steps)")
  data, fsdp, tensor = sharding.mesh_shape(config, num_devices)
  _require(m.num_heads % tensor == 0,
           f"config.model.num_heads={m.num_heads} is not divisible by config.mesh.tensor={tensor}")
  _require(config.batch_size % process_count == 0,
           f"config.batch_size={config.batch_size} is not divisible by the {process_count} processes")
  _require(config.batch_size % config.data.shards == 0,
           f"config.batch_size={config.batch_size} is not divisible by config.data.shards={config.data.shards}")
  per_step = config.microbatches * data * fsdp
  _require(config.batch_size % per_step == 0,
           f"config.batch_size={config.batch_size} is not divisible by config.microbatches * mesh.data * mesh.fsdp "
           f"= {config.microbatches}*{data}*{fsdp} = {per_step}")
  sharding.check_divisible(models.abstract_params(m), models.logical_axes(m),
                           dict(zip(sharding.AXES, (data, fsdp, tensor))), sharding.rules(config))


def _check_numbers(config):
  """Every float finite, RANGES, eval batches when evaluating, token ids inside the vocabulary."""
  fields = _fields(config)
  for path, value in fields.items():
    _require(not isinstance(value, float) or math.isfinite(value), f"config.{path} must be finite, got {value}")
  for path, (rule, ok) in RANGES.items():
    _require(ok(fields[path]), f"config.{path} must be {rule}, got {fields[path]!r}")
  m = config.model
  for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
    _require(0 <= m[name] < m.vocab_size,
             f"config.model.{name}={m[name]} must be in [0, model.vocab_size={m.vocab_size})")


# ------------------------------------------------------------------------------------------------ command line
def parse_flags(argv: list[str]) -> tuple[list[str], list[str]]:
  """app.run's flags_parser for a command with a `--config` string flag: (the arguments absl leaves, the
  `--config.FIELD=VALUE` overrides for `load`). The overrides are taken out before absl parses the rest, since
  the fields are only known once the file is read; `--config.FIELD VALUE` works too. A flag error exits 2 with
  one line."""
  rest, overrides, args = [], [], iter(argv)
  for arg in args:
    if arg == "--":  # the rest is positional
      rest += [arg, *args]
      break
    if arg.startswith("--config."):
      value = None if "=" in arg else next(args, None)
      if value is not None and value.startswith("--"):  # not a value: the next flag
        rest.append(value)
        value = None
      overrides.append(arg if value is None else f"{arg}={value}")
    else:
      rest.append(arg)
  try:
    return flags.FLAGS(rest), overrides
  except flags.Error as e:
    _fail(e, 2)


@contextlib.contextmanager
def user_errors():
  """Inside, a user's mistake exits with one line `error: ...` on stderr: 2 for a ConfigError or absl
  UsageError; 1 for a ValueError, FloatingPointError or OSError raised by lm_jax (data, checkpoints, a diverged
  run, a full disk, a workdir in use) or a file that cannot be found, read or written. Anything else is a bug and
  keeps its traceback, as does every error with LM_JAX_TRACEBACK=1."""
  try:
    yield
  except Exception as e:  # re-raised unless it is the user's
    code = _exit_code(e)
    if code is None or os.environ.get("LM_JAX_TRACEBACK") == "1":
      raise
    _fail(e, code)


def _exit_code(e: BaseException) -> int | None:
  """2 for usage and config errors, 1 for other user errors, None for internal errors (see user_errors)."""
  if isinstance(e, (ConfigError, app.UsageError)):
    return 2
  if isinstance(e, (FileNotFoundError, PermissionError)) or (isinstance(e, OSError) and e.filename):
    return 1
  if isinstance(e, (ValueError, FloatingPointError, OSError)) and _raised_in_lm_jax(e):  # OSError: a full disk
    return 1
  return None


def _raised_in_lm_jax(e: BaseException) -> bool:
  tb = e.__traceback__
  while tb is not None and tb.tb_next is not None:
    tb = tb.tb_next
  return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE)


def _fail(error, code: int):
  lines = str(error).strip().splitlines() or [type(error).__name__]
  more = " (LM_JAX_TRACEBACK=1 for the rest)" if len(lines) > 1 else ""
  print(f"error: {lines[0]}{more}", file=sys.stderr, flush=True)
  sys.exit(code)

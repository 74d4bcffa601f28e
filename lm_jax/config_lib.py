"""One way to get a config: `load("configs/gpt1.py:tiny", {"optimizer.lr": 3e-4})` for Python, the same
`--config=configs/gpt1.py:tiny --config.optimizer.lr=3e-4` on every command line; then `lm_jax.checks.validate`
checks it against the devices before anything is built. Loading a config imports nothing of the library.

Mistakes come back as one line naming the field: an unknown field with the closest existing one, a value of
the wrong type with the field's type, a number out of range with its range. On the command line
(`user_errors`), such a mistake prints `error: ...` and exits 2, a data, checkpoint or file problem exits 1, and
only a bug in lm_jax shows a traceback (LM_JAX_TRACEBACK=1 shows every traceback).
"""
import ast
import contextlib
import difflib
import importlib.util
import os
import pathlib
import sys
from typing import Iterable, Mapping

import ml_collections
from absl import app, flags


REPO = pathlib.Path(__file__).resolve().parents[1]
_PACKAGE = str(pathlib.Path(__file__).resolve().parent) + os.sep


class ConfigError(ValueError):
  """A config or command line a run cannot start from (exit code 2 on the command line)."""


# --------------------------------------------------------------------------------------------------------- load
def require(ok, message: str):
  """ConfigError(message) unless ok: the one-line check every owner of config fields writes its checks with."""
  if not ok:
    raise ConfigError(message)


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
  get_config = _get_config(file)
  try:
    config = get_config(variant) if variant else get_config()
  except ValueError as e:  # configs/*.py reject unknown variants with a ValueError naming the known ones
    raise ConfigError(str(e)) from e
  require(isinstance(config, ml_collections.ConfigDict),
          f"config file {str(file)!r}: get_config() returned {type(config).__name__}, not an ml_collections.ConfigDict")
  config.lock()
  return override(config, overrides)


def _get_config(file: pathlib.Path):
  """The get_config function of the config file; ConfigError naming the file (and line) when there is none: not a
  .py file, a syntax error, no get_config."""
  require(file.suffix == ".py", f"config file {str(file)!r} is not a Python file (.py) defining get_config()")
  module_spec = importlib.util.spec_from_file_location(f"lm_jax_config_{file.stem}", file)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:   # a source that is not UTF-8 is one too
    if e.filename != str(file):   # in a module the config imports: its traceback
      raise
    raise ConfigError(f"config file {str(file)!r} line {e.lineno}: {e.msg}") from None
  require(callable(getattr(module, "get_config", None)), f"config file {str(file)!r} defines no get_config()")
  return module.get_config


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


def replaced(config: ml_collections.ConfigDict, fields: Mapping) -> ml_collections.ConfigDict:
  """A copy of `config` with {"a.b": value} set as given: the library's own derived configs (a pre-trained model's
  architecture, PPO's reward model), where `override`'s checks against the user's fields do not apply."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    for path, value in fields.items():
      *parents, leaf = path.split(".")
      node = c
      for key in parents:
        node = node[key]
      node[leaf] = value
  return c


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
  found = fields(config)
  paths = list(found)
  parent, _, leaf = field.rpartition(".")
  siblings = {p.rpartition(".")[2]: p for p in paths   # fields, not groups: 'lr' is not the group 'lora'
              if p.rpartition(".")[0] == parent and not isinstance(found[p], ml_collections.ConfigDict)}
  initials = lambda name: "".join(w[0] for w in name.split("_") if w)
  close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
  close = close or [s for s in siblings if initials(leaf) == s or initials(s) == leaf]
  best = [siblings[close[0]]] if close else [p for p in paths if p.rpartition(".")[2] == leaf]
  best = best or difflib.get_close_matches(field, paths, n=1, cutoff=0.6)
  return f"; did you mean {best[0]!r}?" if best else ""


def fields(config, prefix="") -> dict:
  """Dotted path -> value of every field and group."""
  out = {}
  for key, value in config.items():
    out[prefix + key] = value
    if isinstance(value, ml_collections.ConfigDict):
      out.update(fields(value, f"{prefix}{key}."))
  return out


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
  run, a full disk, a workdir in use) or a file that cannot be found, read or written; Ctrl-C exits 130 with
  `interrupted`. Anything else is a bug and keeps its traceback, as does every error with LM_JAX_TRACEBACK=1."""
  try:
    yield
  except KeyboardInterrupt:   # in training, only a second Ctrl-C (lm_jax.loop.Preemption: the first one saves)
    if os.environ.get("LM_JAX_TRACEBACK") == "1":
      raise
    print("interrupted", file=sys.stderr, flush=True)
    sys.exit(130)
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

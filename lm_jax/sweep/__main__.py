"""python -m lm_jax.sweep {run, collect} (docs/sweeps.md):

  run      --config=FILE.py[:VARIANT] --root=DIR [--grid=FIELD=V1,V2,...]... [--seeds=N] [--retries=K]
           [--config.FIELD=VALUE ...]     a worker on the grid in DIR; start any number of them
  collect  --root=DIR [--metric=eval_loss] [--target=X]   DIR/results.csv, the table over seeds, DIR/results.png

A mistaken command line is one line `error: ...` and exit 2, before any trial starts (config_lib.user_errors).
"""
import sys

from absl import app, flags

from lm_jax import config_lib

_CONFIG = flags.DEFINE_string("config", None, "run: configs/<file>.py[:<variant>]; --config.a.b=v applies to every "
                              "trial")
_ROOT = flags.DEFINE_string("root", None, "the sweep's folder (local or gs://): one workdir per trial")
_GRID = flags.DEFINE_multi_string("grid", [], "run: FIELD=V1,V2,... (repeatable: their product); replaces the config "
                                  "file's get_sweep(variant)")
_SEEDS = flags.DEFINE_integer("seeds", None, "run: each trial with config.seed = 0 .. N-1")
_RETRIES = flags.DEFINE_integer("retries", 1, "run: starts of a failed trial after its first, before it is recorded "
                                "as failed")
_METRIC = flags.DEFINE_string("metric", "eval_loss", "collect: the metrics.jsonl field compared (lower is better)")
_TARGET = flags.DEFINE_float("target", None, "collect: print each group's margin (target − mean) · sqrt(n)")
COMMANDS = ("run", "collect")


def main(args):
  rest, overrides = args
  with config_lib.user_errors():
    if len(rest) != 2 or rest[1] not in COMMANDS:
      raise app.UsageError(f"give one command, {' or '.join(COMMANDS)}: python -m lm_jax.sweep run --config=... "
                           "--root=DIR")
    if not _ROOT.value:
      raise app.UsageError("--root=DIR is required")
    if rest[1] == "collect":
      from lm_jax.sweep import results   # matplotlib, JAX: after the command line is checked
      results.collect(_ROOT.value, _METRIC.value, _TARGET.value)
      return
    if not _CONFIG.value:
      raise app.UsageError("--config=FILE.py[:VARIANT] is required for run")
    if _RETRIES.value < 0:
      raise app.UsageError(f"--retries={_RETRIES.value} must be at least 0")
    from lm_jax.sweep import grid
    trials = grid.trials(_CONFIG.value, overrides, _GRID.value, _SEEDS.value)
    from lm_jax.sweep import worker   # JAX's import: after every trial's values are checked
    sys.exit(worker.run(_CONFIG.value, _ROOT.value, trials, _RETRIES.value))


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)

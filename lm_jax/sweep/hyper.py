"""The helpers a config's `get_sweep(variant)` builds its trials with (big_vision's get_hyper style): each returns a
list of override dicts {"a.b": value}. Pure Python, so a config file may import it.

  def get_sweep(variant):
    from lm_jax.sweep import hyper
    return hyper.product(hyper.sweep("optimizer.lr", [1e-3, 3e-3]), hyper.sweep("model.d_model", [64, 128]))
"""
import builtins
import itertools


def sweep(field: str, values) -> list[dict]:
  """One trial per value of `field`."""
  return [{field: v} for v in values]


def product(*sweeps: list[dict]) -> list[dict]:
  """Every combination, the last sweep varying fastest."""
  return [_merged(combo) for combo in itertools.product(*sweeps)]


def zip(*sweeps: list[dict]) -> list[dict]:  # noqa: A001  (big_vision's zipit)
  """Trial i of every sweep merged into one; the sweeps have the same length."""
  lengths = {len(s) for s in sweeps}
  if len(lengths) > 1:
    raise ValueError(f"hyper.zip: sweeps of different lengths {sorted(lengths)}")
  return [_merged(combo) for combo in builtins.zip(*sweeps)]


def chain(*sweeps: list[dict]) -> list[dict]:
  """The trials of each sweep, one after the other."""
  return [dict(t) for s in sweeps for t in s]


def _merged(trials) -> dict:
  out = {}
  for t in trials:
    out.update(t)
  return out

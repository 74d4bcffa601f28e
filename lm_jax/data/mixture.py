"""Data mixtures: config.data.mixture, several text sources sampled by weight into one training stream, as the papers
trained (BERT: Wikipedia + BooksCorpus, Devlin et al. 2019 §3.1; T5's multi-task mixtures, Raffel et al. 2020).

A source is a dict: name (in eval records and the data state), files (a glob) or tfds_name, and optionally
text_field, train_split, eval_split (config.data's when left out) and weight (default 1). A mixture replaces
config.data.tfds_name; config.data.files beside it is an error. Every data shard of the pipeline (data/pipeline.py)
mixes the same shard of each source: the source of row r of shard k's part of global batch b is drawn with
probability weight / sum(weights) by np.random.default_rng([seed, k, b, _DRAW]), and a source's rows come in its own
order (its own document shuffle, windows and epochs; NSP's random next sentence from the same source). The stream
is thus a function of the config, the seed and the step, whatever the number of hosts, and its position is every
source's position.

The fields are checked with the config (lm_jax.checks.validate); a glob without files or an unknown TFDS dataset is
found when the source is first read (the tokenizer's training text), each a one-line error naming the source field.
"""
import dataclasses
import math
import re
import zlib

import numpy as np

_DRAW = 0x6d6978            # keeps the source draw's random stream apart from the transform's ([seed, k, b])
_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_INHERITED = ("text_field", "train_split", "eval_split")
FIELDS = ("name", "files", "tfds_name", *_INHERITED, "weight")
EVAL_FIELDS = ("eval_split",)   # what a source's training position does not depend on


@dataclasses.dataclass(frozen=True)
class Source:
  name: str
  files: str
  tfds_name: str
  text_field: str
  train_split: str
  eval_split: str
  weight: float
  field: str                # where it is configured, for errors: config.data.mixture[i]


def sources(config) -> list[Source]:
  """config.data.mixture's sources, checked (one-line ValueError naming the field); [] without a mixture."""
  d = config.data
  if d.mixture and d.files:     # a mixture replaces data.tfds_name (a config's default), as data.files does
    raise ValueError("config.data.mixture and config.data.files are both set: clear one (--config.data.files= or "
                     "--config.data.mixture='()')")
  out = [_source(i, entry, d) for i, entry in enumerate(d.mixture)]
  names = [s.name for s in out]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ValueError(f"config.data.mixture: source name {twice[0]!r} is used twice; names must differ")
  total = sum(s.weight for s in out)
  if out and not (math.isfinite(total) and all(s.weight / total > 0 for s in out)):
    # each weight passed, the whole does not: a sum that overflows, or a source whose share rounds to 0
    raise ValueError(f"config.data.mixture weights {[s.weight for s in out]} sum to {total}: scale them down so "
                     "that the sum is finite and every source's share is above 0")
  return out


def _source(i: int, entry, data) -> Source:
  field = f"config.data.mixture[{i}]"
  if not isinstance(entry, dict):
    raise ValueError(f"{field} must be a dict with {', '.join(FIELDS)}, got {entry!r}")
  unknown = sorted(set(entry) - set(FIELDS))
  if unknown:
    raise ValueError(f"{field}.{unknown[0]} is not a source field; use {', '.join(FIELDS)}")
  values = {k: entry.get(k, data[k]) for k in _INHERITED}
  values.update(name=entry.get("name", ""), files=entry.get("files", ""), tfds_name=entry.get("tfds_name", ""))
  for k, v in values.items():
    if not isinstance(v, str):
      raise ValueError(f"{field}.{k} must be a string, got {v!r}")
  if not _NAME.match(values["name"]):
    raise ValueError(f"{field}.name={values['name']!r} must be letters, digits and _ (it names the source's eval "
                     "metrics, e.g. eval_wiki_loss)")
  if bool(values["files"]) == bool(values["tfds_name"]):
    raise ValueError(f"{field} ({values['name']}): set one of files (a glob) or tfds_name (a TFDS dataset)")
  weight = entry.get("weight", 1.0)
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (weight > 0 and math.isfinite(weight)):
    raise ValueError(f"{field}.weight must be a finite number > 0, got {weight!r}")
  return Source(**values, weight=float(weight), field=field)


def weights(mixture: list[Source]) -> np.ndarray:
  """The sources' sampling probabilities."""
  w = np.array([s.weight for s in mixture])
  return w / w.sum()


def source_seed(seed: int, source: Source) -> int:
  """A source's own seed (document order, windows, instances), from its name: adding or reordering sources leaves
  each source's order as it was."""
  return int(np.random.SeedSequence([seed, zlib.crc32(source.name.encode())]).generate_state(1)[0])


def draw(probabilities: np.ndarray, n: int, *, seed: int, shard: int, batch_index: int) -> np.ndarray:
  """The source of each of the n rows shard `shard` gives to global batch `batch_index` (i.i.d. by weight)."""
  rng = np.random.default_rng([seed, shard, batch_index, _DRAW])
  return rng.choice(len(probabilities), size=n, p=probabilities)


def changes(old: list, new: list) -> list[str]:
  """'field: old -> new' for each difference between two mixtures (as saved in a checkpoint's config) that moves the
  training stream; a changed eval_split does not."""
  strip = lambda mixture: [{k: v for k, v in dict(s).items() if k not in EVAL_FIELDS} for s in mixture]
  old, new = strip(old), strip(new)
  if len(old) != len(new):
    return [f"data.mixture: {len(old)} -> {len(new)} sources"]
  return [f"data.mixture[{i}].{k}: {a.get(k)!r} -> {b.get(k)!r}" for i, (a, b) in enumerate(zip(old, new))
          for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]

"""Local datasets for the lm-evaluation-harness tasks in this directory: WikiText-2 (raw) cut into articles, and
SST-2's tab-separated sentence/label files, read from the data directory given as
`--metadata='{"data_dir": "..."}'` or, failing that, $LM_JAX_DATA (the layout lm_jax's tests use).

A data directory that is missing is an error of one line: a ValueError / FileNotFoundError for lm_jax's trainer
(lm_jax.evals.lm_eval_adapter names the tasks), under lm-eval's command line `error: ...` and exit code 1, since that
prints the whole traceback of an exception (~50 lines around the one-line cause)."""
import os
import pathlib
import re
import sys

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401 (the YAML's)

_ARTICLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)   # a top-level heading " = Title = " starts an article


def _root(data_dir, name: str) -> pathlib.Path:
  data_dir = data_dir or os.environ.get("LM_JAX_DATA")
  if not data_dir:
    _fail(ValueError("no data directory: pass --metadata='{\"data_dir\": \"DIR\"}' or set LM_JAX_DATA"))
  path = pathlib.Path(data_dir).expanduser() / name
  if not path.is_dir():
    _fail(FileNotFoundError(f"{path} does not exist (data_dir={data_dir})"))
  return path


def _fail(error: Exception):
  if pathlib.Path(sys.argv[0]).name == "lm_eval" or sys.argv[0].endswith(os.path.join("lm_eval", "__main__.py")):
    raise SystemExit(f"error: {error}")
  raise error


def wikitext2(data_dir=None, **_) -> datasets.DatasetDict:
  """{'validation', 'test'}: one row per article, {'page': its raw text}, as lm-eval's wikitext task reads it."""
  root = _root(data_dir, "wikitext-2-raw")
  out = {}
  for split, name in (("validation", "valid"), ("test", "test")):
    text = (root / f"wiki.{name}.raw").read_text(encoding="utf-8")
    starts = [m.start() for m in _ARTICLE.finditer(text)]
    out[split] = datasets.Dataset.from_dict({"page": [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]})
  return datasets.DatasetDict(out)


def sst2(data_dir=None, **_) -> datasets.DatasetDict:
  """{'train', 'validation'}: {'sentence', 'label' (0 negative, 1 positive)} from train.tsv and dev.tsv."""
  root = _root(data_dir, "sst2")
  out = {}
  for split, name in (("train", "train"), ("validation", "dev")):
    rows = [line.rsplit("\t", 1) for line in (root / f"{name}.tsv").read_text(encoding="utf-8").splitlines() if line]
    out[split] = datasets.Dataset.from_dict({"sentence": [s for s, _ in rows], "label": [int(l) for _, l in rows]})
  return datasets.DatasetDict(out)

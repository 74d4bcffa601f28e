"""Prepare once, train many: tokenize a config's training and eval splits into indexed array_record shards
(data/prepared.py) that `--config.data.prepared=DIR` trains from. The command line is lm_jax/prepare.py:

  python -m lm_jax.prepare --config=configs/bert.py:base --out=DIR [--processes=4] [--workdir=RUN]

For MLM + NSP (a layout whose rows are drawn per document) it then writes --passes epochs of finished rows: pairs
and masks, as BERT's create_pretraining_data.py does with dupe_factor (10; data/prepared.py says how they are read).
The shards are spread over --processes spawned processes (at most one per CPU and per shard); each shard is a pure
function of its documents, the tokenizer and (rows) the tokenized split and the seed, so the shards are
byte-identical whatever the process count. The tokenizer is the run's (config.data.tokenizer, or the one trained and
cached in --workdir, which should be the run's workdir; default DIR). Everything is written in a new folder beside
DIR that then replaces DIR whole, so a failed or interrupted prepare leaves the old preparation as it was; a folder
that is not empty and holds no preparation is refused.
"""
import contextlib
import fcntl
import functools
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import socket
import sys

import grain
import numpy as np

from lm_jax import config_lib
from lm_jax.data import corpus as corpus_lib
from lm_jax.data import mixture as mixture_lib
from lm_jax.data import pipeline, prepared, sources, tokenizer
from lm_jax.data import rows as rows_lib

DOCS_PER_SHARD = 8192
PASSES = 10         # epochs of MLM + NSP rows written ahead: BERT's dupe_factor


def prepare(config, objective, family, out: str, *, workdir: str = "", processes: int = 1,
            docs_per_shard: int = DOCS_PER_SHARD, passes: int = PASSES) -> dict:
  """Writes out/manifest.json and the shards of config.data's train and eval splits for `objective` (its rows say
  whether documents are kept as sentences), tokenized by the run's tokenizer for `family` (the models' record of
  config.model.family); for a layout whose rows are drawn per document (MLM + NSP) also `passes` epochs of finished
  rows (0: tokens only, rows built on the fly). A mixture's sources are prepared each in out/<name>, and
  out/manifest.json lists them. Returns the manifest.

  The preparation is written in a new folder beside `out` and then put in its place whole, under a lock: a prepare
  that fails or is killed leaves the old preparation as it was, a second one at the same time is refused, and no
  file is written through a link placed in `out` (a link at `out` itself is followed: its folder is replaced)."""
  config_lib.require(not config.data.prepared, "config.data.prepared: prepare reads the corpus itself; clear it")
  out = prepared.local_folder(out, "--out")
  config_lib.require(processes >= 1 and docs_per_shard >= 1 and passes >= 0, f"--processes={processes} and "
                     f"--docs_per_shard={docs_per_shard} must be >= 1, --passes={passes} >= 0")
  target = os.path.realpath(out)
  os.makedirs(os.path.dirname(target), exist_ok=True)
  with _locked(target, out):
    _clean_leftovers(target)
    _check_replaceable(target, out)
    new = _sibling(target, f"prepare-{os.getpid()}")
    os.mkdir(new)
    try:
      if not workdir:
        _copy_tokenizers(target, new)
      manifest = _prepare_all(config, objective, family, new, workdir or new, processes, docs_per_shard, passes)
      _swap(new, target)
    except BaseException:
      shutil.rmtree(new, ignore_errors=True)
      raise
  return manifest


def _prepare_all(config, objective, family, out, workdir, processes, docs_per_shard, passes) -> dict:
  _OPEN.clear()
  mixture = mixture_lib.sources(config)
  plans = {s.name if s else "": _splits(config, s) for s in mixture or [None]}   # a split typo stops here
  tok = tokenizer.load_or_train(config, workdir, family)
  layout = objective.rows(config, tok)
  config_lib.require(not getattr(layout, "corpus", None), f"objective {config.objective!r} reads task examples "
                     "(config.task), which are not prepared; train it on the fly")
  passes = passes if isinstance(layout, rows_lib.PerDocument) else 0
  most = max(_shards(len(docs), docs_per_shard) for p in plans.values() for docs, _ in p.values()) * max(1, passes)
  cap = min(processes, os.cpu_count() or 1, most)
  if cap < processes:
    print(f"warning: --processes={processes}: using {cap} ({os.cpu_count()} CPUs, at most {most} shards written at "
          "once)", file=sys.stderr, flush=True)
  with multiprocessing.get_context("spawn").Pool(cap) if cap > 1 else contextlib.nullcontext() as pool:
    run = functools.partial(pool.map, chunksize=1) if pool else lambda f, jobs: [f(job) for job in jobs]
    job = dict(config=config, objective=objective, family=family, workdir=workdir, as_sentences=layout.as_sentences)
    if mixture:
      made = {s.name: _prepare(dict(job, out=os.path.join(out, s.name), source=s), plans[s.name], tok,
                               docs_per_shard, passes, run) for s in mixture}
      return _write_manifest(out, dict(passes=passes, sources=made))
    return _prepare(dict(job, out=out, source=None), plans[""], tok, docs_per_shard, passes, run)


def _splits(config, source) -> dict:
  """split -> (its documents, the roles it is read in: 'train', 'eval' or both) of config.data or `source`."""
  roles = {}
  roles.setdefault(source.train_split if source else config.data.train_split, []).append("train")
  roles.setdefault(source.eval_split if source else config.data.eval_split, []).append("eval")
  return {split: (sources.documents(config, split, source), r) for split, r in roles.items()}


def _shards(documents: int, docs_per_shard: int) -> int:
  return max(1, math.ceil(documents / docs_per_shard))


def _prepare(job: dict, splits: dict, tok, docs_per_shard: int, passes: int, run) -> dict:
  """One source's shards (config.data's, or job['source'] of a mixture) in job['out'], and its manifest."""
  config, source, out = job["config"], job["source"], job["out"]
  manifest = dict(prepared.expected(config, tok, job["as_sentences"], passes > 0, source), splits={}, passes=passes)
  for split, (docs, roles) in splits.items():
    shards = _shards(len(docs), docs_per_shard)
    ranges = [range(k * docs_per_shard, min((k + 1) * docs_per_shard, len(docs))) for k in range(shards)]
    folder = os.path.join(out, prepared.split_dir(split))
    os.makedirs(folder, exist_ok=True)
    names = [f"shard-{k:05d}-of-{shards:05d}.array_record" for k in range(shards)]
    run(_write_shard, [dict(job, split=split, path=os.path.join(folder, name), ids=ids)
                       for name, ids in zip(names, ranges)])
    meta = dict(documents=len(docs), docs_per_shard=docs_per_shard, shards=names, shard_bytes=_sizes(folder, names),
                path=docs.path, decode_stats=docs.decode_stats)
    if passes:
      meta["rows"] = {}
      for role in roles:
        n = passes if role == "train" else 1
        made = [f"rows-{role}-p{p:03d}-{k:05d}-of-{shards:05d}.array_record" for p in range(n) for k in range(shards)]
        run(_write_rows, [dict(job, split=split, meta=dict(meta), role=role, p=p, ids=ranges[k],
                               path=os.path.join(folder, name))
                          for (p, k), name in zip(itertools.product(range(n), range(shards)), made)])
        meta["rows"][role] = dict(passes=n, shards=made, shard_bytes=_sizes(folder, made))
    manifest["splits"][split] = meta
  return _write_manifest(out, manifest)


def _sizes(folder: str, names: list[str]) -> list[int]:
  """The shards' sizes in bytes, which data.prepared checks at start (a truncated or missing shard)."""
  return [os.path.getsize(os.path.join(folder, name)) for name in names]


def _write_manifest(out: str, manifest: dict) -> dict:
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, prepared.MANIFEST), "x") as f:
    json.dump(manifest, f, indent=1)
  return manifest


def _sibling(target: str, what: str) -> str:
  """`.NAME.what` beside the folder `target`: on its file system, so that renames between them are atomic."""
  parent, name = os.path.split(target)
  return os.path.join(parent, f".{name}.{what}")


@contextlib.contextmanager
def _locked(target: str, out: str):
  """Holds `.NAME.lock` beside `target` (the kernel's flock: it goes with the process however it ends); a second
  prepare of the same folder is refused. The file stays: removing it would let a third prepare lock a new one."""
  path = _sibling(target, "lock")
  with os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644), "r+") as f:
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise OSError(f"--out={out} is being prepared by another prepare ({f.read().strip() or 'starting'}); wait "
                    "for it or choose another --out") from None
    except OSError as e:   # a file system without locks
      print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second prepare of --out={out}",
            file=sys.stderr, flush=True)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    yield


def _clean_leftovers(target: str):
  """The folders of a killed prepare of `target` (we hold its lock): its new folder is removed; an old
  preparation that a swap had moved aside is put back if the swap was cut before the new one took its place."""
  parent, name = os.path.split(target)
  for entry in sorted(os.listdir(parent)):
    found = re.fullmatch(rf"\.{re.escape(name)}\.(prepare|old)-\d+", entry)
    if found and found[1] == "old" and not os.path.lexists(target):
      os.rename(os.path.join(parent, entry), target)
    elif found:
      shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _check_replaceable(target: str, out: str):
  """Only a missing or empty folder, or a preparation, is replaced: never a user's other files."""
  if not os.path.lexists(target):
    return
  config_lib.require(os.path.isdir(target), f"--out={out} is a file; name a new folder (or a preparation)")
  config_lib.require(not os.listdir(target) or _is_preparation(target), f"--out={out} is a folder that holds no "
                     "preparation (no lm_jax manifest.json) and is not empty; name a new or empty folder")


def _is_preparation(folder: str) -> bool:
  path = os.path.join(folder, prepared.MANIFEST)
  try:
    with open(path) as f:
      found = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(found, dict) and "passes" in found and ("splits" in found or "sources" in found)


def _copy_tokenizers(old: str, new: str):
  """The tokenizer cached in the preparation being replaced (the default --workdir) is kept, not trained again."""
  for name in os.listdir(old) if os.path.isdir(old) else []:
    path = os.path.join(old, name)
    if name.startswith("tokenizer_") and os.path.isfile(path) and not os.path.islink(path):
      shutil.copyfile(path, os.path.join(new, name))


def _swap(new: str, target: str):
  """Puts the folder `new` in the place of `target`, whose old preparation stays whole until then."""
  old = _sibling(target, f"old-{os.getpid()}")
  if os.path.lexists(target):
    os.rename(target, old)
  try:
    os.rename(new, target)
  except BaseException:
    if os.path.lexists(old):
      os.rename(old, target)
    raise
  shutil.rmtree(old, ignore_errors=True)


_OPEN = {}    # per process: what its jobs read once for all their shards


def _write_shard(job):
  config, workdir, split, source, ids = job["config"], job["workdir"], job["split"], job["source"], job["ids"]
  key = ("docs", workdir, split, source)
  if key not in _OPEN:
    _OPEN[key] = sources.documents(config, split, source), tokenizer.load_or_train(config, workdir, job["family"])
  docs, tok = _OPEN[key]
  with _writer(job["path"]) as writer:
    for start in range(ids.start, ids.stop, corpus_lib.DOCS_PER_CALL):
      chunk = range(start, min(start + corpus_lib.DOCS_PER_CALL, ids.stop))
      for i, entry in zip(chunk, corpus_lib.tokenize([docs[i] for i in chunk], tok, job["as_sentences"])):
        writer.write(prepared.encode(entry, docs.where(i) if entry[1] else ""))


def _write_rows(job):
  """Rows of pass p for documents `ids`: the NSP pairs the pipeline draws in epoch p (training: the document's data
  shard, in that shard's epoch order, with a mixture source's own seed; eval: shard 0 in document order), masked by
  the objective's transform with a generator of (that seed, pass, document)."""
  config, source, role, p = job["config"], job["source"], job["role"], job["p"]
  key = ("rows", job["workdir"], job["out"], job["split"], role)
  if key not in _OPEN:
    tok = tokenizer.load_or_train(config, job["workdir"], job["family"])
    objective = job["objective"]
    corpus = prepared.PreparedCorpus(job["out"], job["split"], job["meta"], as_sentences=True)
    layout, d = objective.rows(config, tok), config.data
    if role == "train":
      seed = mixture_lib.source_seed(config.seed, source) if source else config.seed
      shard_rows = [rows_lib.ShardRows(layout, corpus, pipeline.shard_order(
          len(corpus), seed=seed, shuffle=d.shuffle, shard=k, shards=d.shards), seed=seed, shard=k)
                    for k in range(d.shards)]
    else:
      seed = config.seed
      shard_rows = [rows_lib.ShardRows(layout, corpus, grain.MapDataset.range(len(corpus)), seed=seed, shard=0)]
    _OPEN[key] = shard_rows, layout, objective.transform(config, tok), seed
  shard_rows, layout, transform, seed = _OPEN[key]
  with _writer(job["path"]) as writer:
    for doc in job["ids"]:
      found = shard_rows[doc % len(shard_rows)].doc_instances(p, doc)
      rows = transform(layout.assemble(found), np.random.default_rng([seed, p, doc])) if found else {}
      writer.write(prepared.encode_rows(rows))


@contextlib.contextmanager
def _writer(path: str):
  """An array_record writer to a temporary name, renamed to `path` once complete."""
  from array_record.python import array_record_module
  tmp = f"{path}.{os.getpid()}.tmp"
  writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
  yield writer
  writer.close()
  os.replace(tmp, path)

"""Prepare once, train many: tokenize a config's training and eval splits into indexed array_record shards
(data/prepared.py) that `--config.data.prepared=DIR` trains from. The command line is lm_jax/prepare.py:

  python -m lm_jax.prepare --config=configs/bert.py:base --out=DIR [--processes=4] [--workdir=RUN]

For MLM + NSP (a layout whose rows are drawn per document) it then writes --passes epochs of finished rows: pairs
and masks, as BERT's create_pretraining_data.py does with dupe_factor (10; data/prepared.py says how they are read).
The shards are spread over --processes spawned processes; each shard is a pure function of its documents, the
tokenizer and (rows) the tokenized split and the seed, so the shards are byte-identical whatever the process count. The tokenizer is the run's
(config.data.tokenizer, or the one trained and cached in --workdir, which should be the run's workdir; default
DIR). The manifest is written last, so an interrupted preparation is never read.
"""
import contextlib
import functools
import itertools
import json
import math
import multiprocessing
import os

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
  out/manifest.json lists them. Returns the manifest."""
  config_lib.require(not config.data.prepared, "config.data.prepared: prepare reads the corpus itself; clear it")
  out = prepared.local_folder(out, "--out")
  config_lib.require(processes >= 1 and docs_per_shard >= 1 and passes >= 0, f"--processes={processes} and "
                     f"--docs_per_shard={docs_per_shard} must be >= 1, --passes={passes} >= 0")
  workdir = workdir or out
  _OPEN.clear()
  tok = tokenizer.load_or_train(config, workdir, family)
  layout = objective.rows(config, tok)
  config_lib.require(not getattr(layout, "corpus", None), f"objective {config.objective!r} reads task examples "
                     "(config.task), which are not prepared; train it on the fly")
  passes = passes if isinstance(layout, rows_lib.PerDocument) else 0
  mixture = mixture_lib.sources(config)
  with multiprocessing.get_context("spawn").Pool(processes) if processes > 1 else contextlib.nullcontext() as pool:
    run = functools.partial(pool.map, chunksize=1) if pool else lambda f, jobs: [f(job) for job in jobs]
    job = dict(config=config, objective=objective, family=family, workdir=workdir, as_sentences=layout.as_sentences)
    if mixture:
      made = {s.name: _prepare(dict(job, out=os.path.join(out, s.name), source=s), tok, docs_per_shard, passes, run)
              for s in mixture}
      return _write_manifest(out, dict(passes=passes, sources=made))
    return _prepare(dict(job, out=out, source=None), tok, docs_per_shard, passes, run)


def _prepare(job: dict, tok, docs_per_shard: int, passes: int, run) -> dict:
  """One source's shards (config.data's, or job['source'] of a mixture) in job['out'], and its manifest."""
  config, source, out = job["config"], job["source"], job["out"]
  manifest = dict(prepared.expected(config, tok, job["as_sentences"], passes > 0, source), splits={}, passes=passes)
  roles = {}      # split -> {role: passes}
  roles.setdefault(source.train_split if source else config.data.train_split, {})["train"] = passes
  roles.setdefault(source.eval_split if source else config.data.eval_split, {})["eval"] = min(passes, 1)
  for split in roles:
    docs = sources.documents(config, split, source)
    shards = max(1, math.ceil(len(docs) / docs_per_shard))
    ranges = [range(k * docs_per_shard, min((k + 1) * docs_per_shard, len(docs))) for k in range(shards)]
    folder = os.path.join(out, prepared.split_dir(split))
    os.makedirs(folder, exist_ok=True)
    names = [f"shard-{k:05d}-of-{shards:05d}.array_record" for k in range(shards)]
    run(_write_shard, [dict(job, split=split, path=os.path.join(folder, name), ids=ids)
                       for name, ids in zip(names, ranges)])
    meta = dict(documents=len(docs), docs_per_shard=docs_per_shard, shards=names, path=docs.path,
                decode_stats=docs.decode_stats)
    if passes:
      meta["rows"] = {}
      for role, n in roles[split].items():
        made = [f"rows-{role}-p{p:03d}-{k:05d}-of-{shards:05d}.array_record" for p in range(n) for k in range(shards)]
        run(_write_rows, [dict(job, split=split, meta=dict(meta), role=role, p=p, ids=ranges[k],
                               path=os.path.join(folder, name))
                          for (p, k), name in zip(itertools.product(range(n), range(shards)), made)])
        meta["rows"][role] = dict(passes=n, shards=made)
    manifest["splits"][split] = meta
  return _write_manifest(out, manifest)


def _write_manifest(out: str, manifest: dict) -> dict:
  """Written last, under a temporary name first: an interrupted preparation has no manifest and is never read."""
  os.makedirs(out, exist_ok=True)
  tmp = os.path.join(out, f".{prepared.MANIFEST}.{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(out, prepared.MANIFEST))
  return manifest


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

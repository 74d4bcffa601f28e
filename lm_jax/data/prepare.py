"""Prepare once, train many: tokenize a config's training and eval splits into indexed array_record shards
(data/prepared.py) that `--config.data.prepared=DIR` trains from. The command line is lm_jax/prepare.py:

  python -m lm_jax.prepare --config=configs/bert.py:base --out=DIR [--processes=4] [--workdir=RUN]

The shards are spread over --processes spawned processes; each shard is a pure function of its documents and the
tokenizer, so the shards are byte-identical whatever the process count. The tokenizer is the run's
(config.data.tokenizer, or the one trained and cached in --workdir, which should be the run's workdir; default
DIR). The manifest is written last, so an interrupted preparation is never read.
"""
import json
import math
import multiprocessing
import os

from lm_jax import config_lib
from lm_jax.data import corpus as corpus_lib
from lm_jax.data import mixture as mixture_lib
from lm_jax.data import prepared, sources, tokenizer

DOCS_PER_SHARD = 8192


def prepare(config, objective, out: str, *, workdir: str = "", processes: int = 1,
            docs_per_shard: int = DOCS_PER_SHARD) -> dict:
  """Writes out/manifest.json and the shards of config.data's train and eval splits for `objective` (its rows say
  whether documents are kept as sentences); returns the manifest."""
  config_lib.require(not mixture_lib.sources(config), "config.data.mixture: lm_jax.data.prepare reads one source "
                     "(config.data.files or tfds_name); clear the mixture")
  config_lib.require(not config.data.prepared, "config.data.prepared: prepare reads the corpus itself; clear it")
  config_lib.require(processes >= 1 and docs_per_shard >= 1,
                     f"--processes={processes} and --docs_per_shard={docs_per_shard} must be >= 1")
  workdir = workdir or out
  tok = tokenizer.load_or_train(config, workdir)
  layout = objective.rows(config, tok)
  config_lib.require(not getattr(layout, "corpus", None), f"objective {config.objective!r} reads task examples "
                     "(config.task), which are not prepared; train it on the fly")
  manifest = dict(prepared.expected(config, tok, layout.as_sentences), splits={})
  os.makedirs(out, exist_ok=True)
  for split in dict.fromkeys([config.data.train_split, config.data.eval_split]):
    docs = sources.documents(config, split)
    shards = max(1, math.ceil(len(docs) / docs_per_shard))
    names = [f"shard-{k:05d}-of-{shards:05d}.array_record" for k in range(shards)]
    os.makedirs(os.path.join(out, prepared.split_dir(split)), exist_ok=True)
    jobs = [(config, workdir, split, os.path.join(out, prepared.split_dir(split), name), range(
        k * docs_per_shard, min((k + 1) * docs_per_shard, len(docs))), layout.as_sentences)
            for k, name in enumerate(names)]
    if processes > 1:
      with multiprocessing.get_context("spawn").Pool(min(processes, shards)) as pool:
        pool.map(_write_shard, jobs, chunksize=1)
    else:
      for job in jobs:
        _write_shard(job)
    manifest["splits"][split] = dict(documents=len(docs), docs_per_shard=docs_per_shard, shards=names,
                                     path=docs.path, decode_stats=docs.decode_stats)
  tmp = os.path.join(out, f".{prepared.MANIFEST}.{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(out, prepared.MANIFEST))
  return manifest


_OPEN = {}    # per process: (workdir, split) -> (documents, tokenizer), read once for all its shards


def _write_shard(job):
  from array_record.python import array_record_module
  config, workdir, split, path, ids, as_sentences = job
  if (workdir, split) not in _OPEN:
    _OPEN[(workdir, split)] = sources.documents(config, split), tokenizer.load_or_train(config, workdir)
  docs, tok = _OPEN[(workdir, split)]
  tmp = f"{path}.{os.getpid()}.tmp"
  writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
  for start in range(ids.start, ids.stop, corpus_lib.DOCS_PER_CALL):
    chunk = range(start, min(start + corpus_lib.DOCS_PER_CALL, ids.stop))
    for i, entry in zip(chunk, corpus_lib.tokenize([docs[i] for i in chunk], tok, as_sentences)):
      writer.write(prepared.encode(entry, docs.where(i) if entry[1] else ""))
  writer.close()
  os.replace(tmp, path)

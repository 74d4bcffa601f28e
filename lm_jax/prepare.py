"""python -m lm_jax.prepare --config=configs/X.py[:variant] --out=DIR [--processes=N] [--passes=P] [--workdir=RUN]:
tokenize the config's splits once (and for MLM + NSP make P epochs of masked pairs) into the shards that
--config.data.prepared=DIR trains from (lm_jax/data/prepare.py)."""
import os

from absl import app, flags

from lm_jax import config_lib, models, objectives
from lm_jax.data import prepare

_CONFIG = flags.DEFINE_string("config", None, "configs/<file>.py[:<variant>]; override fields with --config.a.b=v")
_OUT = flags.DEFINE_string("out", None, "the prepared directory (config.data.prepared of the runs that read it)")
_WORKDIR = flags.DEFINE_string("workdir", "", "where the tokenizer is trained and cached (the run's workdir); "
                               "default --out")
_PROCESSES = flags.DEFINE_integer("processes", 1, "processes tokenizing shards in parallel")
_PER_SHARD = flags.DEFINE_integer("docs_per_shard", prepare.DOCS_PER_SHARD, "documents per shard file")
_PASSES = flags.DEFINE_integer("passes", prepare.PASSES, "MLM + NSP: epochs of masked pairs written ahead (BERT's "
                               "dupe_factor); 0 = tokens only, pairs and masks made while training")


def main(args):
  _, overrides = args
  with config_lib.user_errors():
    config = config_lib.load(_CONFIG.value, overrides)
    manifest = prepare.prepare(config, objectives.get(config.objective), models.family(config.model), _OUT.value,
                               workdir=_WORKDIR.value, processes=_PROCESSES.value, docs_per_shard=_PER_SHARD.value,
                               passes=_PASSES.value)
  for name, made in manifest.get("sources", {"": manifest}).items():
    for split, v in made["splits"].items():
      rows = "".join(f"; {role} rows: {r['passes']} passes" for role, r in v.get("rows", {}).items())
      print(f"{name + ' ' if name else ''}{split}: {v['documents']} documents in {len(v['shards'])} shards{rows} in "
            f"{os.path.join(_OUT.value, name) if name else _OUT.value}")


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "out"])
  app.run(main, flags_parser=config_lib.parse_flags)

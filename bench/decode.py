"""Decoding throughput: lm_jax.decoding.generate against Hugging Face transformers' generate on the same
weights, prompts and lengths (greedy and beam search), new tokens per second and the ratio.

  python bench/decode.py                              # GPT-1 and T5-small, batch 8, prompt 32, 64 new tokens
  python bench/decode.py --quick                      # tiny variants, 8 new tokens: smoke test
  python bench/decode.py --models t5 --methods beam --num_beams 4

A first subprocess draws random weights for the config (configs/*.py) and writes them with
lm_jax.hf.export.save_hf, with random prompts of --prompt_len tokens (equal lengths, so transformers'
OpenAIGPT, which takes no position ids in generate, needs no padding). Then every measurement runs in its own
subprocess, ours and transformers' back to back, each after lm_jax.malloc.keep_freed_memory() as in
bench/train_step.py: ours loads the directory with lm_jax.hf.export.load_hf and times decoding.generate (the
first call, which compiles, apart); transformers loads it with from_pretrained and times model.generate after
one short warm-up call. No EOS on either side, so every row gets exactly --new_tokens tokens; both sides'
tokens are compared (float32 on both sides: expected to match). Tokens/s counts the returned new tokens
(batch x new tokens), not the beams.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MODELS = {"gpt1": ("gpt1", "gpt1", "tiny"), "t5": ("t5", "small", "tiny")}   # name: (config file, variant, --quick)


def load_model_config(args):
  from lm_jax import config_lib
  file, variant, quick = MODELS[args.model]
  config = config_lib.load(os.path.join(REPO, "configs", f"{file}.py:{quick if args.quick else variant}"))
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  return config.model


def worker_export(args):
  """Random weights and prompts into args.dir (config.json + model.safetensors, prompts.json)."""
  import jax
  from lm_jax import models
  from lm_jax.hf import export
  m = load_model_config(args)
  export.save_hf(m, models.init(m, jax.random.key(0)), args.dir)
  prompts = np.random.default_rng(0).integers(5, m.vocab_size - 100, (args.batch, args.prompt_len))
  with open(os.path.join(args.dir, "prompts.json"), "w") as f:
    json.dump(prompts.tolist(), f)
  return {}


def _prompts(args):
  with open(os.path.join(args.dir, "prompts.json")) as f:
    return json.load(f)


def _timed(run, repeats):
  """run() `repeats` times -> (median seconds, all seconds, CPU-seconds per wall-second, the last result)."""
  times, util, out = [], [], None
  for _ in range(repeats):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = run()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    times.append(t1 - t0)
    util.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (t1 - t0))
  return statistics.median(times), times, statistics.median(util), out


def worker_ours(args):
  from lm_jax import decoding
  from lm_jax.hf import export
  m, params = export.load_hf(args.dir, dtype=args.dtype)
  prompts = _prompts(args)
  kw = dict(max_new_tokens=args.new_tokens, method=args.method, num_beams=args.num_beams, pad_id=0)
  t0 = time.perf_counter()
  decoding.generate(m, params, prompts, **kw)
  first = time.perf_counter() - t0
  median, times, util, tokens = _timed(lambda: decoding.generate(m, params, prompts, **kw), args.repeats)
  return {"median_s": median, "times": times, "first_s": first, "util": util, "tokens": tokens}


def worker_hf(args):
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count())
  with open(os.path.join(args.dir, "config.json")) as f:
    cls = getattr(transformers, json.load(f)["architectures"][0])   # the class save_hf wrote
  model = cls.from_pretrained(args.dir, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype])
  model.eval()
  model.generation_config.eos_token_id = None   # as ours: no EOS, every row runs to the end
  prompts = torch.tensor(_prompts(args))
  mask = torch.ones_like(prompts)
  kw = dict(do_sample=False, num_beams=1, pad_token_id=0)
  if args.method == "beam":
    kw.update(num_beams=args.num_beams, early_stopping=True, length_penalty=1.0)

  def run(new_tokens=args.new_tokens):
    with torch.no_grad():
      out = model.generate(prompts, attention_mask=mask, max_new_tokens=new_tokens, **kw)
    return out[:, -new_tokens:].tolist()
  run(2)   # warm-up
  median, times, util, tokens = _timed(run, args.repeats)
  return {"median_s": median, "times": times, "first_s": 0.0, "util": util, "tokens": tokens,
          "attn": getattr(model.config, "_attn_implementation", "?")}


def worker_main(args):
  load = os.getloadavg()[0]
  from lm_jax import malloc
  malloc.keep_freed_memory()   # before JAX or PyTorch start, as the trainer's CLI does
  result = {"export": worker_export, "ours": worker_ours, "hf": worker_hf}[args.worker](args)
  result.update(load=load, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  print("RESULT " + json.dumps(result), flush=True)


def run_worker(args, worker, model, method, directory):
  argv = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--model", model, "--method", method,
          "--dir", directory, "--batch", str(args.batch), "--prompt_len", str(args.prompt_len),
          "--new_tokens", str(args.new_tokens), "--num_beams", str(args.num_beams), "--repeats", str(args.repeats),
          "--dtype", args.dtype] + ["--quick"] * args.quick
  proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
  print(f"[{worker} {model} {method}] failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
  return None


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
  p.add_argument("--methods", default="greedy,beam", help="comma list of greedy, beam")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--num_beams", type=int, default=4)
  p.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median reported)")
  p.add_argument("--dtype", default="float32", help="weights and compute dtype of both sides")
  p.add_argument("--quick", action="store_true", help="tiny variants, 8 new tokens: smoke test")
  p.add_argument("--json", default="", help="also write all results to this file")
  p.add_argument("--timeout", type=int, default=3600, help="seconds per measurement subprocess")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--model", help=argparse.SUPPRESS)
  p.add_argument("--method", help=argparse.SUPPRESS)
  p.add_argument("--dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.quick and "--new_tokens" not in sys.argv:
    args.new_tokens = 8
  if args.worker:
    return worker_main(args)
  models, methods = args.models.split(","), args.methods.split(",")
  for name in models + methods:
    if name not in MODELS and name not in ("greedy", "beam"):
      raise ValueError(f"unknown model or method {name!r}; models: {', '.join(MODELS)}; methods: greedy, beam")
  print(f"load average at start {os.getloadavg()[0]:.2f}; batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {args.num_beams} beams, {args.dtype}, median of {args.repeats}", flush=True)
  rows, dump = [], []
  for model in models:
    with tempfile.TemporaryDirectory() as directory:
      if run_worker(args, "export", model, "greedy", directory) is None:
        continue
      for method in methods:
        res = {w: run_worker(args, w, model, method, directory) for w in ("ours", "hf")}
        rows.append((model, method, res))
        dump.append({"model": model, "method": method, **res})
        print("  " + line(model, method, res, args), flush=True)
  print(f"\n{'model':6s} {'method':6s} {'ours tok/s':>10s} {'hf tok/s':>9s} {'ours/hf':>7s} {'compile s':>9s} "
        f"{'same tokens':>11s} {'cpu':>9s} {'load':>4s}")
  for model, method, res in rows:
    print(line(model, method, res, args))
  print("tok/s = batch x new tokens / median generate seconds; compile s = ours' first call minus a timed one; "
        "cpu = CPU-seconds per wall-second (ours, hf)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dump, f, indent=1)


def line(model, method, res, args) -> str:
  """One table row; '-' where a side failed."""
  ours, hf = res.get("ours"), res.get("hf")
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  rate = lambda r: r and args.batch * args.new_tokens / r["median_s"]
  ratio = ours and hf and rate(ours) / rate(hf)
  compile_s = ours and ours["first_s"] - ours["median_s"]
  same = "-" if not (ours and hf) else "yes" if ours["tokens"] == hf["tokens"] else "NO"
  util = f"{fmt(ours and ours['util'], '4.2f')},{fmt(hf and hf['util'], '4.2f')}"
  load = max((r["load"] for r in (ours, hf) if r), default=None)
  return (f"{model:6s} {method:6s} {fmt(rate(ours), '10.1f')} {fmt(rate(hf), '9.1f')} {fmt(ratio, '6.2f')}x "
          f"{fmt(compile_s, '9.1f')} {same:>11s} {util:>9s} {fmt(load, '4.1f')}")


if __name__ == "__main__":
  main()

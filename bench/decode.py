"""Decoding speed: lm_jax.decoding.generate per token step against the memory / matmul floor and against Hugging
Face transformers' generate with its KV cache, on the same weights, prompts and lengths.

  python bench/decode.py                                  # GPT-1, GPT-2 small, T5-small; batch 1, 8, 32; 3 methods
  python bench/decode.py --quick                          # tiny variants, 8 new tokens: smoke test
  python bench/decode.py --models t5 --batches 8 --methods beam --sides ours

A first subprocess per model draws random weights for the config (configs/*.py) and writes them with
lm_jax.hf.export.save_hf, with random prompts of --prompt_len tokens. The machine's memory bandwidth (the better of
a jitted copy and a matrix-vector product over 256 MB, best of 10 each) and matmul rate
(lm_jax.plan.hardware.matmul_flops_per_s) are measured at the start and again right after each of our timings, whose
floor uses them (the load of a shared machine changes). Then per model each side runs in its own subprocess after
lm_jax.malloc.keep_freed_memory(), every batch size and method in turn: **ours** loads the directory with
lm_jax.hf.export.load_hf and times decoding.generate, **hf** loads it with from_pretrained and times its generate
(use_cache: GPT-2 and T5 keep a KV cache; transformers' OpenAIGPT has none, so GPT-1 has no hf side). Both time
max_new_tokens=1 (the prompt's prefill and the first token) and --new_tokens, each after an untimed call (ours:
the compile), and a token step is their difference / (new_tokens - 1). No EOS on either side, so every row gets all
its tokens; greedy and beam tokens are compared (float32: expected to match); sampling draws from each side's RNG.

The floor of a token step is max(bytes / bandwidth, FLOPs / matmul rate): bytes are the weights a step reads (all
but the position table, and for T5 the encoder, the relative-position table and the cross-attention key/value
kernels, whose products are cached) plus the filled part of the KV cache (self-attention at the mean filled length,
T5's cross-attention keys/values); FLOPs are 2 x rows x those matrices' parameters plus the attention's
4 x rows x layers x heads x head_dim x filled length. Rows are batch x beams. Also printed: XLA's cost analysis of
one of our decode steps (bytes accessed, a full cache).
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

# name: (config file, variant, --quick variant, whether transformers' class has a KV cache)
MODELS = {"gpt1": ("gpt1", "gpt1", "tiny", False), "gpt2": ("gpt2", "small", "tiny", True),
          "t5": ("t5", "small", "tiny", True)}
METHODS = ("greedy", "sample", "beam")


def load_model_config(args):
  from lm_jax import config_lib
  file, variant, quick, _ = MODELS[args.model]
  config = config_lib.load(os.path.join(REPO, "configs", f"{file}.py:{quick if args.quick else variant}"))
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  return config.model


def worker_export(args):
  """Random weights and prompts (the largest batch; smaller batches take the first rows) into args.dir."""
  import jax
  from lm_jax import models
  from lm_jax.hf import export
  m = load_model_config(args)
  export.save_hf(m, models.init(m, jax.random.key(0)), args.dir)
  rows = max(map(int, args.batches.split(",")))
  prompts = np.random.default_rng(0).integers(5, m.vocab_size - 100, (rows, args.prompt_len))
  with open(os.path.join(args.dir, "prompts.json"), "w") as f:
    json.dump(prompts.tolist(), f)
  return {}


def worker_machine(args):
  return measure_machine()


def measure_machine() -> dict:
  """Memory bandwidth, the better of a copy (read + write of a 256 MB array) and a matrix-vector product (a 256 MB
  matrix streamed through a dot, as a decode step streams its weights), best of 10 each; the float32 matmul rate
  (measured anew on each call: the machine's load changes)."""
  import jax
  import jax.numpy as jnp
  from lm_jax.plan import hardware
  x, v = jnp.ones((2**14, 2**12), jnp.float32), jnp.ones((1, 2**14), jnp.float32)
  rates = {}
  for name, fn, operands, nbytes in (("copy", lambda a: a * 2, (x,), 2 * x.nbytes),
                                     ("gemv", jnp.dot, (v, x), x.nbytes)):
    fn = jax.jit(fn)
    fn(*operands).block_until_ready()
    rates[name] = nbytes / min(_seconds(lambda: fn(*operands).block_until_ready()) for _ in range(10))
  return {"bandwidth": max(rates.values()), **rates, "matmul": hardware.matmul_flops_per_s.__wrapped__()}


def _seconds(run):
  t0 = time.perf_counter()
  run()
  return time.perf_counter() - t0


def _prompts(args, batch):
  with open(os.path.join(args.dir, "prompts.json")) as f:
    return json.load(f)[:batch]


def _step_time(run, new_tokens, repeats):
  """run(n) -> tokens. Times n=1 and n=new_tokens alternately, each after an untimed call -> (ms per token step,
  prefill + first token seconds, CPU-seconds per wall-second, the new_tokens call's tokens)."""
  run(1)
  tokens = run(new_tokens)
  one, full, util = [], [], []
  for _ in range(repeats):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    one.append(_seconds(lambda: run(1)))
    full.append(_seconds(lambda: run(new_tokens)))
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    util.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (t1 - t0))
  step = (statistics.median(full) - statistics.median(one)) / (new_tokens - 1)
  return 1e3 * step, statistics.median(one), statistics.median(util), tokens


def _cases(args):
  return [(int(b), m) for b in args.batches.split(",") for m in args.methods.split(",")]


def worker_ours(args):
  from lm_jax import decoding
  from lm_jax.hf import export
  m, params = export.load_hf(args.dir, dtype=args.dtype)
  out = {"xla_bytes": {}, "dots_ms": {}, "cases": {}}
  for batch, method in _cases(args):
    prompts = _prompts(args, batch)
    kw = dict(method=method, num_beams=args.num_beams, pad_id=0, seed=0)
    t0 = time.perf_counter()
    decoding.generate(m, params, prompts, max_new_tokens=args.new_tokens, **kw)
    compile_s = time.perf_counter() - t0
    step_ms, first_s, util, tokens = _step_time(
        lambda n: decoding.generate(m, params, prompts, max_new_tokens=n, **kw), args.new_tokens, args.repeats)
    out["cases"][f"{batch},{method}"] = dict(step_ms=step_ms, first_s=first_s, util=util, tokens=tokens,
                                             compile_s=compile_s - first_s - step_ms * (args.new_tokens - 1) / 1e3,
                                             machine=measure_machine(), load=os.getloadavg())
    rows = batch * (args.num_beams if method == "beam" else 1)
    if rows not in out["xla_bytes"]:
      out["xla_bytes"][rows] = xla_step_bytes(m, params, rows, args)
      out["dots_ms"][rows] = products_ms(m, params, rows, args)
    print(f"  ours {args.model} {method} batch {batch}: {step_ms:.1f} ms/step", file=sys.stderr, flush=True)
  return out


def step_leaves(m, params):
  """(path keys, leaf) of the params a token step reads whole: not the encoder, the cross-attention key / value
  kernels (their products are cached) or the tables a step reads one row of (positions, relative positions, an
  untied T5 input embedding)."""
  import jax
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [getattr(k, "key", str(k)) for k in path]
    name = "/".join(keys)
    cached = keys[0] == "encoder" or ("cross_attention" in name and ("/key/" in name or "/value/" in name))
    gathered = "position_embeddings" in name or "relative_bias" in name or (
        keys[0] == "shared" and not m.get("tie_embeddings", True))
    if not (cached or gathered):
      yield keys, leaf


def step_matrices(m, params) -> list:
  """The weight matrices a token step multiplies its rows by (step_leaves), as generate holds them (output-major on
  a CPU: relayout.output_major), each (outputs, inputs): the layers' kernels and the tied LM head."""
  import jax
  from lm_jax.models import relayout
  cpu = jax.default_backend() == "cpu"
  params = jax.jit(relayout.output_major)(params) if cpu else params
  mats = []
  for keys, leaf in step_leaves(m, params):
    if keys[-1] == ("kernel_t" if cpu else "kernel"):
      mats.append(leaf.reshape(-1, leaf.shape[-1]) if cpu else leaf.reshape(-1, leaf.shape[-1]).T)
    elif keys[-1] == "embedding":
      mats.append(leaf)   # the tied LM head, x @ table.T
  return mats


def products_ms(m, params, rows, args) -> float:
  """ms of a token step's weight products alone (step_matrices, `rows` rows each, as XLA runs ours: one jitted
  loop, 16 steps, median of 5): the matmul kernels' own time for these shapes, beside the floor."""
  import jax
  import jax.numpy as jnp
  mats = step_matrices(m, params)
  xs = {w.shape[1]: jnp.ones((rows, w.shape[1]), w.dtype) for w in mats}

  def step(i, c):   # every product's input depends on the carry: nothing is hoisted out of the loop
    outs = [jax.lax.dot_general(xs[w.shape[1]] * (1 + c), w, (((1,), (1,)), ((), ()))) for w in mats]
    return c + 1e-30 * sum(o[0, 0] for o in outs)
  loop = jax.jit(lambda mats: jax.lax.fori_loop(0, 16, step, jnp.zeros((), mats[0].dtype)))
  loop(mats).block_until_ready()
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    loop(mats).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times) / 16


def xla_step_bytes(m, params, rows, args) -> float:
  """XLA's bytes accessed by one decode step (one token per row, the cache generate allocates, donated; the params
  as generate holds them)."""
  import jax
  import jax.numpy as jnp
  from lm_jax import models
  from lm_jax.models import relayout
  if jax.default_backend() == "cpu":
    params = jax.jit(relayout.output_major)(params)
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  if models.family(m).layout == "decoder":
    batch = {"input_ids": shape(rows, args.prompt_len)}
    length = args.prompt_len + args.new_tokens - 1
    step = lambda p, c, t: models.decode_step(m, p, t, c, positions=0 * t)
  else:
    batch = {"input_ids": shape(rows, args.prompt_len), "attention_mask": shape(rows, args.prompt_len)}
    length = args.new_tokens
    step = lambda p, c, t: models.decode_step(m, p, t, c)
  cache = jax.eval_shape(lambda p, b: models.init_cache(m, p, b, length), params, batch)
  cost = jax.jit(step, donate_argnums=1).lower(params, cache, shape(rows, 1)).compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def worker_hf(args):
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count())
  with open(os.path.join(args.dir, "config.json")) as f:
    cls = getattr(transformers, json.load(f)["architectures"][0])   # the class save_hf wrote
  model = cls.from_pretrained(args.dir, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype])
  model.eval()
  model.generation_config.eos_token_id = None   # as ours: no EOS, every row runs to the end
  out = {"cases": {}, "attn": getattr(model.config, "_attn_implementation", "?")}
  for batch, method in _cases(args):
    prompts = torch.tensor(_prompts(args, batch))
    kw = dict(do_sample=method == "sample", num_beams=1, pad_token_id=0, use_cache=True, top_k=0, top_p=1.0,
              temperature=1.0)
    if method == "beam":
      kw.update(num_beams=args.num_beams, early_stopping=True, length_penalty=1.0)

    def run(n):
      torch.manual_seed(0)
      with torch.no_grad():
        generated = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, **kw)
      return generated[:, -n:].tolist()
    step_ms, first_s, util, tokens = _step_time(run, args.new_tokens, args.repeats)
    out["cases"][f"{batch},{method}"] = dict(step_ms=step_ms, first_s=first_s, util=util, tokens=tokens)
    print(f"  hf {args.model} {method} batch {batch}: {step_ms:.1f} ms/step", file=sys.stderr, flush=True)
  return out


def step_costs(m, rows: int, args) -> tuple[float, float]:
  """(bytes, FLOPs) of one ideal token step for `rows` rows (see the module docstring)."""
  from lm_jax import models
  from lm_jax.models import layers, t5
  params = models.abstract_params(m)
  itemsize = np.dtype(args.dtype).itemsize
  weights = matmul = 0
  for keys, leaf in step_leaves(m, params):
    size = int(np.prod(leaf.shape))
    weights += size
    matmul += size if keys[-1] in ("kernel", "embedding") else 0
  decoder = models.family(m).layout == "decoder"
  n_layers = m.num_layers if decoder else t5.num_decoder_layers(m)
  filled = (args.prompt_len if decoder else 0) + args.new_tokens / 2   # mean self-attention length over the steps
  cross = 0 if decoder else args.prompt_len
  width = m.num_heads * layers.head_dim(m)
  kv = 2 * rows * n_layers * width * (filled + cross)
  return weights * itemsize + kv * itemsize, 2 * rows * matmul + 2 * kv


def worker_main(args):
  load = os.getloadavg()
  from lm_jax import malloc
  malloc.keep_freed_memory()   # before JAX or PyTorch start, as the trainer's CLI does
  result = {"export": worker_export, "machine": worker_machine, "ours": worker_ours, "hf": worker_hf}[args.worker](args)
  result.update(load=load, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  print("RESULT " + json.dumps(result), flush=True)


def run_worker(args, worker, model, directory):
  argv = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--model", model, "--dir", directory,
          "--batches", args.batches, "--methods", args.methods, "--prompt_len", str(args.prompt_len),
          "--new_tokens", str(args.new_tokens), "--num_beams", str(args.num_beams), "--repeats", str(args.repeats),
          "--dtype", args.dtype] + ["--quick"] * args.quick
  proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  print(f"[{worker} {model}] failed (exit {proc.returncode})", file=sys.stderr, flush=True)
  return None


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
  p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
  p.add_argument("--batches", default="1,8,32", help="comma list of batch sizes")
  p.add_argument("--sides", default="ours,hf", help="comma list of ours, hf")
  p.add_argument("--prompt_len", type=int, default=32)
  p.add_argument("--new_tokens", type=int, default=64)
  p.add_argument("--num_beams", type=int, default=4)
  p.add_argument("--repeats", type=int, default=3, help="timed pairs of calls per measurement (medians)")
  p.add_argument("--dtype", default="float32", help="weights and compute dtype of both sides")
  p.add_argument("--quick", action="store_true", help="tiny variants, 8 new tokens: smoke test")
  p.add_argument("--json", default="", help="also write all results to this file")
  p.add_argument("--timeout", type=int, default=7200, help="seconds per subprocess")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--model", help=argparse.SUPPRESS)
  p.add_argument("--dir", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.quick and "--new_tokens" not in sys.argv:
    args.new_tokens = 8
  if args.worker:
    return worker_main(args)
  models, sides = args.models.split(","), args.sides.split(",")
  for name in models + args.methods.split(",") + sides:
    if name not in MODELS and name not in METHODS and name not in ("ours", "hf"):
      raise ValueError(f"unknown model, method or side {name!r}; models: {', '.join(MODELS)}; methods: "
                       f"{', '.join(METHODS)}; sides: ours, hf")
  print(f"load average at start {os.getloadavg()}; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{args.num_beams} beams, {args.dtype}, median of {args.repeats}", flush=True)
  machine = run_worker(args, "machine", models[0], "")
  print(f"bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s (copy {machine['copy'] / 1e9:.1f}, matrix-vector "
        f"{machine['gemv'] / 1e9:.1f}), matmul {machine['matmul'] / 1e9:.1f} GFLOP/s", flush=True)
  rows, dump = [], {"machine": machine, "models": {}}
  for model in models:
    with tempfile.TemporaryDirectory() as directory:
      if run_worker(args, "export", model, directory) is None:
        continue
      res = {side: run_worker(args, side, model, directory) for side in sides if side == "ours" or MODELS[model][3]}
    dump["models"][model] = res
    args.model = model
    m = load_model_config(args)
    for batch, method in _cases(args):
      rows.append(line(model, m, batch, method, res, machine, args))
      print(rows[-1], flush=True)
  print(f"\n{HEADER}\n" + "\n".join(rows))
  print("ms = per token step; floor = max(GB / bandwidth, GFLOP / matmul rate); dots = the step's weight products "
        "alone, as XLA runs ours; at = floor / ours; "
        "hf/ours = transformers' ms / ours; xla GB = XLA's bytes accessed by one of our steps; "
        "cpu = ours' CPU-seconds per wall-second; the floor's rates and the 1-minute load average are measured right "
        "after ours' timing of that row")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dump, f, indent=1)


HEADER = (f"{'model':5s} {'method':6s} {'batch':>5s} {'ours ms':>8s} {'hf ms':>7s} {'floor ms':>8s} {'dots ms':>7s} "
          f"{'GB':>6s} {'GFLOP':>6s} {'at':>5s} {'hf/ours':>7s} {'same':>4s} {'xla GB':>6s} {'compile':>7s} {'cpu':>4s} "
          f"{'load':>4s}")


def line(model, m, batch, method, res, machine, args) -> str:
  """One table row; '-' where a side failed or has no peer."""
  fmt = lambda x, spec: "-" if x is None else format(x, spec)
  ours, hf = ((res.get(s) or {}).get("cases", {}).get(f"{batch},{method}") for s in ("ours", "hf"))
  rows = batch * (args.num_beams if method == "beam" else 1)
  nbytes, flop = step_costs(m, rows, args)
  machine = ours["machine"] if ours else machine   # measured right after this case's timing
  floor = 1e3 * max(nbytes / machine["bandwidth"], flop / machine["matmul"])
  same = "-" if not (ours and hf) or method == "sample" else "yes" if ours["tokens"] == hf["tokens"] else "NO"
  xla = (res.get("ours") or {}).get("xla_bytes", {}).get(str(rows))
  dots = (res.get("ours") or {}).get("dots_ms", {}).get(str(rows))
  at = ours and floor / ours["step_ms"]
  speedup = ours and hf and hf["step_ms"] / ours["step_ms"]
  load = ours and ours["load"][0]
  return (f"{model:5s} {method:6s} {batch:5d} {fmt(ours and ours['step_ms'], '8.1f')} "
          f"{fmt(hf and hf['step_ms'], '7.1f')} {floor:8.1f} {fmt(dots, '7.1f')} {nbytes / 1e9:6.3f} {flop / 1e9:6.2f} "
          f"{fmt(at and 100 * at, '4.0f')}% {fmt(speedup, '6.2f'):>6s}x {same:>4s} {fmt(xla and xla / 1e9, '6.3f')} "
          f"{fmt(ours and ours['compile_s'], '7.1f')} {fmt(ours and ours['util'], '4.2f')} {fmt(load, '4.1f')}")


if __name__ == "__main__":
  main()

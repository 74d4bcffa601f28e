"""Train-step throughput: lm_jax against Hugging Face transformers (PyTorch eager and torch.compile) on the
same model, shapes, dtype and batch, and against the XLA matmul rate of this machine (the roofline).

  python bench/train_step.py                                  # BERT-base, GPT-1 (128, 512), T5-base, on CPU
  python bench/train_step.py --quick                          # tiny shapes: smoke test (~minutes)
  python bench/train_step.py --models bert --peers none --set model.scan_layers=True   # one experiment

Ours is the real step: lm_jax.step.make_train_step with the config's objective and optimizer, built with
lm_jax.train's own setup functions, on a synthetic batch of the objective's features. FLOPs are the
trainer's (Objective.flops_per_example, so MFU here is the training log's MFU), cross-checked
against XLA's cost_analysis of the compiled step. The peer trains transformers' BertForPreTraining /
OpenAIGPTLMHeadModel / T5ForConditionalGeneration built from our config (lm_jax.hf.*.hf_config), with
torch.optim.AdamW and the same gradient clipping. T5's Adafactor is replaced by AdamW on both sides so both
do the same work. Every measurement runs in its own subprocess (peak RSS is that process's ru_maxrss), and
per shape the roofline, ours and the peers run back to back, so a ratio compares runs made under the same
machine load; --rounds > 1 repeats them in alternating order and keeps each one's best round (the fastest
roofline), since load from other processes only ever slows a run down.
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

# shape name: (config file, variant, seq_len, default batch on CPU)
SHAPES = {
    "bert": ("bert", "base", 128, 8),
    "gpt1_128": ("gpt1", "gpt1", 128, 8),
    "gpt1_512": ("gpt1", "gpt1", 512, 4),
    "t5": ("t5", "base", 512, 4),
}
QUICK = {"bert": "tiny", "gpt1": "tiny", "t5": "tiny"}  # --quick: tiny variants at seq_len / 4
PEERS = ("eager", "compiled")


# ------------------------------------------------------------------------------------------------ config, batch
def load_config(shape, args):
  """The shape's config from configs/*.py with the benchmark's batch, dtype and --set overrides."""
  from lm_jax import config_lib, models
  file, variant, seq_len, _ = SHAPES[shape]
  config = config_lib.load(os.path.join(REPO, "configs", f"{file}.py:{QUICK[file] if args.quick else variant}"))
  config.data.seq_len = seq_len // 4 if args.quick else seq_len
  # BERT's create_pretraining_data: round(0.15 * seq_len), 20 at 128
  if models.family(config.model).layout == "encoder":
    config.data.max_predictions_per_seq = max(1, round(0.15 * config.data.seq_len))
  if config.optimizer.name == "adafactor":  # the peer's AdamW, so both sides do the same optimizer work
    config.optimizer.name, config.optimizer.weight_decay, config.optimizer.clip_norm = "adamw", 0.01, 1.0
  config.batch_size = batch_size(shape, args)
  config.model.dtype = args.dtype
  config.total_steps = config.phase_end_step = 10_000
  config.optimizer.warmup_steps = 100
  return config_lib.override(config, args.set)


def batch_size(shape, args) -> int:
  """--batch N for every shape, or shape=N,... per shape (others keep their default)."""
  default = 2 if args.quick else SHAPES[shape][3]
  if not args.batch:
    return default
  if "=" not in args.batch:
    return int(args.batch)
  sizes = dict(item.split("=") for item in args.batch.split(","))
  return int(sizes.get(shape, default))


def synthetic_batch(config, seed=0) -> dict:
  """Random numpy batch with every feature the objective consumes: full-length rows (as packed
  pre-training data is), random token ids, BERT's max_predictions_per_seq distinct masked positions."""
  from lm_jax import objectives
  rng = np.random.default_rng(seed)
  b, v = config.batch_size, config.model.vocab_size
  feats = objectives.get(config.objective).features(config)
  batch = {}
  for name, (shape, dtype) in feats.items():
    shape = (b, *shape)
    if name in ("attention_mask", "decoder_attention_mask", "segment_ids", "mlm_weights", "weights"):
      batch[name] = np.ones(shape, dtype)
    elif name == "token_type_ids":
      batch[name] = (np.arange(shape[1]) >= shape[1] // 2).astype(dtype)[None].repeat(b, 0)
    elif name == "positions":
      batch[name] = np.arange(shape[1], dtype=dtype)[None].repeat(b, 0)
    elif name == "mlm_positions":
      batch[name] = np.sort(np.stack([rng.choice(np.arange(1, config.data.seq_len), shape[1], replace=False)
                                      for _ in range(b)]), axis=1).astype(dtype)
    elif name == "nsp_labels":
      batch[name] = rng.integers(0, 2, shape, dtype=dtype)
    else:  # token ids (input_ids, targets, mlm_ids, decoder_*_ids); the top 100 ids are T5's sentinels
      batch[name] = rng.integers(5, v - 100, shape, dtype=dtype)
  return batch


# ----------------------------------------------------------------------------------------------------- workers
def _timed(run_step, steps, warmup):
  """Calls run_step() warmup + steps times -> (first call seconds, median step seconds, median CPU-s per wall-s,
  all step seconds)."""
  times, util = [], []
  for i in range(warmup + steps):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run_step()
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    times.append(t1 - t0)
    util.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (t1 - t0))
  return times[0], statistics.median(times[warmup:]), statistics.median(util[warmup:]), times


def worker_roofline(args):
  """The trainer's own CPU peak measurement (best of 10 jitted n^3 jnp.dot in --dtype) -> FLOP/s."""
  import jax
  from lm_jax.plan import hardware
  return {"flops_per_s": hardware.matmul_flops_per_s(args.matmul_size, args.dtype),
          "device": jax.devices()[0].device_kind}


def worker_ours(args):
  import jax
  from flax import linen as nn
  from lm_jax import checks, layout, models, objectives, sharding, step
  config = load_config(args.shape, args)
  devices = jax.devices()
  checks.validate(config, len(devices))
  objective = objectives.get(config.objective)
  mesh, rules = sharding.make_mesh(config, devices), sharding.rules(config)
  lay = layout.build(config, mesh, rules)
  tx, lr, state_sh = lay.tx, lay.lr_schedule, lay.state_sharding
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    state = step.fresh_state(config, tx, state_sh)
    train_step = step.make_train_step(config, objective, tx, lr, state_sh, mesh)
    batch = sharding.global_batch(synthetic_batch(config), sharding.batch_sharding(mesh))
    t0 = time.perf_counter()
    compiled = train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    holder = {"state": state}

    def run_step():
      holder["state"], metrics = compiled(holder["state"], batch)
      jax.block_until_ready((holder["state"], metrics))
      holder["loss"] = float(metrics["loss"])
    first, median, util, times = _timed(run_step, args.steps, args.warmup)
  stats = devices[0].memory_stats() or {}
  return {"median_s": median, "compile_s": compile_s, "util": util, "times": times, "loss": holder["loss"],
          "flops_per_step": objective.flops_per_example(config) * config.batch_size,
          "xla_flops_per_step": float(cost.get("flops", 0.0)),
          "tokens_per_step": objective.tokens_per_example(config) * config.batch_size,
          "params": models.count(state["params"]), "device_peak_bytes": stats.get("peak_bytes_in_use", 0)}


def _hf_model(config):
  import transformers
  from lm_jax import hf
  mod = hf.family_module(config.model)
  fields = mod.hf_config(config.model)
  fields.pop("architectures")
  hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  return getattr(transformers, mod.ARCHITECTURE)(hf_config)


def _hf_inputs(config, batch):
  """The same synthetic batch in the peer's input format (labels = -100 where nothing is scored)."""
  import torch
  from lm_jax import models
  t = lambda x: torch.as_tensor(np.asarray(x, np.int64))
  layout = models.family(config.model).layout
  if layout == "encoder":
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    np.put_along_axis(labels, batch["mlm_positions"], batch["mlm_ids"], axis=1)
    return dict(input_ids=t(batch["input_ids"]), token_type_ids=t(batch["token_type_ids"]),
                attention_mask=t(batch["attention_mask"]), labels=t(labels),
                next_sentence_label=t(batch["nsp_labels"]))
  if layout == "decoder":  # HF shifts the labels itself
    return dict(input_ids=t(batch["input_ids"]), labels=t(batch["input_ids"]))
  return dict(input_ids=t(batch["input_ids"]), attention_mask=t(batch["attention_mask"]),
              decoder_input_ids=t(batch["decoder_input_ids"]),
              decoder_attention_mask=t(batch["decoder_attention_mask"]), labels=t(batch["decoder_target_ids"]))


def worker_torch(args):
  import torch
  config = load_config(args.shape, args)
  torch.manual_seed(0)
  torch.set_num_threads(os.cpu_count())
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = _hf_model(config).to(device).train()
  params = [p for p in model.parameters()]
  opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
  inputs = {k: v.to(device) for k, v in _hf_inputs(config, synthetic_batch(config)).items()}
  forward = torch.compile(model) if args.worker == "compiled" else model
  clip = config.optimizer.clip_norm
  holder = {}

  def run_step():
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
      loss = forward(**inputs).loss
    loss.backward()
    if clip:
      torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    holder["loss"] = float(loss)  # also waits for the device
  first, median, util, times = _timed(run_step, args.steps, args.warmup)
  from lm_jax import objectives
  return {"median_s": median, "compile_s": first - median if args.worker == "compiled" else 0.0, "util": util,
          "times": times, "loss": holder["loss"], "params": sum(p.numel() for p in params),
          "tokens_per_step": objectives.get(config.objective).tokens_per_example(config) * config.batch_size,
          "attn": getattr(model.config, "_attn_implementation", "?"),
          "device_peak_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else 0}


def worker_main(args):
  load = os.getloadavg()[0]
  if not args.system_malloc:
    from lm_jax import malloc
    malloc.keep_freed_memory()  # as the trainer's CLI does; before JAX or PyTorch start
  fn = {"roofline": worker_roofline, "ours": worker_ours, "eager": worker_torch, "compiled": worker_torch}
  result = fn[args.worker](args)
  result.update(load=load, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
  print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------ orchestration
def run_worker(args, worker, shape):
  argv = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--shape", shape]
  argv += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
           "--matmul_size", str(args.matmul_size), "--batch", args.batch or ""]
  argv += ["--quick"] * args.quick + ["--system_malloc"] * args.system_malloc + [f"--set={s}" for s in args.set]
  env = dict(os.environ)
  with tempfile.TemporaryDirectory() as cache:
    env["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold torch.compile, as our XLA compile is
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[7:])
  tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
  print(f"[{worker} {shape}] failed (exit {proc.returncode}):\n{tail}", file=sys.stderr, flush=True)
  return None


def fmt(x, spec):
  return "-" if x is None else format(x, spec)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--models", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
  p.add_argument("--batch", default="", help="N for every shape, or shape=N,... (default: 8, 8, 4, 4; quick 2)")
  p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first includes compilation)")
  p.add_argument("--rounds", type=int, default=1, help="repeat each shape's measurements, interleaved")
  p.add_argument("--peers", default=",".join(PEERS), help="comma list of eager, compiled; or none")
  p.add_argument("--dtype", default="float32", help="compute dtype of ours (model.dtype) and the peers (autocast)")
  p.add_argument("--peak_tflops", type=float, default=0.0, help="MFU denominator; 0 = the measured matmul rate")
  p.add_argument("--matmul_size", type=int, default=2048, help="n of the n^3 roofline matmul")
  p.add_argument("--quick", action="store_true", help="tiny variants at seq_len/4, batch 2: smoke test")
  p.add_argument("--set", action="append", default=[], help="config override for ours, e.g. model.scan_layers=True")
  p.add_argument("--system_malloc", action="store_true",
                 help="glibc's default malloc in every worker instead of lm_jax.malloc.keep_freed_memory()")
  p.add_argument("--json", default="", help="also write all results to this file")
  p.add_argument("--timeout", type=int, default=3600, help="seconds per measurement subprocess")
  p.add_argument("--worker", help=argparse.SUPPRESS)
  p.add_argument("--shape", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    return worker_main(args)
  shapes = args.models.split(",")
  peers = [] if args.peers == "none" else args.peers.split(",")
  for name in shapes + peers:
    if name not in SHAPES and name not in PEERS:
      raise ValueError(f"unknown model or peer {name!r}; models: {', '.join(SHAPES)}; peers: {', '.join(PEERS)}")
  print(f"load average at start {os.getloadavg()[0]:.2f}; dtype {args.dtype}; steps {args.steps} after "
        f"{args.warmup} warm-up; {'quick' if args.quick else 'full'} shapes; overrides {args.set or 'none'}", flush=True)
  results = []
  for shape in shapes:
    runs = {}
    for r in range(args.rounds):
      order = ["roofline", "ours", *peers]
      order = order if r % 2 == 0 else order[:1] + order[1:][::-1]
      for worker in order:
        res = run_worker(args, worker, shape)
        if res:
          runs.setdefault(worker, []).append(res)
          print(f"  {shape:9s} {worker:9s} " + progress(res, runs, args), flush=True)
    results.append((shape, runs))
  report(results, args)


def progress(res, runs, args) -> str:
  if "flops_per_s" in res:
    return f"{res['flops_per_s'] / 1e12:.3f} TFLOP/s matmul"
  line = f"{res['median_s']:.3f} s/step  {res['tokens_per_step'] / res['median_s']:.0f} tok/s"
  if runs.get("ours") and runs.get("roofline"):
    achieved = runs["ours"][0]["flops_per_step"] / res["median_s"]
    peak = args.peak_tflops * 1e12 or runs["roofline"][-1]["flops_per_s"]
    line += f"  {achieved / 1e12:.3f} TFLOP/s  MFU {achieved / peak:.1%}"
  return line + f"  compile {res['compile_s']:.1f} s  cpu {res['util']:.2f}  load {res['load']:.1f}"


def report(results, args):
  """One row per shape and implementation, then the ratios."""
  rows, ratios, dump = [], [], []
  # One machine, one roofline: the best matmul rate measured in this run (load only ever lowers it).
  best_roof = max((r["flops_per_s"] for _, runs in results for r in runs.get("roofline", [])), default=None)
  head = (f"{'shape':9s} {'impl':9s} {'batch':>5s} {'tok/step':>8s} {'s/step':>7s} {'tok/s':>8s} {'TFLOP/s':>7s} "
          f"{'MFU':>6s} {'compile s':>9s} {'RSS GB':>6s} {'cpu':>4s} {'load':>4s}")
  for shape, runs in results:
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    best = lambda rs: min(rs, key=lambda r: r["median_s"])  # other load only ever slows a round down
    roof = best_roof
    peak = args.peak_tflops * 1e12 or roof
    dump.append({"shape": shape, "impl": "roofline", "runs": runs.get("roofline", [])})
    ours = runs.get("ours")
    flops = ours[0]["flops_per_step"] if ours else None
    toks = {}
    for impl in ("ours", *PEERS):
      if not runs.get(impl):
        continue
      rs = [best(runs[impl])]
      s, tokens = rs[0]["median_s"], rs[0]["tokens_per_step"]
      toks[impl] = tokens / s
      achieved = flops / s if flops else None
      rss = max(r["peak_rss_gb"] for r in rs)
      dev = max(r["device_peak_bytes"] for r in rs) / 2**30
      rows.append(f"{shape:9s} {impl:9s} {batch_size(shape, args):5d} {tokens:8d} {s:7.3f} {tokens / s:8.1f} "
                  f"{fmt(achieved and achieved / 1e12, '7.3f')} {fmt(achieved and peak and achieved / peak, '6.1%')} "
                  f"{med(rs, 'compile_s'):9.1f} {(dev or rss):6.2f} {med(rs, 'util'):4.2f} {med(rs, 'load'):4.1f}")
      dump.append({"shape": shape, "impl": impl, "runs": runs[impl], "roofline_flops_per_s": roof})
    if ours:
      o = ours[0]
      line = (f"{shape:9s} ours/roofline {fmt(roof and flops * toks['ours'] / o['tokens_per_step'] / roof, '.1%')}"
              f"  ours/eager {fmt(toks.get('eager') and toks['ours'] / toks['eager'], '.2f')}x"
              f"  ours/compiled {fmt(toks.get('compiled') and toks['ours'] / toks['compiled'], '.2f')}x"
              f"  roofline here {fmt(runs.get('roofline') and runs['roofline'][0]['flops_per_s'] / 1e12, '.3f')} TFLOP/s"
              f"  FLOPs/step trainer {flops / 1e9:.1f} G, XLA {o['xla_flops_per_step'] / 1e9:.1f} G"
              f"  params {o['params'] / 1e6:.1f}M")
      ratios.append(line)
  print("\n" + head)
  print("\n".join(rows))
  print("\n" + "\n".join(ratios))
  print(f"roofline = best {args.matmul_size}^3 {args.dtype} jnp.dot rate of this run: "
        f"{fmt(best_roof and best_roof / 1e12, '.3f')} TFLOP/s")
  print("MFU = trainer FLOPs (lm_jax.flops) / step time / " + (f"{args.peak_tflops} TFLOP/s peak" if args.peak_tflops
        else "that roofline") + "; RSS = peak host memory of that measurement's process "
        "(device peak on GPU); cpu = CPU-seconds per wall-second of the timed steps")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dump, f, indent=1)


if __name__ == "__main__":
  main()

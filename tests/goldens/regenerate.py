"""Golden runs: the first 20 losses and the final eval loss of each tiny config's run (every family and objective)
on 1 device, of one model per layout on an 8-device mesh (data 2, fsdp 2, tensor 2), and the per-device memory
--mode=compile reports for two topologies. tests/test_goldens.py compares today's numbers with them. A change that
moves them regenerates them in the same commit, saying why:

  python tests/goldens/regenerate.py --reason="why the numbers moved"

writes tests/goldens/{1_device,8_devices,compile_memory}.json with the reason, date, commit and versions;
compile_memory.json only where LM_JAX_AOT_PYTHON names the --mode=compile interpreter (tests/test_aot.py), else
it is kept as it is.

The runs train in three forked processes side by side (WORKERS; `--measure` prints their JSON), XLA's
CPU flags below compile a tiny step in about a second (numbers differ from the default flags' in the last digits;
golden and test use the same), --xla_cpu_max_isa keeps the code the same on CPUs with wider vectors, and
single-threaded Eigen spends no CPU time waiting on 8 simulated devices.
"""
import argparse
import contextlib
import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import traceback

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS = 20
# XLA:CPU's cheapest compile (the whole test session uses it too: tests/conftest.py)
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
XLA_FLAGS = (f"--xla_force_host_platform_device_count=8 {FAST_COMPILE} --xla_cpu_max_isa=AVX2 "
             "--xla_cpu_multi_thread_eigen=false")
REGENERATE = 'python tests/goldens/regenerate.py --reason="..."'

# Every run: 1 layer of d_model 32, seq 32, batch 8, 20 steps, one eval at the end on at most 2 batches. In the
# overrides $DATA is the offline data (tests/conftest.py's shared_data), $TOY the files write_inputs makes, $RUNS
# the folder of the group's workdirs (gpt_classify starts from the clm run).
SMALL = {"model.num_layers": 1, "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 128, "data.seq_len": 32,
         "batch_size": 8, "total_steps": STEPS, "phase_end_step": 0, "log_every": 1, "eval_every": STEPS,
         "checkpoint_every": STEPS, "peak_tflops": 1.0, "optimizer.warmup_steps": 5}
PRETRAIN = {"data.files": "$TOY/shakespeare.txt", "model.vocab_size": 256, "data.eval_batches": 2}
SST2 = {"task.files": "$DATA/sst2/{split}.tsv", "data.train_split": "train[:512]", "data.eval_split": "dev[:16]"}
TOY = {"data.files": "", "data.tokenizer": "$TOY/toy.model", "data.eval_batches": 2}
RUNS = {   # name: (config, overrides)
    "bert_mlm": ("configs/bert.py:tiny", {**PRETRAIN, "data.max_predictions_per_seq": 5}),
    "bert_classify": ("configs/finetune/bert.py:tiny", {**SST2, "data.files": "$DATA/sst2/{split}.tsv",
                                                         "model.vocab_size": 256, "data.eval_batches": 2}),
    "gpt_clm": ("configs/gpt1.py:tiny", PRETRAIN),
    "gpt_gpt_classify": ("configs/finetune/gpt1.py:tiny", {**SST2, "init_from": "$RUNS/gpt_clm"}),
    "gpt_sft": ("configs/rlhf/sft.py:tiny", {**TOY, "rlhf.files": "$TOY/instructions_{split}.jsonl"}),
    "gpt_reward": ("configs/rlhf/reward.py:tiny", {**TOY, "rlhf.files": "$TOY/preferences_{split}.jsonl"}),
    "gpt_dpo": ("configs/rlhf/dpo.py:tiny", {**TOY, "rlhf.files": "$TOY/preferences_{split}.jsonl"}),
    "gpt_ppo": ("configs/rlhf/ppo.py:tiny", {"data.tokenizer": "$TOY/toy.model", "data.files": "$TOY/prompts.txt",
                                             "ppo.prompts": "$TOY/prompts.txt", "ppo.prompt_len": 8,
                                             "ppo.max_new_tokens": 8, "ppo.epochs": 1}),
    "gpt2_clm": ("configs/gpt2.py:tiny", {**PRETRAIN, "model.max_positions": 64}),
    "llama_clm": ("configs/llama.py:tiny", {**PRETRAIN, "model.num_heads": 4, "model.num_kv_heads": 2}),
    "qwen3_clm": ("configs/qwen3.py:tiny", {**PRETRAIN, "model.num_heads": 4, "model.num_kv_heads": 2,
                                            "model.head_dim": 16}),
    "modernbert_mlm": ("configs/modernbert.py:tiny", {**PRETRAIN, "model.num_layers": 2, "model.sliding_window": 8,
                                                      "data.max_predictions_per_seq": 10}),
    "nanogpt_clm": ("configs/nanogpt.py:shakespeare_char_cpu", {"data.files": "$TOY/shakespeare.txt",
                                                                "data.eval_batches": 2, "model.max_positions": 32}),
    "t5_span_corruption": ("configs/t5.py:tiny", {**PRETRAIN, "model.vocab_size": 384, "model.head_dim": 16}),
    "t5_text_to_text": ("configs/finetune/t5.py:tiny", {**SST2, "data.files": "$DATA/sst2/{split}.tsv",
                                                        "model.vocab_size": 384, "model.head_dim": 16,
                                                        "data.eval_batches": 2}),
}
METRIC = {"ppo": "policy_loss"}   # an objective whose records name their loss otherwise
# group (a golden file): its mesh. The 8-device mesh runs one model of each layout (encoder, decoder,
# encoder-decoder): all runs on it do not fit test_goldens' minute on 2 cores.
MESHES = {"1_device": {}, "8_devices": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}}
# The runs of each forked worker (group, run), balanced by CPU time (about 24 s each on this 2-core CI machine). The
# runs that score predictions share a worker, which imports sklearn once, and gpt_classify its clm run's.
WORKERS = [[("1_device", name) for name in ("bert_mlm", "bert_classify", "gpt_clm", "gpt_gpt_classify",
                                            "t5_text_to_text", "nanogpt_clm")],
           [("8_devices", "bert_mlm"), ("8_devices", "gpt_clm"), ("8_devices", "t5_span_corruption"),
            ("1_device", "gpt2_clm"), ("1_device", "qwen3_clm"), ("1_device", "gpt_dpo")],
           [("1_device", name) for name in ("gpt_ppo", "t5_span_corruption", "llama_clm", "modernbert_mlm", "gpt_sft",
                                            "gpt_reward")]]
# --mode=compile's memory per device: the configs' tiny models (d_model 128: test_aot.py says why) on two topologies,
# two of the compiles tests/test_aot.py makes (it compares them with the golden: the test compiles nothing twice).
COMPILE = ["model.num_layers=1", "data.seq_len=32", "data.max_predictions_per_seq=5", "batch_size=16", "eval_every=0"]
MEMORY = {f"gpt1_{topo}": ("configs/gpt1.py:tiny", COMPILE, topo) for topo in ("v5e-16", "h100-8")}
MEMORY_FIELDS = ("arguments", "temporaries", "code", "total")
MEMORY_DRIVER = """
import json, sys
from lm_jax.plan import topology
topology.prepare()
from lm_jax import config_lib
from lm_jax.plan import aot
out = {}
for name, (spec, flags, topo) in json.loads(sys.argv[1]).items():
  lay, train, evaluate = aot.compile_steps(config_lib.load(spec, flags), topology.get(topo))
  out[name] = aot.report(lay, topology.get(topo), train, evaluate, 0.4)["memory_per_device"]
import flax, jax, jaxlib, optax
print("RESULT" + json.dumps({"versions": {m.__name__: m.__version__ for m in (jax, jaxlib, flax, optax)}, "memory": out}))
"""


def write_inputs(out: pathlib.Path, data: pathlib.Path):
  """The toy instruction / preference files of lm_jax.data.toy_tasks, their text as a prompt file, one tokenizer
  (family gpt) for them, and the first 100 kB of Tiny Shakespeare (its tokenizers train in a fraction of a second)."""
  from lm_jax import models
  from lm_jax.data import tokenizer as tokenizer_lib, toy_tasks
  toy_tasks.write_toy(str(out), train=200, dev=20, tasks=("reverse",), length=(4, 4))
  lines = [json.loads(line)["text"] for name in sorted(os.listdir(out)) for line in open(out / name)]
  (out / "prompts.txt").write_text("\n".join(lines) + "\n")
  (out / "toy.model").write_bytes(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=64))
  (out / "shakespeare.txt").write_text((data / "tiny_shakespeare" / "input.txt").read_text()[:100_000])


def _placed(fields: dict, places: dict) -> dict:
  def place(value):
    for key, path in places.items():
      value = value.replace(key, str(path)) if isinstance(value, str) else value
    return value
  return {k: place(v) for k, v in fields.items()}


def measure(worker: int, data: pathlib.Path, tmp: pathlib.Path) -> dict:
  """{'versions', 'runs': {group: {name: {config, overrides, devices, metric, losses, eval_loss}}}} of the runs of
  WORKERS[worker], trained here with write_inputs' files in tmp / 'toy' (run with XLA_FLAGS, as spawn does)."""
  import flax
  import jax
  import jaxlib
  import optax
  from lm_jax import config_lib, objectives, train
  from lm_jax.obs import metrics_log
  from lm_jax.rlhf import ppo
  runs = {}
  for group, name in WORKERS[worker]:
    spec, fields = RUNS[name][0], {**SMALL, **RUNS[name][1], **MESHES[group]}
    config = config_lib.load(spec, _placed(fields, {"$DATA": data, "$TOY": tmp / "toy", "$RUNS": tmp / group}))
    objective = objectives.get(config.objective)
    devices = jax.devices() if MESHES[group] else jax.devices()[:1]
    workdir = tmp / group / name
    result = (ppo.train if objective.rollouts else train.train)(config, str(workdir), devices=devices)
    metric = METRIC.get(objective.name, "loss")
    records = metrics_log.read(str(workdir / "metrics.jsonl"))
    runs.setdefault(group, {})[name] = {
        "config": spec, "overrides": fields, "devices": len(devices), "metric": metric,
        "losses": [r[metric] for r in records if metric in r], "eval_loss": (result.get("eval") or {}).get("eval_loss")}
  return {"versions": {m.__name__: m.__version__ for m in (jax, jaxlib, flax, optax)}, "runs": runs}


def measure_all(data: pathlib.Path) -> list:
  """measure() of every worker, side by side: the imports and write_inputs run once, then one forked child per
  worker (before any JAX backend starts, so the fork copies no XLA threads) trains its runs and writes its JSON."""
  from lm_jax import train  # noqa: F401  the imports measure() makes, once for all the children
  from lm_jax.rlhf import ppo  # noqa: F401
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    (tmp / "toy").mkdir()
    write_inputs(tmp / "toy", data)
    children = {}
    for worker in range(len(WORKERS)):
      sys.stdout.flush()   # else the children inherit and print the parent's buffered lines again
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        _child(worker, data, tmp)
      children[pid] = worker
    failed = sorted(children[pid] for pid, status in (os.wait() for _ in children) if status)
    if failed:
      raise RuntimeError(f"golden worker(s) {failed} failed: their tracebacks are above")
    return [json.loads((tmp / f"worker{worker}.json").read_text()) for worker in range(len(WORKERS))]


def _child(worker: int, data: pathlib.Path, tmp: pathlib.Path):
  """A forked worker: measure() into tmp / worker<i>.json, then exits (0, or 1 after printing the traceback) without
  returning into the parent's code."""
  code = 1
  try:
    (tmp / f"worker{worker}.json").write_text(json.dumps(measure(worker, data, tmp)))
    code = 0
  except BaseException:
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn(worker: str, data: pathlib.Path) -> subprocess.Popen:
  """A subprocess measuring every worker's runs ('losses') or 'compile_memory' (under LM_JAX_AOT_PYTHON); its output
  goes to files (a full pipe would stall it while another is read), the last line of stdout RESULT and the JSON."""
  env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
  if worker == "compile_memory":
    env.pop("XLA_FLAGS")
    env.pop("JAX_PLATFORMS")
    cmd = [os.environ["LM_JAX_AOT_PYTHON"], "-c", MEMORY_DRIVER, json.dumps(MEMORY)]
  else:
    cmd = [sys.executable, __file__, "--measure", f"--data={data}"]
  out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True, process_group=0)
  proc.files = out, err
  return proc


def stop(procs: dict):
  """Kills the processes of `start` with their forked workers (each leads its own process group)."""
  for proc in procs.values():
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait(proc: subprocess.Popen, timeout: float = 900) -> dict:
  proc.wait(timeout=timeout)
  out, err = (f.seek(0) or f.read() for f in proc.files)
  if proc.returncode or "RESULT" not in out:
    raise RuntimeError(f"{' '.join(proc.args[:3])} failed ({proc.returncode}):\n{err[-4000:]}")
  return json.loads(out.rsplit("RESULT", 1)[1])


def memory_entries(got: dict) -> dict:
  """{name: {config, overrides, topology, MEMORY_FIELDS in bytes}} of the compile driver's output."""
  return {name: {"config": MEMORY[name][0], "overrides": MEMORY[name][1], "topology": MEMORY[name][2],
                 **{k: m[k] for k in MEMORY_FIELDS}} for name, m in got.get("memory", {}).items()}


def start(data: pathlib.Path, memory: bool = False) -> dict:
  """The loss runs, with the compile driver if `memory`: {'losses' or 'compile_memory': process}."""
  return {worker: spawn(worker, data) for worker in ["losses", *(["compile_memory"] if memory else [])]}


def losses(procs: dict) -> dict:
  """{group: {'versions', 'runs'}} from the loss runs of `start`, in RUNS' order."""
  out = {}
  for got in wait(procs["losses"]):
    for group, runs in got["runs"].items():
      out.setdefault(group, {"versions": got["versions"], "runs": {}})["runs"].update(runs)
  return {group: {**out[group], "runs": {n: out[group]["runs"][n] for n in RUNS if n in out[group]["runs"]}}
          for group in MESHES}


def _commit() -> str:
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
  dirty = subprocess.run(["git", "status", "--porcelain", "--", "lm_jax", "configs"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()
  return head.stdout.strip() + (" with uncommitted changes to lm_jax/ or configs/" if dirty else "")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reason", help="why the goldens move (kept in each file)")
  parser.add_argument("--data", default=os.environ.get("LM_JAX_DATA", str(REPO.parent / "shared" / "data")))
  parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)   # the loss runs, for spawn
  args = parser.parse_args()
  if args.measure:
    print("RESULT" + json.dumps(measure_all(pathlib.Path(args.data))))
    return
  if not args.reason:
    parser.error("--reason is required: say why the goldens move")
  procs = start(pathlib.Path(args.data), memory=bool(os.environ.get("LM_JAX_AOT_PYTHON")))
  header = {"reason": args.reason, "date": datetime.date.today().isoformat(), "commit": _commit()}
  try:
    results = {group: {**got, "xla_flags": XLA_FLAGS} for group, got in losses(procs).items()}
    if "compile_memory" in procs:
      got = wait(procs["compile_memory"])
      results["compile_memory"] = {"versions": got["versions"], "memory": memory_entries(got)}
  finally:
    stop(procs)
  for name, got in results.items():
    doc = {**got.pop("versions"), **header, "runs": {}, "memory": {}, **got}
    (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {HERE / name}.json")
  if "compile_memory" not in results:
    print("LM_JAX_AOT_PYTHON is unset: compile_memory.json kept as it is")


if __name__ == "__main__":
  main()

"""launch/ray_train.py on CPUs: 2 Ray workers x 4 simulated devices against 1 process x 8, and a worker killed with
kill -9 mid-run.

  python bench/ray_recovery.py [--steps=16] [--checkpoint_every=5] [--kill_after=11] [--quick]

Tiny GPT-1 on Tiny Shakespeare ($LM_JAX_DATA/tiny_shakespeare), mesh data=2 fsdp=2 tensor=2, one tokenizer shared by
every run. Runs, on one local Ray cluster (`ray start --head --block`, stopped at the end):
  one        python -m lm_jax.main, 1 process x 8 devices (the reference launch/local.sh is held to)
  ray        launch/ray_train.py --num_workers=2, uninterrupted
  killed     the same, with Ray worker 1 (the actor process) killed with SIGKILL once step --kill_after is logged;
             Ray restarts the group (FailureConfig) and the trainers resume from the last checkpoint
Checks: ray's losses equal one's (|diff| < 1e-5, the multi-host tolerance of tests/test_multihost.py); killed logged
steps 1..N once each, resumed from a checkpoint, in a second worker group, with ray's losses, and the steps it ran
twice (after the checkpoint it resumed from, up to the kill) have bit-identical losses both times.
--quick (tests/test_launch_engines.py) runs only `killed`, on QUICK (1 layer, 2 workers x 2 devices, 8 steps,
checkpoints every 2, the kill after step 5), and checks all but the comparison with `ray`. Prints the wall times:
Ray's start-up and restart are what the engine costs. Exits 1 when a check fails.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# --quick: the smallest run that still has a model step to resume, on 2 x 2 data-parallel devices (compiles fast)
QUICK = {"model.num_layers": 1, "model.vocab_size": 512, "data.seq_len": 32, "mesh.fsdp": 1, "mesh.tensor": 1}


def flags(args, data, tokenizer):
  overrides = {"data.tfds_name": "", "data.files": data, "data.tokenizer": tokenizer, "total_steps": args.steps,
               "checkpoint_every": args.checkpoint_every, "log_every": 1, "eval_every": 0, "batch_size": 8,
               "data.seq_len": 64, "data.shards": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "optimizer.warmup_steps": 0,
               "optimizer.lr": 3e-3, **(QUICK if args.quick else {})}
  return ["--config=configs/gpt1.py:tiny", *(f"--config.{k}={v}" for k, v in overrides.items())]


def losses(workdir) -> dict:
  """{step: loss} of a metrics.jsonl, complete lines only (it may be being written)."""
  path = workdir / "metrics.jsonl"
  records = [json.loads(l) for l in path.read_text().split("\n")[:-1]] if path.exists() else []
  return {r["step"]: r["loss"] for r in records if "loss" in r}


def logged(workdir) -> int:
  """The last step in a metrics.jsonl being written; 0 before the first."""
  return max(losses(workdir), default=0)


def ray_run(workdir, main_flags, env, kill_after=0):
  """launch/ray_train.py with 2 workers; with kill_after, SIGKILL worker 1 once that step is logged. Its output and
  the losses logged before the kill ({} without one).

  Worker 1's trainer is stopped (SIGSTOP) just before, so the kill lands mid-run however fast the steps are: the
  other trainer cannot pass the next collective without it, and the stopped one dies with its worker."""
  cmd = [sys.executable, str(REPO / "launch" / "ray_train.py"), "--num_workers=2", "--max_failures=1", "--",
         f"--workdir={workdir}", *main_flags]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out, killed, restarted, before = [], 0, 0.0, {}
  reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
  reader.start()
  while proc.poll() is None:
    if kill_after and not killed and logged(workdir) >= kill_after:
      pids = re.findall(r"ray_train: worker 1 of 2: pid (\d+), trainer pid (\d+)", "".join(out))
      killed, trainer = map(int, pids[-1])
      os.kill(trainer, signal.SIGSTOP)
      os.kill(killed, signal.SIGKILL)
      killed_at, before = time.time(), losses(workdir)
      print(f"killed Ray worker 1 (pid {killed}) after step {max(before)}", flush=True)
    if killed and not restarted and len(set(re.findall(r"worker 1 of 2: pid (\d+)", "".join(out)))) == 2:
      restarted = time.time() - killed_at
      print(f"the new worker group's trainers started {restarted:.1f} s after the kill", flush=True)
    time.sleep(0.05)
  reader.join()
  text = "".join(out)
  if proc.returncode:
    sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{text[-4000:]}")
  if kill_after and not killed:
    sys.exit(f"the run finished before step {kill_after} was seen; nothing was killed")
  return text, before


def check(name, ok, detail):
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
  return ok


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, help="default 16; --quick: 6")
  p.add_argument("--checkpoint_every", type=int, help="default 5; --quick: 2")
  p.add_argument("--kill_after", type=int, help="kill worker 1 once this step is logged (default 11; --quick: 5)")
  p.add_argument("--quick", action="store_true", help="only the killed run, on the QUICK config")
  args = p.parse_args()
  for name, full, quick in (("steps", 16, 8), ("checkpoint_every", 5, 2), ("kill_after", 11, 5)):
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else full)
  from lm_jax import config_lib, models
  from lm_jax.data import tokenizer as tokenizer_lib
  data = pathlib.Path(os.environ.get("LM_JAX_DATA", REPO.parent / "shared" / "data")) / "tiny_shakespeare/input.txt"
  root = pathlib.Path(tempfile.mkdtemp(prefix="ray_recovery_"))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # One Ray cluster for every run, as small as 2 workers allow: no dashboard, a 100 MB object store (nothing goes
  # through it), no preemption watcher (a local cluster is never drained). The restarted group's trainers compile
  # from the first group's persistent cache.
  env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}", RAY_DEDUP_LOGS="0", RAY_AUTH_MODE="disabled",
             RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", JAX_PLATFORMS="cpu",
             LM_JAX_DEVICES_PER_PROCESS="2" if args.quick else "4", PYTHONPATH=str(REPO))
  env.setdefault("JAX_COMPILATION_CACHE_DIR", str(root / "jax_cache"))
  if args.quick:   # one thread per op: a 1-layer model gains nothing from more, and 2 trainers share the cores
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false".strip()
  start = time.time()
  head = subprocess.Popen([shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "start", "--head",
                           "--block", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                           "--object-store-memory=100000000", "--disable-usage-stats"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ok = True
  try:   # the tokenizer trains while Ray starts
    overrides = {"data.files": str(data), "data.tfds_name": "", **({"model.vocab_size": 512} if args.quick else {})}
    config = config_lib.load("configs/gpt1.py:tiny", overrides)
    tokenizer_lib.load_or_train(config, str(root / "tok"), models.family(config.model))
    main_flags = flags(args, str(data), next((root / "tok").glob("*.model")))
    times = {}
    if not args.quick:
      t = time.time()
      one = subprocess.run([sys.executable, "-m", "lm_jax.main", f"--workdir={root / 'one'}", *main_flags], cwd=REPO,
                           env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8"), capture_output=True,
                           text=True)
      if one.returncode:
        sys.exit(f"the 1-process run exited {one.returncode}:\n{one.stderr[-4000:]}")
      times["one"] = time.time() - t
      t = time.time()
      ray_run(root / "ray", main_flags, env)
      times["ray"] = time.time() - t
    t = time.time()
    out, before = ray_run(root / "killed", main_flags, env, kill_after=args.kill_after)
    times["killed"] = time.time() - t
    got = losses(root / "killed")
    records = [json.loads(l) for l in (root / "killed" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    ok &= check("killed run's steps", steps == list(range(1, args.steps + 1)), f"{steps}")
    resumed = [int(s) for s in re.findall(r"resumed step (\d+) from", out)]
    ok &= check("resumed from a checkpoint", bool(resumed) and resumed[-1] > 0, f"resumed step {resumed}")
    again = [s for s in before if s > (resumed or [0])[-1]]
    ok &= check("steps run again after the restart = before the kill", bool(again) and all(
        got[s] == before[s] for s in again), f"steps {again}: " + ", ".join(f"{before[s]} / {got[s]}" for s in again))
    groups = len(set(re.findall(r"ray_train: worker 0 of 2: pid (\d+)", out)))
    ok &= check("Ray restarted the worker group", groups == 2, f"{groups} worker groups")
    if not args.quick:
      ray_losses, one_losses = losses(root / "ray"), losses(root / "one")
      diff = max(abs(ray_losses[s] - one_losses[s]) for s in one_losses)
      ok &= check("2 Ray workers x 4 devices = 1 process x 8", sorted(ray_losses) == sorted(one_losses) and diff < 1e-5,
                  f"max |loss diff| {diff:.2e} over {len(one_losses)} steps")
      diff = max(abs(loss - ray_losses[s]) for s, loss in got.items())
      ok &= check("killed and restarted = uninterrupted", diff < 1e-5, f"max |loss diff| {diff:.2e}")
    print("wall s: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
          + f" (load average {os.getloadavg()[0]:.1f})")
  finally:
    head.send_signal(signal.SIGTERM)   # --block: stops the cluster it started
    head.wait(timeout=60)
    shutil.rmtree(root, ignore_errors=True)
  print(f"total {time.time() - start:.1f} s")
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()

"""launch/ray_train.py on CPUs: 2 Ray workers x 4 simulated devices against 1 process x 8, and a worker killed with
kill -9 mid-run.

  python bench/ray_recovery.py [--steps=16] [--checkpoint_every=5] [--kill_after=7] [--quick]

Tiny GPT-1 on Tiny Shakespeare ($LM_JAX_DATA/tiny_shakespeare), mesh data=2 fsdp=2 tensor=2, one tokenizer shared by
every run. Runs, on one local Ray cluster (`ray start --head --block`, stopped at the end):
  one        python -m lm_jax.main, 1 process x 8 devices (the reference launch/local.sh is held to)
  ray        launch/ray_train.py --num_workers=2, uninterrupted
  killed     the same, with Ray worker 1 (the actor process) killed with SIGKILL once step --kill_after is logged;
             Ray restarts the group (FailureConfig) and the trainers resume from the last checkpoint
Checks: ray's losses equal one's (|diff| < 1e-5, the multi-host tolerance of tests/test_multihost.py); killed logged
steps 1..N once each, resumed from a checkpoint, in a second worker group, with ray's losses. --quick runs only
`killed` and checks its steps and restart (tests/test_launch_engines.py). Prints the wall times: Ray's start-up and
restart are what the engine costs. Exits 1 when a check fails.
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


def flags(args, data, tokenizer):
  overrides = {"data.tfds_name": "", "data.files": data, "data.tokenizer": tokenizer, "total_steps": args.steps,
               "checkpoint_every": args.checkpoint_every, "log_every": 1, "eval_every": 0, "batch_size": 8,
               "data.seq_len": 64, "data.shards": 2, "mesh.fsdp": 2, "mesh.tensor": 2, "optimizer.warmup_steps": 0,
               "optimizer.lr": 3e-3}
  return ["--config=configs/gpt1.py:tiny", *(f"--config.{k}={v}" for k, v in overrides.items())]


def losses(workdir):
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["step"], r["loss"]) for r in records if "loss" in r]


def logged(workdir) -> int:
  """The last step in a metrics.jsonl being written (complete lines only); 0 before the first."""
  path = workdir / "metrics.jsonl"
  lines = path.read_text().split("\n")[:-1] if path.exists() else []
  return max([json.loads(l).get("step", 0) for l in lines], default=0)


def ray_run(workdir, main_flags, env, kill_after=0):
  """launch/ray_train.py with 2 workers; with kill_after, SIGKILL worker 1 once that step is logged. Its output."""
  cmd = [sys.executable, str(REPO / "launch" / "ray_train.py"), "--num_workers=2", "--max_failures=1", "--",
         f"--workdir={workdir}", *main_flags]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out, killed, restarted = [], 0, 0.0
  reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
  reader.start()
  while proc.poll() is None:
    if kill_after and not killed and logged(workdir) >= kill_after:
      killed, killed_at = int(re.findall(r"ray_train: worker 1 of 2: pid (\d+)", "".join(out))[-1]), time.time()
      os.kill(killed, signal.SIGKILL)
      print(f"killed Ray worker 1 (pid {killed}) after step {logged(workdir)}", flush=True)
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
  return text


def check(name, ok, detail):
  print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
  return ok


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--checkpoint_every", type=int, default=5)
  p.add_argument("--kill_after", type=int, default=7, help="kill worker 1 once this step is logged")
  p.add_argument("--quick", action="store_true", help="only the killed run, its steps and restart")
  args = p.parse_args()
  from lm_jax import config_lib, models
  from lm_jax.data import tokenizer as tokenizer_lib
  data = pathlib.Path(os.environ.get("LM_JAX_DATA", REPO.parent / "shared" / "data")) / "tiny_shakespeare/input.txt"
  root = pathlib.Path(tempfile.mkdtemp(prefix="ray_recovery_"))
  config = config_lib.load("configs/gpt1.py:tiny", {"data.files": str(data), "data.tfds_name": ""})
  tokenizer_lib.load_or_train(config, str(root / "tok"), models.family(config.model))
  main_flags = flags(args, str(data), next((root / "tok").glob("*.model")))
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, RAY_ADDRESS=f"127.0.0.1:{port}", RAY_DEDUP_LOGS="0", RAY_AUTH_MODE="disabled",
             JAX_PLATFORMS="cpu",
             LM_JAX_DEVICES_PER_PROCESS="4", PYTHONPATH=str(REPO))
  start = time.time()
  head = subprocess.Popen([shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "start", "--head",
                           "--block", f"--port={port}", "--num-cpus=4", "--include-dashboard=false"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ok = True
  try:
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
    out = ray_run(root / "killed", main_flags, env, kill_after=args.kill_after)
    times["killed"] = time.time() - t
    got = losses(root / "killed")
    steps = [s for s, _ in got]
    ok &= check("killed run's steps", steps == list(range(1, args.steps + 1)), f"{steps}")
    resumed = re.findall(r"resumed step (\d+) from", out)
    ok &= check("resumed from a checkpoint", bool(resumed) and int(resumed[-1]) > 0, f"resumed step {resumed}")
    groups = len(set(re.findall(r"ray_train: worker 0 of 2: pid (\d+)", out)))
    ok &= check("Ray restarted the worker group", groups == 2, f"{groups} worker groups")
    if not args.quick:
      ray_losses, one_losses = dict(losses(root / "ray")), dict(losses(root / "one"))
      diff = max(abs(ray_losses[s] - one_losses[s]) for s in one_losses)
      ok &= check("2 Ray workers x 4 devices = 1 process x 8", sorted(ray_losses) == sorted(one_losses) and diff < 1e-5,
                  f"max |loss diff| {diff:.2e} over {len(one_losses)} steps")
      diff = max(abs(loss - ray_losses[s]) for s, loss in got)
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

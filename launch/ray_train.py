"""Train lm_jax inside Ray Train's JaxTrainer: one worker per host, and a failed worker restarts the whole group,
which resumes from the run's last checkpoint in --workdir.

  python launch/ray_train.py --topology=v4-32 --max_failures=3 -- --config=configs/t5.py:large --workdir=gs://B/t5
  python launch/ray_train.py --num_workers=2 --gpus_per_worker=8 -- --config=... --workdir=/shared/run
  python launch/ray_train.py --num_workers=2 -- --config=configs/gpt1.py:tiny --workdir=/tmp/run    # CPUs

--topology (a TPU slice name lm_jax.plan.topology knows; launch/slices.py) gives Ray the slice's chip grid and
accelerator type and one worker per host. --gpus_per_worker=N: one worker per node driving N GPUs. Neither: each
worker is a CPU process with LM_JAX_DEVICES_PER_PROCESS (default 4) simulated devices, the multi-host code paths on
one machine as launch/local.sh runs them.

Each worker runs `python -m lm_jax.main ARGS` as its child, killed with the worker, and joins the job through
lm_jax.distributed (LM_JAX_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID, the coordinator on worker 0). Ray's own JAX
set-up would initialise JAX inside its actors, which run the training function in a thread: the trainer's SIGTERM
checkpoint needs the main thread of its own process. A trainer that exits non-zero, or a worker that dies, fails
the group; Ray starts a new one up to --max_failures times. The repo must be at this path on every node (the
workers start there, as relative --config paths need). Connects to the cluster in RAY_ADDRESS, else starts a local
one. Needs `pip install -r requirements-launch.txt`.
"""
import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--topology", default="", help="TPU slice, e.g. v4-32, v5e-256, v6e-16: one worker per host")
  p.add_argument("--num_workers", type=int, default=0, help="workers (default: the slice's hosts, else 1)")
  p.add_argument("--gpus_per_worker", type=int, default=0, help="GPUs each worker drives (one worker per node)")
  p.add_argument("--max_failures", type=int, default=3, help="group restarts after a failure (-1: no limit)")
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:split])
  args.main_args = argv[split + 1:]
  if args.topology and args.gpus_per_worker:
    p.error("--topology (TPU) and --gpus_per_worker are exclusive")
  if args.num_workers < 0 or args.gpus_per_worker < 0:
    p.error("--num_workers and --gpus_per_worker must be >= 0")
  return args


def scaling(args):
  """The ScalingConfig arguments; a TPU slice's worker count must be its hosts."""
  if not args.topology:
    kwargs = dict(num_workers=args.num_workers or 1)
    if args.gpus_per_worker:
      kwargs.update(use_gpu=True, resources_per_worker={"GPU": args.gpus_per_worker})
    return kwargs
  sys.path.insert(0, REPO)
  from launch import slices
  from lm_jax import config_lib
  tpu = slices.get(args.topology)
  if args.num_workers not in (0, tpu.hosts):
    raise config_lib.ConfigError(f"--num_workers={args.num_workers}: a {tpu.name} slice has {tpu.hosts} hosts, one "
                                 "worker each")
  return dict(num_workers=tpu.hosts, use_tpu=True, topology=tpu.grid, accelerator_type=tpu.ray_accelerator,
              resources_per_worker={"TPU": tpu.chips_per_host})


def _die_with_parent():
  """In the child: SIGKILL when the worker that started it dies (Linux prctl PR_SET_PDEATHSIG)."""
  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def worker(config):
  """Ray Train's per-worker function: the trainer as a child process that joins the others through worker 0."""
  import ray.train
  from ray.train.collective import broadcast_from_rank_zero
  context = ray.train.get_context()
  rank, size = context.get_world_rank(), context.get_world_size()
  address = ""
  if rank == 0:
    with socket.socket() as s:
      s.bind(("", 0))
      address = f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"
  path = os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))
  env = dict(os.environ, LM_JAX_COORDINATOR=broadcast_from_rank_zero(address), LM_JAX_NUM_PROCESSES=str(size),
             LM_JAX_PROCESS_ID=str(rank), PYTHONPATH=path)
  if config["cpu"]:
    devices = env.get("LM_JAX_DEVICES_PER_PROCESS", "4")
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
               f"{env.get('XLA_FLAGS', '')}".strip())
  trainer = subprocess.Popen([sys.executable, "-m", "lm_jax.main", *config["argv"]], cwd=config["cwd"], env=env,
                             preexec_fn=_die_with_parent)
  print(f"ray_train: worker {rank} of {size}: pid {os.getpid()}, trainer pid {trainer.pid}", file=sys.stderr,
        flush=True)
  status = trainer.wait()
  if status:
    raise RuntimeError(f"lm_jax.main exited with status {status} on worker {rank}")


def main(argv):
  args = parse_args(argv)
  try:
    kwargs = scaling(args)
  except ValueError as e:  # ConfigError
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.jax import JaxConfig, JaxTrainer
  except ImportError:
    sys.exit('error: launch/ray_train.py needs Ray Train: pip install -r requirements-launch.txt (or "ray[train]")')
  from ray.train.v2.api.exceptions import TrainingFailedError
  try:
    ray.init()
  except ConnectionError as e:
    sys.exit(f"error: launch/ray_train.py: {str(e).splitlines()[-1]}")
  trainer = JaxTrainer(
      worker, train_loop_config={"argv": args.main_args, "cwd": os.getcwd(),
                                 "cpu": not (args.topology or args.gpus_per_worker)},
      jax_config=JaxConfig(use_tpu=False, use_gpu=False),   # the trainers join JAX themselves (docstring)
      scaling_config=ScalingConfig(**kwargs),
      run_config=RunConfig(failure_config=FailureConfig(max_failures=args.max_failures)))
  try:
    trainer.fit()
  except TrainingFailedError as e:
    sys.exit(f"error: launch/ray_train.py: the run failed after {args.max_failures} restarts: "
             f"{str(e).strip().splitlines()[-1]}")


if __name__ == "__main__":
  main(sys.argv[1:])

"""Train lm_jax on a Cloud TPU VM slice with gcloud: create, set up, run, tail logs, stop, delete.

  launch/tpu_vm.sh --name=bert-large --zone=us-central2-b --accelerator-type=v4-32 --spot \\
      --workdir=gs://BUCKET/bert_large up -- --config=configs/bert.py:large

Actions (one or more, run in order):
  create  gcloud compute tpus tpu-vm create (skipped by `up` when the slice is already READY)
  setup   copy the code (git archive of HEAD, or --git=URL[@REV]) to every worker and install a
          Python 3.11 venv with requirements.txt + jax[tpu] (TPU VM images ship an older Python)
  run     start `python -m lm_jax.main --workdir=W ARGS` on every worker in the background
  logs    stream worker 0's log until the run ends; exit with the run's exit status
  stop    SIGTERM the trainer on every worker (it checkpoints, then exits; the slice stays)
  delete  delete the slice
  up      create (unless READY) + setup + run + logs; a preempted spot/preemptible slice is deleted, recreated
          and the same command restarted (the trainer resumes from the last checkpoint in W),
          up to --max-restarts times; --delete-after deletes the slice at the end.
--dry-run prints every command (gcloud and local) instead of running it.
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REMOTE_DIR = "lm_jax"                 # on each worker, relative to $HOME
VENV = "lm_jax_venv"
LOG, RC, PID = "lm_jax_run.log", "lm_jax_run.rc", "lm_jax_run.pid"


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("actions", nargs="+", choices=["create", "setup", "run", "logs", "stop", "delete", "up"])
  p.add_argument("--name", required=True, help="TPU VM name")
  p.add_argument("--zone", required=True)
  p.add_argument("--project", default="", help="default: gcloud's configured project")
  p.add_argument("--accelerator-type", default="v4-8", help="e.g. v4-32, v5p-64, v6e-16")
  p.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU VM runtime image")
  p.add_argument("--spot", action="store_true", help="spot slice (preemptible, no 24 h limit)")
  p.add_argument("--preemptible", action="store_true", help="legacy preemptible slice")
  p.add_argument("--git", default="", help="URL[@REV] to clone on the workers instead of copying HEAD")
  p.add_argument("--python", default="3.11", help="Python version of the workers' venv")
  p.add_argument("--workdir", default="", help="run directory every worker sees: gs://... or a shared mount")
  p.add_argument("--env", action="append", default=[], help="KEY=VALUE exported for the trainer")
  p.add_argument("--max-restarts", type=int, default=20, help="`up`: restarts after preemption")
  p.add_argument("--delete-after", action="store_true", help="`up`: delete the slice when done")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  argv = list(argv)
  main_args = argv[argv.index("--") + 1:] if "--" in argv else []
  args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
  args.main_args = main_args
  if args.spot and args.preemptible:
    p.error("--spot and --preemptible are exclusive")
  if {"run", "up"} & set(args.actions) and not args.workdir.startswith(("gs://", "/")):
    p.error(f"--workdir must be a gs:// path or an absolute path on a filesystem every worker mounts, "
            f"got {args.workdir!r}")
  return args


def _scope(args):
  return [f"--zone={args.zone}"] + ([f"--project={args.project}"] if args.project else [])


def create_cmd(args):
  cmd = ["gcloud", "compute", "tpus", "tpu-vm", "create", args.name, *_scope(args),
         f"--accelerator-type={args.accelerator_type}", f"--version={args.version}"]
  return cmd + (["--spot"] if args.spot else []) + (["--preemptible"] if args.preemptible else [])


def ssh_cmd(args, command, worker="all"):
  return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_scope(args),
          f"--worker={worker}", f"--command={command}"]


def describe_cmd(args):
  return ["gcloud", "compute", "tpus", "tpu-vm", "describe", args.name, *_scope(args), "--format=value(state)"]


def delete_cmd(args):
  return ["gcloud", "compute", "tpus", "tpu-vm", "delete", args.name, *_scope(args), "--quiet"]


def setup_cmds(args):
  """Commands that put the code and a Python env on every worker."""
  if args.git:
    url, _, rev = args.git.partition("@")
    fetch = [ssh_cmd(args, f"rm -rf ~/{REMOTE_DIR} && git clone {shlex.quote(url)} ~/{REMOTE_DIR}"
                     + (f" && git -C ~/{REMOTE_DIR} checkout {shlex.quote(rev)}" if rev else ""))]
  else:
    tarball = f"/tmp/{args.name}-lm_jax.tar.gz"
    fetch = [["git", "-C", REPO, "archive", "--format=tar.gz", "-o", tarball, "HEAD"],
             ["gcloud", "compute", "tpus", "tpu-vm", "scp", tarball, f"{args.name}:~/lm_jax.tar.gz",
              *_scope(args), "--worker=all"],
             ssh_cmd(args, f"rm -rf ~/{REMOTE_DIR} && mkdir ~/{REMOTE_DIR} && tar xzf ~/lm_jax.tar.gz -C ~/{REMOTE_DIR}")]
  uv = "~/.local/bin/uv"
  install = (f"python3 -m pip install --user -q uv && rm -rf ~/{VENV} && {uv} venv -q --python {args.python} ~/{VENV} && "
             f"{uv} pip install -q --python ~/{VENV}/bin/python -r ~/{REMOTE_DIR}/requirements.txt 'jax[tpu]'")
  return fetch + [ssh_cmd(args, install)]


def run_cmd(args):
  """Starts the trainer on every worker, detached so it survives the ssh session."""
  env = " ".join(shlex.quote(e) for e in args.env)
  train = (f"{env + ' ' if env else ''}~/{VENV}/bin/python -m lm_jax.main "
           + shlex.join([f"--workdir={args.workdir}", *args.main_args]))
  job = f"cd ~/{REMOTE_DIR} || exit 1; {train} & echo $! > ~/{PID}; wait $!; echo $? > ~/{RC}"
  return ssh_cmd(args, f"rm -f ~/{RC}; nohup bash -c {shlex.quote(job)} > ~/{LOG} 2>&1 < /dev/null &")


def logs_cmd(args):
  """Streams worker 0's log until the run writes its exit status, then exits with it."""
  return ssh_cmd(args, f"tail -n +1 -F ~/{LOG} & t=$!; while [ ! -f ~/{RC} ]; do sleep 10; done; "
                 f"sleep 2; kill $t; exit $(cat ~/{RC})", worker="0")


def stop_cmd(args):
  return ssh_cmd(args, f"kill -TERM $(cat ~/{PID}) || true")


class Runner:
  """Runs or (dry run) prints commands."""

  def __init__(self, dry_run):
    self.dry_run = dry_run

  def __call__(self, cmd, check=True):
    print("+ " + shlex.join(cmd), flush=True)
    if self.dry_run:
      return 0
    rc = subprocess.call(cmd)
    if check and rc:
      sys.exit(f"tpu_vm: command failed with status {rc}: {shlex.join(cmd)}")
    return rc

  def state(self, args):
    """The slice's state ('READY', 'PREEMPTED', ...), or '' if it does not exist."""
    if self.dry_run:
      return ""
    out = subprocess.run(describe_cmd(args), capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def up(args, sh):
  """create + setup + run + logs, recreating and restarting the slice after preemptions."""
  for attempt in range(args.max_restarts + 1):
    state = sh.state(args)
    if state in ("PREEMPTED", "TERMINATED"):
      print(f"tpu_vm: slice {args.name} is {state}; recreating (restart {attempt})", flush=True)
      sh(delete_cmd(args))
      state = ""
    if state != "READY":
      sh(create_cmd(args))
    for cmd in setup_cmds(args):
      sh(cmd)
    sh(run_cmd(args))
    rc = sh(logs_cmd(args), check=False)
    while rc == 255 and sh.state(args) == "READY":  # ssh dropped, the run goes on: re-attach
      time.sleep(10)
      rc = sh(logs_cmd(args), check=False)
    if rc == 0 or sh.dry_run:
      return 0
    if sh.state(args) == "READY":  # the trainer itself failed: restarting would fail again
      return rc
    time.sleep(30)  # let a preempted slice settle into PREEMPTED
  return 1


def main(argv):
  args = parse_args(argv)
  sh = Runner(args.dry_run)
  rc = 0
  for action in args.actions:
    if action == "create":
      sh(create_cmd(args))
    elif action == "setup":
      for cmd in setup_cmds(args):
        sh(cmd)
    elif action == "run":
      sh(run_cmd(args))
    elif action == "logs":
      rc = sh(logs_cmd(args), check=False)
    elif action == "stop":
      sh(stop_cmd(args))
    elif action == "delete":
      sh(delete_cmd(args))
    elif action == "up":
      rc = up(args, sh)
      if args.delete_after:
        sh(delete_cmd(args))
  return rc


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

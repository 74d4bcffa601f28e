"""Check a SkyPilot task file offline and print the script one node runs, before paying for the cluster.

  python launch/sky_task.py launch/sky/gpu_nodes.yaml --env CONFIG=configs/t5.py:large --env WORKDIR=gs://B/run \\
      [--node_rank=1] [--num_nodes=2]

The file is read as `sky launch FILE --env K=V` reads it, by SkyPilot's own parser (a wrong
field, or an env left unset, fails here with SkyPilot's message); the output is a bash script that exports the
task's envs and the SKYPILOT_* variables SkyPilot gives node --node_rank (IPs 10.0.0.1, 10.0.0.2, ...), then runs
the task's `run`. Runs under SkyPilot's venv (README.md): .venv-sky/bin/python launch/sky_task.py ...
"""
import argparse
import shlex
import sys


def script(path: str, envs: list, node_rank: int = 0, num_nodes: int = 0) -> str:
  """The bash that node `node_rank` runs for task file `path` (num_nodes: the file's unless given)."""
  from sky.utils import dag_utils
  task, = dag_utils.load_chain_dag_from_yaml(path, env_overrides=envs).tasks   # `sky launch`'s own reader
  nodes = num_nodes or task.num_nodes
  ips = "\n".join(f"10.0.0.{i + 1}" for i in range(nodes))
  env = {**task.envs, "SKYPILOT_NODE_RANK": str(node_rank), "SKYPILOT_NUM_NODES": str(nodes),
         "SKYPILOT_NODE_IPS": ips}
  return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) + task.run


def main(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("yaml")
  p.add_argument("--env", action="append", default=[], help="KEY=VALUE, as `sky launch --env`")
  p.add_argument("--node_rank", type=int, default=0)
  p.add_argument("--num_nodes", type=int, default=0, help="default: the file's num_nodes")
  args = p.parse_args(argv)
  try:
    import sky  # noqa: F401
  except ImportError:
    sys.exit("error: launch/sky_task.py needs SkyPilot: run it with .venv-sky/bin/python (python -m venv .venv-sky && "
             ".venv-sky/bin/pip install -r requirements-sky.txt)")
  try:
    print(script(args.yaml, [tuple(e.split("=", 1)) for e in args.env], args.node_rank, args.num_nodes))
  except (ValueError, OSError) as e:   # SkyPilot's schema and env errors (exit 2), a missing file (1)
    print(f"error: {args.yaml}: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
    sys.exit(2 if isinstance(e, ValueError) else 1)


if __name__ == "__main__":
  main(sys.argv[1:])

"""A GKE JobSet manifest that trains lm_jax on a TPU slice node pool: one pod per host, every pod running
`python -m lm_jax.main`; JobSet recreates all of them when one fails (a preempted spot node included), and the run
resumes from its last checkpoint in --workdir.

  python launch/gke_jobset.py --topology=v5e-256 --image=us-docker.pkg.dev/PROJECT/lm-jax/train:latest \\
      --workdir=gs://BUCKET/run --spot -- --config=configs/t5.py:large | kubectl apply -f -

The pods are an Indexed Job, so GKE gives each its TPU worker id and hostnames, which JAX reads
(lm_jax.distributed, 'tpu'). Needs the JobSet controller on the cluster and a node pool of that slice
(docs/clusters.md); the image holds this repo with requirements.txt and jax[tpu] installed, in its working directory.
"""
import argparse
import os
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launch import slices  # noqa: E402


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--topology", required=True, help="one TPU slice: v4-32, v5e-256, v6e-16, ...")
  p.add_argument("--image", required=True, help="container image with the repo and its requirements")
  p.add_argument("--workdir", required=True, help="gs://BUCKET/RUN: every host writes its checkpoint shards there")
  p.add_argument("--name", default="lm-jax", help="JobSet name (a DNS label)")
  p.add_argument("--spot", action="store_true", help="schedule on spot TPU nodes")
  p.add_argument("--max_restarts", type=int, default=20, help="JobSet restarts of the whole slice after a failure")
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  args = p.parse_args(argv[:split])
  args.main_args = argv[split + 1:]
  if not args.workdir.startswith("gs://"):
    p.error(f"--workdir must be gs://BUCKET/RUN (every pod writes there), got {args.workdir!r}")
  return args


def manifest(args, tpu: slices.Slice) -> dict:
  selector = {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
              "cloud.google.com/gke-tpu-topology": tpu.grid}
  if args.spot:
    selector["cloud.google.com/gke-spot"] = "true"
  container = {"name": "lm-jax", "image": args.image,
               "command": ["python", "-m", "lm_jax.main", f"--workdir={args.workdir}", *args.main_args],
               "ports": [{"containerPort": 8471}, {"containerPort": 8080}],   # TPU runtime, JAX coordinator
               "resources": {"limits": {"google.com/tpu": tpu.chips_per_host}}}
  pod = {"restartPolicy": "Never", "nodeSelector": selector, "containers": [container]}
  job = {"parallelism": tpu.hosts, "completions": tpu.hosts, "completionMode": "Indexed", "backoffLimit": 0,
         "template": {"spec": pod}}
  return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
          "metadata": {"name": args.name,
                       "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
          "spec": {"failurePolicy": {"maxRestarts": args.max_restarts},
                   "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": job}}]}}


def main(argv):
  args = parse_args(argv)
  try:
    tpu = slices.get(args.topology)
  except ValueError as e:   # ConfigError
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  sys.stdout.write(yaml.safe_dump(manifest(args, tpu), sort_keys=False))


if __name__ == "__main__":
  main(sys.argv[1:])

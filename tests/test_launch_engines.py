"""Launching through the engines, without the clusters: SkyPilot task files read by SkyPilot's own parser (in its
venv, LM_JAX_SKY_PYTHON) and their run lines executed as a node runs them, the TPU slice -> workers / accelerator
mapping against Ray's and lm_jax.plan.topology's, the GKE JobSet manifest against its golden, and a missing engine
in one line. Ray Train on CPUs with a worker killed mid-run is bench/ray_recovery.py; its tiny form runs here."""
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import user_env
from lm_jax import distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SKY_FILES = sorted((LAUNCH / "sky").glob("*.yaml"))
sys.path.insert(0, str(REPO))
from launch import gke_jobset, ray_train, slices  # noqa: E402


# --- launch/sky/*.yaml ---------------------------------------------------------------------------------------------

def _documented_envs(name: str) -> list:
  """The --env pairs of docs/clusters.md's command for launch/sky/<name>."""
  text = (REPO / "docs" / "clusters.md").read_text().replace("\\\n", " ")
  line = next(l for l in text.splitlines() if f"launch/sky/{name}" in l and l.lstrip().startswith("sky "))
  words = shlex.split(line)
  return [tuple(words[i + 1].split("=", 1)) for i, w in enumerate(words) if w == "--env"]


def _node(script: str, home: pathlib.Path, **popen):
  """Runs a node's script with a fake ~/lm_jax_venv/bin/python that records its argv and lm_jax.distributed's env."""
  fake = home / "lm_jax_venv" / "bin" / "python"
  fake.parent.mkdir(parents=True, exist_ok=True)
  fake.write_text('#!/usr/bin/env bash\ntrap \'echo saved > "$HOME/saved"; exit 0\' TERM\n'
                  'env | grep ^LM_JAX_ | sort > "$HOME/env"\nprintf "%s\\n" "$@" > "$HOME/argv"\n'
                  'for i in $(seq ${STEPS:-1}); do sleep 0.05; done\n')
  fake.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if not k.startswith("LM_JAX_")}
  return subprocess.Popen(["bash", "-c", script], cwd=REPO, env=dict(env, HOME=str(home), **popen.pop("env", {})),
                          **popen)


SKY_PYTHON = os.environ.get("LM_JAX_SKY_PYTHON", "")
needs_sky = pytest.mark.skipif(not SKY_PYTHON, reason="LM_JAX_SKY_PYTHON (the .venv-sky interpreter, README.md's "
                               "Install: requirements-sky.txt) is not set")
# Under SkyPilot's venv: each file read bare by sky.Task.from_yaml (its error, or "loaded"), then read as `sky launch
# --env` reads it and turned into the script one node runs (launch/sky_task.py).
SKY_READER = """import json, sys
sys.path.insert(0, sys.argv[1])
import sky
from launch import sky_task
out = {}
for path, envs, rank, nodes in json.loads(sys.argv[2]):
  try:
    sky.Task.from_yaml(path)
    bare = "loaded"
  except ValueError as e:
    bare = str(e)
  out[path] = [bare, sky_task.script(path, envs, rank, nodes)]
print(json.dumps(out))
"""


def _node_args(path: pathlib.Path) -> tuple:
  """(envs, node rank, nodes) as docs/clusters.md launches the file: node 1 of 2 for the GPU nodes."""
  nodes = 2 if path.name == "gpu_nodes.yaml" else 0
  return _documented_envs(path.name), 1 if nodes else 0, nodes


@pytest.fixture(scope="module")
def sky_read():
  """{file name: (bare from_yaml's error, node script)} for every launch/sky file, from one SkyPilot process."""
  jobs = [(str(p), *_node_args(p)) for p in SKY_FILES]
  run = subprocess.run([SKY_PYTHON, "-c", SKY_READER, str(REPO), json.dumps(jobs)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-3000:]
  return {pathlib.Path(k).name: v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


@needs_sky
def test_every_sky_file_is_documented_and_refused_without_its_envs(sky_read):
  assert set(sky_read) == {"tpu_pod.yaml", "gpu_nodes.yaml", "spot_job.yaml", "sweep_worker.yaml"}
  for name, (bare, _) in sky_read.items():
    assert _documented_envs(name), name
    assert "Environment variable 'CONFIG' is None" in bare, (name, bare)   # CONFIG, WORKDIR (ROOT): no default


@needs_sky
def test_sky_task_refuses_a_missing_env_in_one_line():
  run = subprocess.run([SKY_PYTHON, "launch/sky_task.py", "launch/sky/gpu_nodes.yaml", "--env", "CONFIG=c.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
  assert run.stderr.startswith("error: launch/sky/gpu_nodes.yaml: Environment variable 'WORKDIR' is None"), run.stderr


@needs_sky
@pytest.mark.parametrize("path", SKY_FILES, ids=lambda p: p.name)
def test_sky_run_line_starts_lm_jax_with_the_documented_flags(tmp_path, path, sky_read):
  envs = dict(_documented_envs(path.name))
  assert _node(sky_read[path.name][1], tmp_path).wait(timeout=30) == 0
  argv = (tmp_path / "argv").read_text().splitlines()
  if path.name == "sweep_worker.yaml":
    assert argv == ["-m", "lm_jax.sweep", "run", f"--config={envs['CONFIG']}", f"--root={envs['ROOT']}",
                    *shlex.split(envs["ARGS"])]
    return
  assert argv == ["-m", "lm_jax.main", f"--config={envs['CONFIG']}", f"--workdir={envs['WORKDIR']}",
                  *shlex.split(envs["ARGS"])]
  assert envs["WORKDIR"].startswith("gs://")
  env = dict(l.split("=", 1) for l in (tmp_path / "env").read_text().splitlines())
  if path.name == "gpu_nodes.yaml":   # node 1 of 2 joins node 0 through lm_jax.distributed's 'local' launcher
    assert env == {"LM_JAX_COORDINATOR": "10.0.0.1:8476", "LM_JAX_NUM_PROCESSES": "2", "LM_JAX_PROCESS_ID": "1"}
    old = {k: os.environ.pop(k, None) for k in env}
    try:
      os.environ.update(env)
      assert distributed.launcher() == "local"
    finally:
      for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
  else:   # a TPU slice: JAX finds the other hosts itself
    assert env == {}


@needs_sky
def test_sky_spot_job_exits_143_after_the_trainer_saves_on_sigterm(tmp_path, sky_read):
  """A preemption notice: the trainer checkpoints and exits 0; the job must not count as finished."""
  node = _node(sky_read["spot_job.yaml"][1], tmp_path, env={"STEPS": "400"})
  deadline = time.time() + 20
  while not (tmp_path / "argv").exists() and time.time() < deadline:
    time.sleep(0.05)
  node.send_signal(signal.SIGTERM)
  assert node.wait(timeout=20) == 143
  assert (tmp_path / "saved").read_text() == "saved\n"


# --- TPU slices: launch/slices.py, Ray, lm_jax.plan.topology -------------------------------------------------------

NAMES = ("v4-32", "v5e-256", "v6e-16")
EXPECTED = {"v4-32": ("2x2x4", 4, 4), "v5e-256": ("16x16", 64, 4), "v6e-16": ("4x4", 4, 4)}  # Cloud TPU docs


@pytest.mark.parametrize("name", NAMES)
def test_slice_workers_and_accelerator_agree_with_ray(name):
  pytest.importorskip("ray", reason="Ray: pip install -r requirements-launch.txt")
  from ray.train import ScalingConfig
  from ray.util.tpu import get_tpu_worker_resources
  tpu = slices.get(name)
  assert (tpu.grid, tpu.hosts, tpu.chips_per_host) == EXPECTED[name]
  kwargs = ray_train.scaling(ray_train.parse_args([f"--topology={name}"]))
  assert get_tpu_worker_resources(kwargs["topology"], kwargs["accelerator_type"]) == \
      (kwargs["num_workers"], {"CPU": 1, "TPU": kwargs["resources_per_worker"]["TPU"]})
  ScalingConfig(**kwargs)   # Ray's own validation of the topology, accelerator and worker count


def test_slice_hosts_agree_with_lm_jax_plan_topology():
  """lm_jax.plan.topology builds the slices' devices with libtpu (the --mode=compile environment)."""
  python = os.environ.get("LM_JAX_AOT_PYTHON")
  if not python:
    pytest.skip("LM_JAX_AOT_PYTHON (the requirements-aot.txt venv) is not set")
  code = ("import json; from lm_jax.plan import topology\n"
          f"tops = {{n: topology.get(n) for n in {NAMES!r}}}\n"
          "print(json.dumps({n: [t.hosts, len(t.devices)] for n, t in tops.items()}))")
  run = subprocess.run([python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=user_env(PYTHONPATH=str(REPO)))
  assert run.returncode == 0, run.stderr[-2000:]
  devices = json.loads(run.stdout.strip().splitlines()[-1])
  for name in NAMES:
    tpu = slices.get(name)
    assert devices[name] == [tpu.hosts, tpu.chips], name   # one device per chip (v4's megacore)


def test_ray_train_refuses_a_wrong_slice_before_starting_ray(capsys):
  for flags, message in ((["--topology=v4-32", "--num_workers=3"], "a v4-32 slice has 4 hosts, one worker each"),
                         (["--topology=2xv5e-256"], "one TPU slice is needed here"),
                         (["--topology=h100-8"], "one TPU slice is needed here")):
    with pytest.raises(SystemExit) as exit_:
      ray_train.main([*flags, "--", "--config=c.py"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("script,module,install", [("ray_train.py", "ray", "pip install -r requirements-launch.txt"),
                                                   ("sky_task.py", "sky", ".venv-sky/bin/python")])
def test_a_missing_engine_is_one_line(script, module, install):
  code = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = ['{script}', 'launch/sky/tpu_pod.yaml']; "
          f"runpy.run_path({str(LAUNCH / script)!r}, run_name='__main__')")
  if script == "ray_train.py":
    code = code.replace("'launch/sky/tpu_pod.yaml'", "'--num_workers=2', '--', '--config=c.py'")
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
  assert install in run.stderr


# --- GKE JobSet -------------------------------------------------------------------------------------------------------

def test_gke_jobset_matches_its_golden(capsys):
  args = ["--topology=v4-32", "--image=us-docker.pkg.dev/PROJECT/lm-jax/train:latest", "--workdir=gs://BUCKET/t5_large",
          "--spot", "--", "--config=configs/t5.py:large", "--config.mesh.fsdp=16"]
  gke_jobset.main(args)
  golden = REPO / "tests" / "goldens" / "gke_jobset_v4-32.yaml"
  assert capsys.readouterr().out == golden.read_text(), \
      f"regenerate: python launch/gke_jobset.py {shlex.join(args)} > {golden}"
  tpu = slices.get("v4-32")
  manifest = gke_jobset.manifest(gke_jobset.parse_args(args), tpu)
  job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == tpu.hosts
  assert re.fullmatch(r"\d+x\d+x\d+", job["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"])


# --- Ray Train on CPUs (bench/ray_recovery.py) ------------------------------------------------------------------------

def test_ray_worker_killed_with_sigkill_restarts_the_group_and_resumes(shared_data):
  pytest.importorskip("ray", reason="Ray: pip install -r requirements-launch.txt")
  run = subprocess.run([sys.executable, str(REPO / "bench" / "ray_recovery.py"), "--quick"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert run.stdout.count("ok  ") == 4 and "FAIL" not in run.stdout, run.stdout

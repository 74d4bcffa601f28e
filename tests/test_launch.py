"""Launchers without the clusters: TPU VM dry runs, the SLURM script under fake srun/scontrol,
launch/local.sh's failure handling, launcher detection, and the memory estimate."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import user_env
from lm_jax import config_lib, distributed

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"


def _script(path: pathlib.Path, text: str) -> pathlib.Path:
  path.write_text("#!/usr/bin/env bash\n" + text)
  path.chmod(0o755)
  return path


# --- launch/tpu_vm.sh ------------------------------------------------------------------------------

def _tpu(*args, check=True):
  out = subprocess.run([str(LAUNCH / "tpu_vm.sh"), "--dry-run", *args], capture_output=True, text=True)
  if check:
    assert out.returncode == 0, out.stderr
  return out


def test_tpu_vm_dry_run_prints_the_whole_lifecycle():
  out = _tpu("--name=bert-l", "--zone=us-central2-b", "--project=proj", "--accelerator-type=v4-32", "--spot",
             "--workdir=gs://bucket/bert_large", "up", "--delete-after", "--",
             "--config=configs/bert.py:large", "--config.batch_size=512")
  lines = [l[2:] for l in out.stdout.splitlines() if l.startswith("+ ")]
  scope = "--zone=us-central2-b --project=proj"
  assert lines[0] == (f"gcloud compute tpus tpu-vm create bert-l {scope} --accelerator-type=v4-32 "
                      "--version=tpu-ubuntu2204-base --spot")
  assert lines[1] == f"git -C {REPO} archive --format=tar.gz -o /tmp/bert-l-lm_jax.tar.gz HEAD"
  assert lines[2] == (f"gcloud compute tpus tpu-vm scp /tmp/bert-l-lm_jax.tar.gz 'bert-l:~/lm_jax.tar.gz' "
                      f"{scope} --worker=all")
  ssh_all = f"gcloud compute tpus tpu-vm ssh bert-l {scope} --worker=all '--command="
  assert lines[3].startswith(ssh_all) and "tar xzf ~/lm_jax.tar.gz -C ~/lm_jax" in lines[3]
  assert lines[4].startswith(ssh_all) and "-r ~/lm_jax/requirements.txt" in lines[4] and "jax[tpu]" in lines[4]
  assert lines[5].startswith(ssh_all) and "nohup" in lines[5]
  assert ("~/lm_jax_venv/bin/python -m lm_jax.main --workdir=gs://bucket/bert_large "
          "--config=configs/bert.py:large --config.batch_size=512") in lines[5]
  assert lines[6].startswith(f"gcloud compute tpus tpu-vm ssh bert-l {scope} --worker=0 '--command=tail")
  assert lines[7] == f"gcloud compute tpus tpu-vm delete bert-l {scope} --quiet"
  assert len(lines) == 8


def test_tpu_vm_git_checkout_preemptible_stop_and_bad_workdir():
  out = _tpu("--name=t", "--zone=z", "--preemptible", "--git=https://example.com/lm_jax.git@v1", "create", "setup",
             "stop")
  lines = [l[2:] for l in out.stdout.splitlines()]
  assert lines[0].endswith("--version=tpu-ubuntu2204-base --preemptible")
  assert "git clone https://example.com/lm_jax.git ~/lm_jax && git -C ~/lm_jax checkout v1" in lines[1]
  assert not any("scp" in l for l in lines)
  assert lines[-1] == "gcloud compute tpus tpu-vm ssh t --zone=z --worker=all '--command=kill -TERM $(cat ~/lm_jax_run.pid) || true'"
  bad = _tpu("--name=t", "--zone=z", "--workdir=runs/x", "run", check=False)
  assert bad.returncode != 0 and "--workdir must be a gs:// path or an absolute path" in bad.stderr


def test_tpu_vm_remote_run_and_logs_propagate_the_exit_status(tmp_path):
  """Runs the exact remote `run` and `logs` commands in a local shell, with a fake venv python."""
  sys.path.insert(0, str(LAUNCH))
  import tpu_vm
  sys.path.pop(0)
  home = tmp_path
  (home / "lm_jax").mkdir()
  (home / "lm_jax_venv" / "bin").mkdir(parents=True)
  _script(home / "lm_jax_venv" / "bin" / "python", 'echo "cwd=$PWD FOO=$FOO args=$*"; exit 7\n')
  args = tpu_vm.parse_args(["--name=t", "--zone=z", "--env=FOO=1", "--workdir=gs://b/r", "run", "--", "--config=c.py"])
  remote = lambda cmd: cmd[-1].split("=", 1)[1]
  env = dict(os.environ, HOME=str(home))
  subprocess.run(["bash", "-c", remote(tpu_vm.run_cmd(args))], env=env, check=True, timeout=10)
  deadline = time.time() + 10
  while not (home / "lm_jax_run.rc").exists() and time.time() < deadline:  # skip logs' 10 s poll
    time.sleep(0.05)
  logs = subprocess.run(["bash", "-c", remote(tpu_vm.logs_cmd(args))], env=env, capture_output=True, text=True,
                        timeout=30)
  assert logs.returncode == 7
  assert f"cwd={home}/lm_jax FOO=1 args=-m lm_jax.main --workdir=gs://b/r --config=c.py" in logs.stdout


# --- launch/slurm.sbatch -------------------------------------------------------------------------

def test_slurm_sbatch_parses_and_requests_requeue_signal_and_srun():
  path = LAUNCH / "slurm.sbatch"
  subprocess.run(["bash", "-n", str(path)], check=True)
  text = path.read_text()
  for needed in ("#SBATCH --requeue", "#SBATCH --signal=B:TERM@", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --ntasks-per-node=8", "srun --kill-on-bad-exit=1", "-m lm_jax.main \"$@\"",
                 "scontrol requeue", "XLA_PYTHON_CLIENT_MEM_FRACTION", "--xla_gpu_enable_latency_hiding_scheduler=true"):
    assert needed in text, needed


@pytest.fixture
def fake_slurm(tmp_path):
  """PATH with a pass-through srun, a recording scontrol, and a trainer that checkpoints on SIGTERM."""
  bin_ = tmp_path / "bin"
  bin_.mkdir()
  _script(bin_ / "srun", 'while [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
  _script(bin_ / "scontrol", 'echo "$@" >> "$FAKE_OUT/scontrol"\n')
  trainer = _script(bin_ / "trainer", 'trap \'echo saved >> "$FAKE_OUT/trainer"; exit 0\' TERM\n'
                    'echo "$XLA_FLAGS" > "$FAKE_OUT/xla_flags"\necho "$*" >> "$FAKE_OUT/trainer"\n'
                    'for i in $(seq ${STEPS:-100}); do sleep 0.05; done\n')
  env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", PYTHON=str(trainer), FAKE_OUT=str(tmp_path),
             SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="8", XLA_FLAGS="--xla_dump_to=/tmp/x")
  return env, tmp_path


def test_slurm_sigterm_checkpoints_then_requeues(fake_slurm):
  env, out = fake_slurm
  job = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), "--config=c.py", "--workdir=/shared/run"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 10
  while not (out / "trainer").exists() and time.time() < deadline:
    time.sleep(0.05)
  job.send_signal(signal.SIGTERM)
  assert job.wait(timeout=20) == 0, job.stdout.read()
  assert (out / "trainer").read_text().splitlines() == ["-m lm_jax.main --config=c.py --workdir=/shared/run", "saved"]
  assert (out / "scontrol").read_text().strip() == "requeue 42"
  assert (out / "xla_flags").read_text().strip().endswith("--xla_dump_to=/tmp/x")  # user flags kept


def test_slurm_normal_exit_does_not_requeue(fake_slurm):
  env, out = fake_slurm
  env["STEPS"] = "1"
  job = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--workdir=/shared/run"], env=env, timeout=20)
  assert job.returncode == 0 and not (out / "scontrol").exists()
  missing = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--config=c.py"], env=env, capture_output=True)
  assert missing.returncode == 2 and b"--workdir" in missing.stderr


def test_slurm_xla_flags_are_known_to_this_xla(fake_slurm):
  """XLA aborts at startup on an unknown flag: check ours parse (GPU flags are parsed on CPU too)."""
  env, out = fake_slurm
  env["STEPS"] = "1"
  subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "--workdir=/w"], env=env, check=True, timeout=20)
  flags = (out / "xla_flags").read_text().strip().replace("--xla_dump_to=/tmp/x", "")
  check = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(1).block_until_ready()"],
                         env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"), capture_output=True, text=True)
  assert check.returncode == 0, check.stderr[-500:]


# --- launch/local.sh ------------------------------------------------------------------------------

def test_local_sh_fails_fast_when_one_process_fails(tmp_path):
  """Process 1 exits 3 at once; process 0 would run 60 s: the launcher returns 3 and stops it."""
  fake = _script(tmp_path / "python", '[[ $LM_JAX_PROCESS_ID == 1 ]] && sleep 1 && exit 3\n'
                 'echo "$LM_JAX_COORDINATOR $LM_JAX_NUM_PROCESSES $XLA_FLAGS $*"; sleep 60\n')
  env = user_env(PYTHON=str(fake), LM_JAX_LOG_DIR=str(tmp_path / "logs"), LM_JAX_DEVICES_PER_PROCESS="2")
  start = time.time()
  run = subprocess.run([str(LAUNCH / "local.sh"), "2", "--config=c.py"], env=env, capture_output=True, text=True,
                       timeout=30)
  assert run.returncode == 3 and time.time() - start < 20
  assert "process 1 exited with status 3" in run.stderr
  log0 = (tmp_path / "logs" / "process_0.log").read_text()
  assert "127.0.0.1:" in log0 and " 2 --xla_force_host_platform_device_count=2 -m lm_jax.main --config=c.py" in log0


# --- lm_jax.distributed ---------------------------------------------------------------------------

@pytest.mark.parametrize("env,kind", [
    ({}, ""),
    ({"LM_JAX_NUM_PROCESSES": "1", "LM_JAX_COORDINATOR": "h:1", "LM_JAX_PROCESS_ID": "0"}, ""),
    ({"LM_JAX_NUM_PROCESSES": "2", "LM_JAX_COORDINATOR": "h:1", "LM_JAX_PROCESS_ID": "1"}, "local"),
    ({"SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "n[1-2]"}, "slurm"),
    ({"SLURM_NTASKS": "16"}, ""),                      # the batch script itself, outside srun
    ({"SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1"}, ""),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "tpu"),
])
def test_launcher_detection(monkeypatch, env, kind):
  for k in list(os.environ):
    if k.startswith(("SLURM_", "LM_JAX_", "TPU_", "MEGASCALE_")):
      monkeypatch.delenv(k)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setattr(distributed, "_has_tpu_chips", lambda: False)
  assert distributed.launcher() == kind


@pytest.mark.parametrize("devices,found", [
    ([], False),
    ([("0x1ae0", "0x0042"), ("0x10de", "0x005e")], False),  # Google's gVNIC; NVIDIA's vendor with a TPU device id
    ([("0x8086", "0x1237"), ("0x1ae0", "0x005e")], True),   # a TPU v4 chip
    ([("0x1ae0", "0x0063\n")], True),                       # v5e, sysfs's trailing newline
])
def test_tpu_chips_from_pci_ids(tmp_path, devices, found):
  for i, (vendor, device) in enumerate(devices):
    (tmp_path / f"0000:00:0{i}.0").mkdir()
    (tmp_path / f"0000:00:0{i}.0" / "vendor").write_text(vendor)
    (tmp_path / f"0000:00:0{i}.0" / "device").write_text(device)
  (tmp_path / "not_a_device").mkdir()                      # no vendor file: skipped
  assert distributed._has_tpu_chips(str(tmp_path)) is found


@pytest.mark.parametrize("ntasks,nodes,gpus,expected", [
    ("16", "2", "8", None),                          # one task per GPU: JAX binds SLURM_LOCALID
    ("2", "2", "8", list(range(8))),                 # one task per node drives all 8 GPUs
    ("2", "2", "", None),                            # CPU nodes
])
def test_slurm_local_device_ids(monkeypatch, ntasks, nodes, gpus, expected):
  monkeypatch.setenv("SLURM_NTASKS", ntasks)
  monkeypatch.setenv("SLURM_STEP_NUM_NODES", nodes)
  monkeypatch.setenv("SLURM_GPUS_ON_NODE", gpus or "0")
  assert distributed._slurm_local_device_ids() == expected


def test_single_process_is_a_no_op():
  if distributed.launcher():
    pytest.skip(f"running under a {distributed.launcher()} launch")
  assert distributed.maybe_initialize() == ""


# --- lm_jax.plan.memory --------------------------------------------------------------------------------

def _config(name, variant):
  return config_lib.load(f"configs/{name}.py:{variant}")


def test_memory_params_and_adam_state_are_exact_and_split_by_fsdp():
  from lm_jax.plan import memory
  config = _config("gpt1", "gpt1")
  one = memory.estimate(config, mesh=(1, 1, 1))
  assert one.params == 116_534_784 * 4                      # docs/reference.md#parameter-counts, float32
  assert one.grads == one.params
  assert 0 <= one.opt_state - 2 * one.params < 64            # Adam mu + nu, plus int32 step counters
  fsdp = memory.estimate(config, mesh=(1, 8, 1))
  assert one.params / 8 <= fsdp.params < one.params / 8 * 1.01  # all but the (heads, kv) biases split
  assert fsdp.rows == one.rows // 8 and fsdp.activations < one.activations
  config.microbatches = 2
  assert memory.estimate(config, mesh=(1, 8, 1)).grads == 2 * fsdp.grads  # accumulator + microbatch grads


def test_memory_activations_follow_rows_tensor_and_remat():
  from lm_jax.plan import memory
  config = _config("t5", "small")
  config.model.scan_layers = True  # traced once: a fast eval_shape
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  base = memory.estimate(config, mesh=(16, 1, 1))
  assert base.rows == 128 // 16
  config.batch_size = 256
  assert memory.estimate(config, mesh=(16, 1, 1)).activations == 2 * base.activations
  config.batch_size = 128
  tensor = memory.estimate(config, mesh=(8, 1, 2))
  assert tensor.rows == 2 * base.rows and tensor.activations < 2 * base.activations
  config.model.remat_policy = "minimal"
  minimal = memory.estimate(config, mesh=(16, 1, 1)).activations
  config.model.remat_policy = "full"
  full = memory.estimate(config, mesh=(16, 1, 1))
  assert full.activations < minimal < base.activations
  text = str(full)
  assert "mesh data=16 fsdp=1 tensor=1 (16 devices)" in text and "remat=full" in text
  assert f"{full.total / 2**30:9.3f} GiB" in text
  with pytest.raises(ValueError, match="mesh must be 3 positive sizes"):
    memory.estimate(config, mesh=(16, 0, 1))


MEASURE = """
import json
import jax
from flax import linen as nn
from lm_jax import config_lib, layout, sharding, step
out = {}
for name, variant, mesh in (("gpt1", "tiny", (2, 2, 2)), ("t5", "tiny", (1, 4, 2)), ("gpt1", "tiny", (1, 8, 1))):
  config = config_lib.load(f"configs/{name}.py:{variant}")
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  m = sharding.make_mesh(config)
  lay = layout.build(config, m)
  tx, state_sh = lay.tx, lay.state_sharding
  state = step.fresh_state(config, tx, state_sh)
  dev = jax.devices()[0]
  per_device = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                                if s.device == dev)
  out[f"{name}{mesh}"] = [per_device(state["params"]), per_device(state["opt_state"])]
print(json.dumps(out))
"""


def test_memory_matches_a_real_sharded_train_state_on_8_devices():
  """Param and optimizer bytes on device 0 of a state the trainer initialised on 8 simulated devices."""
  from lm_jax.plan import memory
  run = subprocess.run([sys.executable, "-c", MEASURE], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                                XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  assert run.returncode == 0, run.stderr[-2000:]
  measured = __import__("json").loads(run.stdout.strip().splitlines()[-1])
  for name, variant, mesh in (("gpt1", "tiny", (2, 2, 2)), ("t5", "tiny", (1, 4, 2)), ("gpt1", "tiny", (1, 8, 1))):
    est = memory.estimate(_config(name, variant), mesh=mesh)
    assert [est.params, est.opt_state] == measured[f"{name}{mesh}"], (name, mesh)


def test_memory_cli_prints_the_table_for_a_what_if_mesh():
  run = subprocess.run([sys.executable, "-m", "lm_jax.plan.memory", "--config=configs/gpt1.py:tiny", "--devices=16",
                        "--config.mesh.fsdp=4"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)))
  assert run.returncode == 0, run.stderr[-2000:]
  assert "mesh data=4 fsdp=4 tensor=1 (16 devices), 2 rows/device" in run.stdout

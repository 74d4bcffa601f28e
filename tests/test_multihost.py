"""Multi-host training on one machine through the CLI: `launch/local.sh 2` (2 processes x 4 CPU devices, gloo
collectives) against plain 1 process x 8 devices. The data stream does not depend on the number of hosts, so
both log the same losses, and a checkpoint moves between 2 and 1 processes and continues the same run.

Two tiny GPT-1 runs of 10 steps (checkpoints at 6 and 10), then each run's step-6 checkpoint resumed with the
other process count; and two tiny PPO runs of 2 iterations (rollouts sampled on every host, PPO-ptx's stream split
between hosts) that log the same iterations.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE, run_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "--config=configs/gpt1.py:tiny"
OVERRIDES = {"data.tfds_name": "", "total_steps": 10, "checkpoint_every": 6, "log_every": 1, "eval_every": 0,
             "batch_size": 8, "data.seq_len": 64, "data.shards": 2, "mesh.fsdp": 2, "mesh.tensor": 2,
             "optimizer.warmup_steps": 0, "optimizer.lr": 3e-3}
TIMEOUT = 600


def _flags(overrides):
  return [f"--config.{k}={v}" for k, v in overrides.items()]


def _env(devices: int, workdir: pathlib.Path) -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
              LM_JAX_DEVICES_PER_PROCESS=str(devices), LM_JAX_LOG_DIR=str(workdir / "logs"), PYTHONPATH=str(REPO))


def _check(run, workdir):
  logs = "".join(p.read_text()[-3000:] for p in sorted((workdir / "logs").glob("*.log"))) \
      if (workdir / "logs").is_dir() else ""
  assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"
  return run.stdout + run.stderr


def two_processes(workdir, overrides, config=CONFIG):
  run = subprocess.run([str(REPO / "launch" / "local.sh"), "2", config, f"--workdir={workdir}", *_flags(overrides)],
                       cwd=REPO, env=_env(4, workdir), capture_output=True, text=True, timeout=TIMEOUT)
  return _check(run, workdir)


def one_process(workdir, overrides, devices, config=CONFIG):
  run = subprocess.run([sys.executable, "-m", "lm_jax.main", config, f"--workdir={workdir}", *_flags(overrides)],
                       cwd=REPO, env=_env(devices, workdir), capture_output=True, text=True, timeout=TIMEOUT)
  return _check(run, workdir)


def _records(workdir) -> list:
  return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> dict:
  return {r["step"]: r["loss"] for r in _records(workdir) if "loss" in r}


def resume_from_step_6(src, dst):
  """A copy of run `src` that stopped at its step-6 checkpoint."""
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("logs", "tensorboard"))
  shutil.rmtree(dst / "checkpoints" / "10")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data):
  """Workdirs of the 2-process run and the 1-process run (same tokenizer)."""
  from lm_jax import config_lib
  root = tmp_path_factory.mktemp("multihost")
  overrides = dict(OVERRIDES, **{"data.files": str(shared_data / "tiny_shakespeare" / "input.txt")})
  run_tokenizer(config_lib.load("configs/gpt1.py:tiny", {"data.files": overrides["data.files"]}), root / "tok")
  overrides["data.tokenizer"] = str(next((root / "tok").glob("*.model")))
  two_processes(root / "two", overrides)
  one_process(root / "one", overrides, devices=8)
  return root, overrides


def test_two_processes_match_one_process(runs):
  root, _ = runs
  two, one = losses(root / "two"), losses(root / "one")
  assert sorted(two) == list(range(1, 11)) and sorted(one) == list(range(1, 11))
  for s in range(1, 11):
    assert abs(two[s] - one[s]) < 1e-5, (s, two[s], one[s])
  assert two[10] < two[1] - 0.5  # it trained
  assert (root / "two" / "checkpoints" / "6").is_dir() and (root / "two" / "checkpoints" / "10").is_dir()


def test_checkpoint_of_two_processes_resumes_in_one(runs):
  root, overrides = runs
  resume_from_step_6(root / "two", root / "two_then_one")
  out = one_process(root / "two_then_one", overrides, devices=4)  # mesh (1, 2, 2): reshards on restore
  assert "resumed step 6 from" in out   # the data position too, not a fresh data iterator
  got, uninterrupted = losses(root / "two_then_one"), losses(root / "two")
  assert sorted(got) == list(range(1, 11))
  assert all(got[s] == uninterrupted[s] for s in range(1, 7))  # metrics.jsonl cut back to step 6
  for s in range(7, 11):   # the same weights AND the same batches as the run that was not interrupted
    assert abs(got[s] - uninterrupted[s]) < 1e-5, (s, got[s], uninterrupted[s])


def test_checkpoint_of_one_process_resumes_in_two(runs):
  root, overrides = runs
  resume_from_step_6(root / "one", root / "one_then_two")
  out = two_processes(root / "one_then_two", overrides)
  assert "resumed step 6 from" in out
  got, uninterrupted = losses(root / "one_then_two"), losses(root / "one")
  assert sorted(got) == list(range(1, 11))
  for s in range(7, 11):
    assert abs(got[s] - uninterrupted[s]) < 1e-5, (s, got[s], uninterrupted[s])


PPO = "--config=configs/rlhf/ppo.py:tiny"
PPO_OVERRIDES = {"total_steps": 2, "checkpoint_every": 2, "batch_size": 16, "ppo.minibatches": 2, "ppo.epochs": 2,
                 "ppo.prompt_len": 8, "ppo.max_new_tokens": 8, "ppo.ptx_coef": 0.05, "model.num_layers": 1,
                 "data.seq_len": 16, "mesh.fsdp": 2, "mesh.tensor": 2}


def is_timing(key: str) -> bool:
  """A wall-clock field (rollout_s, compile_s, tokens_per_sec, ...): differs between any two runs."""
  return key.endswith(("_s", "_per_sec"))


def test_ppo_on_two_processes_matches_one_process(shared_data, tmp_path):
  """Rollouts are sampled from the same params with the same seed on every host, each host scores and updates its
  part: 2 processes x 4 devices log the iterations of 1 process x 8."""
  from lm_jax import config_lib
  lines = tmp_path / "lines.txt"
  lines.write_text("".join((shared_data / "tiny_shakespeare" / "input.txt").read_text().splitlines(True)[:1000]))
  overrides = dict(PPO_OVERRIDES, **{"data.files": str(lines), "ppo.prompts": str(lines)})
  run_tokenizer(config_lib.load(PPO[len("--config="):], overrides), str(tmp_path / "tok"))
  overrides["data.tokenizer"] = str(next((tmp_path / "tok").glob("*.model")))
  two_processes(tmp_path / "two", overrides, PPO)
  one_process(tmp_path / "one", overrides, 8, PPO)
  two, one = _records(tmp_path / "two"), _records(tmp_path / "one")
  assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2]
  for a, b in zip(two, one):
    assert set(a) == set(b)
    for k in [k for k in a if not is_timing(k)]:
      assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k, a[k], b[k])
  assert (tmp_path / "two" / "checkpoints" / "2").is_dir() and (tmp_path / "two" / "policy" / "checkpoints").is_dir()

"""Each benchmark's tiny form runs to its ratio line, so none rots between the runs that measure (bench/README.md).
data_throughput, nanogpt and checkpoint_stall have their own tests; rlhf_sst2 judges finished runs (test_ppo checks
its statistics)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def bench(*args, timeout=600) -> str:
  p = subprocess.run([sys.executable, *args], cwd="/", capture_output=True, text=True, timeout=timeout,
                     env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
  assert p.returncode == 0, p.stderr[-3000:]
  return p.stdout


def test_qlora_memory():
  out = bench(REPO / "bench" / "qlora_memory.py", "--d_model", "64", "--layers", "2", "--batch", "1",
              "--seq_len", "16")
  assert "QLoRA / LoRA peak:" in out, out


def test_train_step_against_eager_pytorch():
  pytest.importorskip("torch")
  out = bench(REPO / "bench" / "train_step.py", "--quick", "--models", "gpt1_128", "--peers", "eager", "--steps", "1",
              "--warmup", "1", "--matmul_size", "256")
  assert "ours/eager" in out and "ours/roofline" in out, out


def test_decode_against_transformers():
  pytest.importorskip("torch")
  out = bench(REPO / "bench" / "decode.py", "--quick", "--models", "gpt2", "--batches", "1", "--repeats", "1")
  assert "hf/ours" in out and out.count("gpt2 ") >= 3, out


def test_finetune_against_transformers(shared_data, tmp_path):
  """On 64 rows of each SST-2 split: both sides predict every dev and test row, which on the whole splits is most
  of the bench's time."""
  pytest.importorskip("torch")
  for split in ("train", "dev", "test"):
    rows = (shared_data / "sst2" / f"{split}.tsv").read_text().splitlines(keepends=True)[:64]
    (tmp_path / f"{split}.tsv").write_text("".join(rows))
  out = bench(REPO / "bench" / "finetune.py", "--steps", "3", "--log_every", "1", "--set",
              f"task.files={tmp_path}/{{split}}.tsv")
  assert "full: tokens/s ours / peer" in out, out


def test_mup_transfer_as_a_sweep(shared_data, tmp_path):
  """bench/mup_transfer.py's quick grid through lm_jax.sweep: 3 trials (µP at the base width is SP's), the summary,
  and a rerun that starts nothing (the measured grid: bench/README.md)."""
  env = {**os.environ, "LM_JAX_DATA": str(shared_data)}
  root = tmp_path / "sweep"
  args = [sys.executable, REPO / "bench" / "mup_transfer.py", f"--root={root}", "--variant=quick"]
  out = subprocess.run(args, cwd="/", capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "µP: the optimum moves 0 grid step(s)" in out.stdout and "SP: the optimum moves 0" in out.stdout, out.stdout
  assert len(list(root.glob("*/sweep_done.json"))) == 3
  losses = json.loads((root / "mup_transfer.json").read_text())["losses"]
  assert losses["mup"]["16"] == losses["sp"]["16"] and losses["mup"]["32"] != losses["sp"]["32"], losses
  assert all(3.5 < by_lr["-7"] < 4.5 for per_width in losses.values() for by_lr in per_width.values()), losses
  again = subprocess.run(args, cwd="/", capture_output=True, text=True, timeout=600, env=env)
  assert again.returncode == 0 and "nothing to start" in again.stdout, again.stdout + again.stderr[-2000:]


def test_optimizers_against_adamw(shared_data):
  out = bench(REPO / "bench" / "optimizers.py", "--quick", "--only=muon")
  assert "| muon | 10 |" in out and "| adamw_cosine | 10 |" in out, out


def test_nanogpt_grid_tiny(tmp_path):
  """bench/nanogpt.py --shapes=tiny: 2 shapes, 20 steps, ours only (no nanoGPT checkout): the table, and for each
  shape our run's step time and its split (minimal jit of forward+backward, + optimizer, our compiled step)."""
  out = bench(REPO / "bench" / "nanogpt.py", "--shapes=tiny", "--steps=20", "--json", tmp_path / "grid.json")
  rows = json.loads((tmp_path / "grid.json").read_text())
  assert [(r["block_size"], r["batch_size"]) for r in rows] == [(32, 4), (64, 8)], out
  assert all(min(r["ours"], r["fb"], r["opt"], r["step"]) > 0 and "nanogpt" not in r for r in rows), rows
  assert "L x D, heads" in out and "load" in out, out

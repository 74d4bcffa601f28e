"""A hostile user on the command line (issue 30's classes): each case runs `python -m lm_jax.main` as a user would
and checks the exit code, that stderr is one line, and that line's words. One tiny trained workdir is shared."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, cli, flags, user_env


@pytest.fixture(scope="module")
def run(shared_data, tmp_path_factory):
  """(workdir, flags) of a tiny GPT trained 2 steps from the CLI."""
  workdir = tmp_path_factory.mktemp("run")
  common = flags("clm", shared_data, total_steps=2, checkpoint_every=2, log_every=1)
  done = cli(*common, f"--workdir={workdir}")
  assert done.returncode == 0, done.stderr[-2000:]
  return workdir, common


def one_line(result, code: int, *words: str) -> str:
  """The single stderr line of a run that exited with `code`, holding every one of `words`."""
  lines = result.stderr.strip().splitlines()
  assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
  assert all(w in lines[0] for w in words), lines[0]
  return lines[0]


def copy(run, tmp_path):
  workdir, _ = run
  shutil.copytree(workdir, tmp_path / "copy")
  return tmp_path / "copy"


def test_a_damaged_tokenizer_names_the_file_and_the_fix(run, tmp_path):
  workdir = copy(run, tmp_path)
  tokenizer = next(workdir.glob("tokenizer_*.model"))
  tokenizer.write_bytes(tokenizer.read_bytes()[:100])   # truncated
  result = cli(*run[1], f"--workdir={workdir}", "--mode=generate", "--prompt=ROMEO:", "--max_new_tokens=2")
  one_line(result, 1, tokenizer.name, "damaged", "remove it", "data.tokenizer")


@pytest.mark.parametrize("peft_type, field", [("LORA", "lora"), ("IA3", "ia3")])
def test_init_from_an_adapter_says_where_the_adapter_goes(run, tmp_path, peft_type, field):
  adapter = tmp_path / "adapter"
  adapter.mkdir()
  (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": 4}))
  (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 16)
  result = cli(*run[1], f"--workdir={tmp_path / 'new'}", f"--init_from={adapter}")
  one_line(result, 1, "adapter", "base model", "config.init_from", f"config.{field}.init_from")


# --------------------------------------------------------------------------------------------- an export never
# replaces a run: its workdir, its init_from, a folder holding a run, however the path is spelled.
@pytest.mark.parametrize("target", ["init_from", "init_from_via_symlink", "own_workdir_via_dotdot", "holds_a_run",
                                    "inside_checkpoints"])
def test_an_export_never_replaces_a_run(run, tmp_path, target):
  source, finetune = copy(run, tmp_path), tmp_path / "finetune"   # finetune: a run started from source
  (tmp_path / "link").symlink_to(source)
  shutil.copytree(source, tmp_path / "runs" / "deep" / "old")
  workdir, out, guarded = {
      "init_from": (finetune, source, source),
      "init_from_via_symlink": (finetune, tmp_path / "link", source),
      "own_workdir_via_dotdot": (source, tmp_path / "x" / ".." / "copy", source),
      "holds_a_run": (finetune, tmp_path / "runs", tmp_path / "runs" / "deep" / "old"),
      "inside_checkpoints": (source, source / "checkpoints" / "hf", source)}[target]
  before = sorted(p.relative_to(guarded) for p in guarded.rglob("*"))
  init = [f"--init_from={source}"] if workdir == finetune else []
  result = cli(*run[1], f"--workdir={workdir}", *init, "--mode=export", f"--export_dir={out}", "--overwrite")
  one_line(result, 2, f"--export_dir={out}", "choose another --export_dir")
  assert sorted(p.relative_to(guarded) for p in guarded.rglob("*")) == before


def main_with(patch: str, *args):
  """`python -m lm_jax.main *args` after the Python lines `patch` (a fault no test machine has: a full disk)."""
  code = (f"import sys\n{patch}\nfrom absl import app\nfrom lm_jax import config_lib, main\n"
          f"sys.argv = ['lm_jax.main', *{list(map(str, args))!r}]\napp.run(main.main, flags_parser=config_lib.parse_flags)")
  return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_a_full_disk_mid_export_is_one_line_and_leaves_nothing(run, tmp_path):
  full = """
import safetensors
from lm_jax.hf import export
def save_file(tensors, path, **kwargs):   # what safetensors raises when the disk fills mid-file
  open(path, "wb").write(b"partial")
  raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                    '"No space left on device" })')
export.save_file = save_file"""
  out = tmp_path / "out"
  result = main_with(full, *run[1], f"--workdir={run[0]}", "--mode=export", f"--export_dir={out}")
  one_line(result, 1, f"exporting to {out} failed", "No space left on device", "nothing was written")
  assert list(tmp_path.iterdir()) == []


def test_gpt2_exports_name_the_tokenizers_own_end_of_text(shared_data, tmp_path):
  common = [f.replace("gpt1.py", "gpt2.py") for f in flags("clm", shared_data, total_steps=1, checkpoint_every=1)]
  assert cli(*common, f"--workdir={tmp_path / 'run'}").returncode == 0
  result = cli(*common, f"--workdir={tmp_path / 'run'}", "--mode=export", f"--export_dir={tmp_path / 'hf'}")
  assert result.returncode == 0, result.stderr[-2000:]
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  end = json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]
  assert config["bos_token_id"] == config["eos_token_id"] == end < config["vocab_size"]


# ---------------------------------------------------------------------------------- flags of another mode, targets
@pytest.mark.parametrize("args, words", [
    (["--topology=v4-8"], ["--topology", "--mode=compile", "not --mode=train"]),
    (["--plan"], ["--plan", "--mode=compile"]),
    (["--mode=eval", "--export_dir=/tmp/x"], ["--export_dir", "--mode=export", "not --mode=eval"]),
    (["--mode=compile", "--topology=v4-8", "--plan", "--mfu=0"], ["--mfu=0.0", "(0, 1]"]),
    (["--mode=compile", "--topology=v4-8", "--plan", "--plan_fits=0"], ["--plan_fits=0", "at least 1"]),
    (["--mode=compile", "--topology=v4-8", "--plan_fits=2"], ["--plan_fits", "--plan"]),
    (["--mode=compile", "--topology=v9-8"], ["--topology='v9-8' unknown"]),
    (["--mode=compile", "--topology=0xv5e-8"], ["0 slices"]),
    (["--mode=compile", "--topology=v4-12"], ["--topology='v4-12'", "not a slice size"]),
    (["--mode=compile", "--topology=h100-8", "--config.model.attention=splash"], ["splash", "h100-8", "cudnn or xla"]),
    (["--mode=compile", "--topology=v5e-8", "--config.model.attention=cudnn"], ["cudnn", "v5e-8", "splash or xla"]),
], ids=["topology_when_training", "plan_when_training", "export_dir_when_evaluating", "mfu_0", "plan_fits_0",
        "plan_fits_without_plan", "unknown_topology", "zero_slices", "no_such_slice", "splash_on_gpu", "cudnn_on_tpu"])
def test_flags_of_another_mode_or_target_exit_2_writing_nothing(run, tmp_path, args, words):
  result = cli(*run[1], f"--workdir={tmp_path / 'new'}", *args)
  one_line(result, 2, *words)
  assert not (tmp_path / "new").exists()


def test_a_workdir_that_is_a_file_exits_2_naming_it(run, tmp_path):
  (tmp_path / "notes.txt").write_text("mine")
  one_line(cli(*run[1], f"--workdir={tmp_path / 'notes.txt'}"), 2, "--workdir=", "notes.txt is a file")
  assert (tmp_path / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------------- the environment, the start, records
@pytest.mark.parametrize("env, words", [
    ({"WANDB_MODE": "onlin"}, ["WANDB_MODE='onlin'", "online, offline or disabled"]),
    ({"WANDB_MODE": "online"}, ["no W&B API key", "WANDB_API_KEY", "wandb.mode=offline"]),
], ids=["unknown_mode", "online_without_key"])
def test_wandb_settings_are_one_line_before_the_workdir(run, tmp_path, env, words):
  env = {**env, "WANDB_API_KEY": "", "HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
  result = cli(*run[1], f"--workdir={tmp_path / 'new'}", "--config.wandb.project=p", env=env)
  one_line(result, 2, *words)
  assert not (tmp_path / "new").exists()


def test_a_run_that_stops_at_start_leaves_no_workdir(run, tmp_path):
  (tmp_path / "empty.txt").write_text("")
  result = cli(*run[1], f"--workdir={tmp_path / 'new'}", f"--config.data.files={tmp_path / 'empty.txt'}")
  assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert not (tmp_path / "new").exists()


def test_observability_that_cannot_write_never_costs_training(run, tmp_path):
  workdir = tmp_path / "new"
  workdir.mkdir()
  (workdir / "profile").write_text("a file where the profile folder goes")
  (workdir / "tensorboard").write_text("a file where TensorBoard's folder goes")
  result = cli(*run[1], f"--workdir={workdir}", "--config.profile.steps=(1,1)")
  assert result.returncode == 0, result.stderr[-3000:]
  warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 2 and "profile" in warnings[0] + warnings[1] and "TensorBoard" in " ".join(warnings)
  assert (workdir / "checkpoints" / "2").is_dir()


def test_a_torn_middle_line_of_metrics_is_skipped_by_name(run, tmp_path):
  workdir = copy(run, tmp_path)
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  torn = [lines[0], lines[1][:10], *lines[2:]]
  (workdir / "metrics.jsonl").write_text("\n".join(torn) + "\n")
  plot = subprocess.run([sys.executable, "-m", "lm_jax.obs.plot", str(workdir), "--out", str(tmp_path / "c.png")],
                        cwd=REPO, capture_output=True, text=True)
  assert plot.returncode == 0 and "line 2" in plot.stderr, plot.stderr
  result = cli(*run[1], f"--workdir={workdir}", "--config.total_steps=3")
  assert result.returncode == 0 and "line 2" in result.stderr, result.stderr[-2000:]
  kept = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert kept[:len(lines) - 1] == [json.loads(line) for i, line in enumerate(lines) if i != 1]
  assert kept[-1]["step"] == 3


def test_mixture_weights_that_overflow_together_exit_2(run, shared_data, tmp_path):
  text = shared_data / "tiny_shakespeare" / "input.txt"
  mix = tuple(dict(name=n, files=str(text), weight=1e308) for n in ("a", "b"))
  result = cli(*run[1], f"--workdir={tmp_path / 'new'}", "--config.data.files=", f"--config.data.mixture={mix!r}")
  one_line(result, 2, "config.data.mixture weights", "sum to inf", "scale them down")
  assert not (tmp_path / "new").exists()


@pytest.mark.skipif(not os.environ.get("LM_JAX_AOT_PYTHON"), reason="LM_JAX_AOT_PYTHON (the compile venv) unset")
@pytest.mark.parametrize("topology", ["v5e-8", "h100-8"])
def test_compile_starts_quietly_and_errors_stay_one_line(topology):
  python = os.environ["LM_JAX_AOT_PYTHON"]
  compile_ = [python, "-m", "lm_jax.main", "--mode=compile", "--config=configs/gpt1.py:tiny", f"--topology={topology}"]
  done = subprocess.run([*compile_, "--config.model.num_layers=1"], cwd=REPO, capture_output=True, text=True,
                        env=user_env())
  assert done.returncode == 0 and done.stdout.startswith(f"{topology}: 8 x"), done.stderr[-3000:]
  assert done.stderr == ""   # libtpu's and the CUDA plugin's start-up lines, E0000 ... INVALID_ARGUMENT among them
  refused = subprocess.run([*compile_, "--config.model.num_layers=0"], cwd=REPO, capture_output=True, text=True,
                           env=user_env())
  one_line(refused, 2, "num_layers")

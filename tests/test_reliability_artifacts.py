"""What a run leaves behind and where (issue 22's artifact side): exports are atomic, never mixed and of one file
mode; one run per workdir; nothing is written into init_from; read-only modes check for a checkpoint before building
a tokenizer; each mistake ends in one line and the README's exit code (2 flags / config, 1 data / checkpoints /
files)."""
import errno
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys

import jax
import pytest

from lm_jax import checkpoint, checkpoint_export, config_lib, init_from, models, train, workdir_lock
from lm_jax.evals import inference, probe, run_eval
from lm_jax.hf import export
from conftest import REPO, cli, flags, load_config, values

RUN = dict(total_steps=2, log_every=1, eval_every=0, checkpoint_every=2, peak_tflops=1.0)
LORA = {"lora.rank": 2}


@pytest.fixture(scope="module")
def lora_run(shared_data, tmp_path_factory):
  """(config, workdir) of a 2-step tiny GPT-1 LoRA run: an export holds base weights + adapter/."""
  workdir = tmp_path_factory.mktemp("lora")
  config = load_config("clm", shared_data, **RUN, **LORA)
  train.train(config, str(workdir))
  return config, workdir


def _modes(root):
  return {p.relative_to(root).as_posix(): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]}


def _litter(parent, name):
  """Temporary folders an export left beside its target."""
  return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ------------------------------------------------------------------------------------------------------ exports
def test_export_refuses_a_non_empty_dir_and_overwrite_replaces_it_whole(lora_run, tmp_path):
  config, workdir = lora_run
  out = tmp_path / "out"
  with workdir_lock.hold(str(workdir)):   # a read-only mode needs no lock: it exports while a run holds one
    checkpoint_export.export_checkpoint(config, str(workdir), str(out))
  assert (out / "adapter" / "adapter_model.safetensors").is_file()
  modes = _modes(out)
  files = {mode for path, mode in modes.items() if (out / path).is_file()}
  assert len(files) == 1, modes   # model.safetensors used to be 0600 among 0644 files

  with pytest.raises(FileExistsError, match=f"export directory {out} is not empty; pass --overwrite"):
    checkpoint_export.export_checkpoint(config, str(workdir), str(out), merged=True)
  assert _modes(out) == modes
  checkpoint_export.export_checkpoint(config, str(workdir), str(out), merged=True, overwrite=True)
  assert not (out / "adapter").exists()   # the merged weights alone: an old adapter/ would apply twice
  assert {m for p, m in _modes(out).items() if (out / p).is_file()} == files
  assert not _litter(tmp_path, "out")
  with pytest.raises(ValueError, match="would replace the run's own workdir"):
    checkpoint_export.export_checkpoint(config, str(workdir), str(workdir.parent), overwrite=True)


def test_a_full_disk_mid_export_leaves_nothing(lora_run, tmp_path, monkeypatch):
  """No target, no temporary folder; a target being replaced with --overwrite stays as it was."""
  config, workdir = lora_run
  real = export.save_file

  def save_file(tensors, path, **kwargs):
    real(tensors, path, **kwargs)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
  monkeypatch.setattr(export, "save_file", save_file)
  with pytest.raises(OSError, match="No space left"):
    checkpoint_export.export_checkpoint(config, str(workdir), str(tmp_path / "new"))
  assert not (tmp_path / "new").exists() and not _litter(tmp_path, "new")
  (tmp_path / "old").mkdir()
  (tmp_path / "old" / "keep.txt").write_text("x")
  with pytest.raises(OSError, match="No space left"):
    checkpoint_export.export_checkpoint(config, str(workdir), str(tmp_path / "old"), overwrite=True)
  assert [p.name for p in (tmp_path / "old").iterdir()] == ["keep.txt"] and not _litter(tmp_path, "old")


def test_sigterm_mid_export_leaves_nothing(lora_run, shared_data, tmp_path):
  """SIGTERM once the weights are written (it used to leave a 0-byte config.json or a partial directory)."""
  _, workdir = lora_run
  code = f"""
import os, signal
from lm_jax import checkpoint_export, config_lib
from lm_jax.hf import export
real = export.save_file
def save_file(*args, **kwargs):
  real(*args, **kwargs)
  os.kill(os.getpid(), signal.SIGTERM)
export.save_file = save_file
config = config_lib.load("configs/gpt1.py:tiny", {values("clm", shared_data, **RUN, **LORA)!r})
checkpoint_export.export_checkpoint(config, {str(workdir)!r}, {str(tmp_path / "out")!r})
"""
  run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert run.returncode == 128 + signal.SIGTERM, run.stderr[-2000:]
  assert run.stderr.splitlines()[-1] == "error: SIGTERM: export cancelled, nothing written", run.stderr[-2000:]
  assert list(tmp_path.iterdir()) == []


def test_exporting_a_lora_run_without_its_rank_names_the_flag(lora_run, tmp_path):
  config, workdir = lora_run
  plain = load_config("clm", _data(config), **RUN)
  with pytest.raises(ValueError) as error:
    checkpoint_export.export_checkpoint(plain, str(workdir), str(tmp_path / "out"))
  message = str(error.value)
  assert "\n" not in message and "was trained with --config.lora.rank=2" in message, message
  assert "pass the run's config" in message and "new --workdir" not in message


def _data(config):
  """The shared data directory of a tiny config."""
  return type(REPO)(config.data.files).parents[1]


def test_export_before_training_says_there_is_no_checkpoint(shared_data, tmp_path):
  """Before: a tokenizer trained into the empty workdir, then 'no checkpoint'; with a fine-tuning config whose
  init_from lacks the task head, 'num_labels >= 1 ..., got 0'."""
  workdir = tmp_path / "empty"
  with pytest.raises(FileNotFoundError, match=f"no checkpoint in {workdir}/checkpoints; train first"):
    checkpoint_export.export_checkpoint(load_config("clm", shared_data, **RUN), str(workdir), str(tmp_path / "out"))
  assert not workdir.exists() and not (tmp_path / "out").exists()

  pre = _bert_export(shared_data, tmp_path / "pre")
  config = config_lib.load("configs/finetune/bert.py:tiny", {"init_from": str(pre)})
  with pytest.raises(FileNotFoundError) as error:
    checkpoint_export.export_checkpoint(config, str(workdir), str(tmp_path / "out"))
  assert str(error.value).startswith(f"no checkpoint in {workdir}/checkpoints: train first"), error.value
  assert "2-label head" in str(error.value) and not workdir.exists()


def _bert_export(shared_data, path):
  """A tiny pre-trained BERT as a Hugging Face directory (no classifier)."""
  m = load_config("mlm", shared_data).model
  export.save_hf(m, jax.device_get(models.init(m, jax.random.key(0))), str(path))
  return path


# ------------------------------------------------------------------------------------ nothing written elsewhere
@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_init_from_is_never_written(kind, shared_data, tmp_path):
  source = tmp_path / "source"
  if kind == "empty":
    source.mkdir()
  config = load_config("clm", shared_data, **RUN, init_from=str(source))
  for read in (lambda: init_from.resolve(config), lambda: probe.load(str(source)),
               lambda: run_eval.evaluate_checkpoint(config, str(tmp_path / "run"))):
    with pytest.raises(FileNotFoundError, match=f"config.init_from='{source}'"):
      read()
  assert (list(source.iterdir()) == []) if kind == "empty" else not source.exists()


def test_eval_of_an_empty_workdir_is_one_line_before_any_tokenizer(shared_data, tmp_path):
  """Before: a tokenizer trained (or a TFDS download retried) and up to 19 orbax INFO lines, then the error."""
  workdir = tmp_path / "w"
  workdir.mkdir()
  run = cli(*flags("clm", shared_data), f"--workdir={workdir}", "--mode=eval")
  assert run.returncode == 1 and run.stderr.splitlines() == [
      f"error: no checkpoint in {workdir}/checkpoints; train first (--mode=train) or pass --init_from"], run.stderr
  assert list(workdir.iterdir()) == []


# ---------------------------------------------------------------------------------------- one run per workdir
def test_a_second_run_in_a_workdir_is_refused_naming_the_holder(shared_data, tmp_path):
  with workdir_lock.hold(str(tmp_path)):
    with pytest.raises(workdir_lock.WorkdirInUse) as error:
      train.train(load_config("clm", shared_data, **RUN), str(tmp_path))
  assert re.fullmatch(rf"{tmp_path} is in use by the run of pid {os.getpid()} on host \S+ \(started \S+\); wait "
                      r"for it, stop it, or use another --workdir", str(error.value)), error.value
  assert config_lib._exit_code(error.value) == 1
  with workdir_lock.hold(str(tmp_path)):   # released
    pass


def _holder(workdir, then: str) -> subprocess.Popen:
  """A process that takes workdir's lock, prints 'held', then runs `then`."""
  code = (f"from lm_jax import workdir_lock; import os, signal, time\nwith workdir_lock.hold({str(workdir)!r}):\n"
          f"  print('held', flush=True)\n  {then}")
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_the_cli_refuses_a_second_run_and_kill_9_leaves_no_stale_lock(shared_data, tmp_path):
  holder = _holder(tmp_path, "time.sleep(600)")
  try:
    run = cli(*flags("clm", shared_data, **RUN), f"--workdir={tmp_path}")
  finally:
    holder.kill()   # SIGKILL: no cleanup runs
    holder.wait()
  assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
  assert f"is in use by the run of pid {holder.pid} on host " in run.stderr
  assert not (tmp_path / "checkpoints").exists()
  with workdir_lock.hold(str(tmp_path)):   # the killed holder's lock went with it
    pass


# ------------------------------------------------------------------------------------------------ one-line errors
def test_a_full_disk_at_checkpoint_time_exits_1_in_one_line(tmp_path):
  """Before: the right sentence at the end of ~150 lines of traceback (an OSError without a file name)."""
  mngr = checkpoint.manager(str(tmp_path), 1)
  with pytest.raises(OSError) as error:
    with checkpoint._save_errors(mngr):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  mngr.close()
  assert str(error.value).endswith("No space left on device; no checkpoint was completed")
  assert config_lib._exit_code(error.value) == 1


def test_prompts_files(tmp_path):
  empty, binary, blank = tmp_path / "empty.txt", tmp_path / "binary.txt", tmp_path / "blank.txt"
  empty.write_text("")
  blank.write_text("\n  \n")
  binary.write_bytes(b"ROMEO\xff\xfe\x00:\n")
  for path in (empty, blank):
    with pytest.raises(ValueError, match=f"--prompts_file={path} is empty"):
      inference.read_prompts([], str(path))
  with pytest.raises(ValueError, match=f"--prompts_file={binary}: not UTF-8 text \\(byte 5"):
    inference.read_prompts(["x"], str(binary))
  with pytest.raises(config_lib.ConfigError, match="give at least one --prompt"):
    inference.read_prompts([], None)


@pytest.mark.parametrize("given, options, message", [
    ({"temperature"}, dict(method="greedy", temperature=-1.0), "--temperature applies to --method=sample, not "
     "--method=greedy"),
    ({"top_p", "top_k"}, dict(method="beam", top_p=7.0, top_k=-2), "--top_k applies to --method=sample, not --method=beam"),
    ({"num_beams"}, dict(method="sample", num_beams=2), "--num_beams applies to --method=beam, not --method=sample"),
    ({"top_p"}, dict(method="sample", top_p=7.0), "--top_p must be in (0, 1], got 7.0"),
    ({"temperature"}, dict(method="sample", temperature=0.0), "--temperature must be > 0, got 0.0"),
    ({"max_new_tokens"}, dict(method="greedy", max_new_tokens=0), "--max_new_tokens must be >= 1, got 0"),
])
def test_generate_flags_of_another_method_or_out_of_range(given, options, message):
  with pytest.raises(config_lib.ConfigError) as error:
    inference.check_generate_flags(given, **options)
  assert str(error.value) == message


def test_generate_flag_errors_exit_2_before_reading_a_model(shared_data, tmp_path):
  run = cli(*flags("clm", shared_data), f"--workdir={tmp_path}", "--mode=generate", "--prompt=ROMEO:",
            "--temperature=-1")
  assert run.returncode == 2 and run.stderr.splitlines() == [
      "error: --temperature applies to --method=sample, not --method=greedy"], run.stderr


def test_docs_template_example_gives_newlines():
  """docs/rlhf.md's --config.rlhf.template example, as a shell passes it, is 'Human: {prompt}<2 newlines>Assistant:'
  (it used to reach the run as a backslash and an n)."""
  text = (REPO / "docs" / "rlhf.md").read_text()
  flag = re.search(r"`(--config\.rlhf\.template=[^`]+)`", text).group(1)
  argv = subprocess.run(["bash", "-c", f"printf '%s\\0' {flag}"], capture_output=True, text=True, check=True)
  args = argv.stdout.split("\0")[:-1]
  assert len(args) == 1, shlex.join(args)
  config = config_lib.load("configs/rlhf/sft.py", args)
  assert config.rlhf.template == "Human: {prompt}\n\nAssistant:", config.rlhf.template


def test_lm_eval_tasks_without_a_data_directory_exit_in_one_line(monkeypatch):
  """Under lm-eval's command line (before: a 52-line traceback around the cause); in-process a plain exception."""
  pytest.importorskip("lm_eval")
  spec = importlib.util.spec_from_file_location("lm_jax_data", REPO / "configs" / "lm_eval" / "lm_jax_data.py")
  tasks = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tasks)
  monkeypatch.delenv("LM_JAX_DATA", raising=False)
  with pytest.raises(ValueError, match=r"^no data directory"):
    tasks.sst2()
  monkeypatch.setattr(sys, "argv", ["/usr/bin/lm_eval", "--tasks", "lm_jax_sst2"])
  with pytest.raises(SystemExit, match=r"^error: no data directory: pass --metadata="):
    tasks.sst2()
  with pytest.raises(SystemExit, match=r"^error: /nowhere/wikitext-2-raw does not exist"):
    tasks.wikitext2("/nowhere")


def test_zeroshot_flag_errors_exit_2(shared_data, tmp_path):
  run = cli(*flags("clm", shared_data), f"--workdir={tmp_path}", "--mode=zeroshot", "--zeroshot=choice",
            "--threshold=-3")
  assert run.returncode == 2 and run.stderr.splitlines() == [
      "error: --threshold / --threshold_split are for --zeroshot=acceptability, not choice"], run.stderr

"""A hostile user on the command line (issue 30's classes): each case runs `python -m lm_jax.main` as a user would
and checks the exit code, that stderr is one line, and that line's words. One tiny trained workdir is shared."""
import json
import shutil

import pytest

from conftest import cli, flags


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

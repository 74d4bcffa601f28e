"""A hostile user on the command line, issue 44's smaller cases: bad config files, SIGHUP, lm_jax.obs.plot's --out and
records, --mode=compile outside .venv-aot, an empty --prompt, a profile range outside the run, W&B offline without a
project, two different init_from, a PPO run that fails at start. Each is one line with the right exit code; most fail
before anything is compiled."""
import importlib.util
import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli, flags
from test_hostile import one_line

CONFIG_FILES = {
    "passwd.txt": ("root:x:0:0:root:/root:/bin/bash\n", "not a Python file"),
    "no_get_config.py": ("x = 1\n", "defines no get_config()"),
    "syntax.py": ("def get_config(:\n  pass\n", "line 1: invalid syntax"),
    "returns_none.py": ("def get_config():\n  return None\n", "returned NoneType, not an ml_collections.ConfigDict"),
}


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, name):
  text, words = CONFIG_FILES[name]
  (tmp_path / name).write_text(text)
  one_line(cli(f"--config={tmp_path / name}", "--mode=summary"), 2, str(tmp_path / name), words)


def _metrics(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_sighup_saves_and_the_run_resumes(shared_data, tmp_path):
  """A closed terminal or ssh session (SIGHUP) saves as SIGTERM does; the resumed run warns that its profile range
  ran before it (config.profile.steps=(1, 1))."""
  workdir = tmp_path / "w"
  common = flags("clm", shared_data, total_steps=400, log_every=1, eval_every=0, checkpoint_every=1000)
  with open(tmp_path / "log", "w") as log:
    run = subprocess.Popen([sys.executable, "-m", "lm_jax.main", *common, f"--workdir={workdir}"], cwd=REPO,
                           stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not ((workdir / "metrics.jsonl").is_file() and _metrics(workdir)) and time.time() < deadline:
      assert run.poll() is None, (tmp_path / "log").read_text()[-3000:]
      time.sleep(0.05)
    run.send_signal(signal.SIGHUP)
    assert run.wait(timeout=300) == 0, (tmp_path / "log").read_text()[-3000:]
  out = (tmp_path / "log").read_text()
  saved = int(out.split("SIGHUP: saved step ")[1].split(",")[0])
  assert saved < 400 and (workdir / "checkpoints" / str(saved)).is_dir() and "Traceback" not in out
  resumed = cli(*common, f"--workdir={workdir}", "--config.profile.steps=(1, 1)")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed step {saved}" in resumed.stdout + resumed.stderr
  assert f"steps 1..1 ran before this run resumed at step {saved}; nothing is profiled" in resumed.stderr
  assert _metrics(workdir)[-1]["step"] == 400 and not (workdir / "profile").exists()


def _plot(tmp_path, out, records=({"step": 1, "loss": 3.0}, {"loss": 2.5}, {"step": 2, "loss": 2.0})):
  workdir = tmp_path / "run"
  workdir.mkdir(exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  return subprocess.run([sys.executable, "-m", "lm_jax.obs.plot", str(workdir), "--out", str(out)], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def test_plot_skips_records_without_a_step_by_name(tmp_path):
  result = _plot(tmp_path, tmp_path / "c.png")
  line = one_line(result, 0, str(tmp_path / "run" / "metrics.jsonl"), "1 record(s) without a numeric step skipped")
  assert line.startswith("warning: ") and result.stdout.strip() == f"wrote {tmp_path / 'c.png'}"


def test_plot_into_a_directory_writes_curves_png_there(tmp_path):
  (tmp_path / "plots").mkdir()
  result = _plot(tmp_path, tmp_path / "plots", [{"step": 1, "loss": 3.0}])
  assert result.returncode == 0 and result.stdout.strip() == f"wrote {tmp_path / 'plots' / 'curves.png'}", result
  assert (tmp_path / "plots" / "curves.png").stat().st_size > 0 and not (tmp_path / "plots.png").exists()


@pytest.mark.parametrize("out, code, words", [
    ("c.foo", 2, ["unknown image format '.foo'", ".png", ".svg"]),
    ("curves", 2, ["no extension", ".png"]),
    ("/proc/c.png", 1, ["cannot write --out=/proc/c.png"]),   # a file system no one writes, root included
])
def test_plot_refuses_an_out_it_cannot_write_in_one_line(tmp_path, out, code, words):
  out = out if out.startswith("/") else str(tmp_path / out)
  one_line(_plot(tmp_path, out, [{"step": 1, "loss": 3.0}]), code, "lm_jax.obs.plot: ", out, *words)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="this Python can compile for TPU")
def test_compile_outside_the_aot_venv_says_which_python(tmp_path):
  result = cli("--config=configs/gpt1.py:tiny", "--mode=compile", "--topology=v4-8")
  one_line(result, 2, "needs libtpu", sys.executable, ".venv-aot/bin/python", "requirements-aot.txt")


def test_an_empty_prompt_names_the_flag(tmp_path):
  result = cli("--config=configs/gpt1.py:tiny", f"--workdir={tmp_path / 'w'}", "--mode=generate", "--prompt=")
  one_line(result, 2, "--prompt is empty; give the text to continue")


@pytest.mark.parametrize("field, value, words", [
    ("profile.steps", "(30, 2)", ["config.profile.steps=(30, 2) starts after the run's last step (total_steps=20)"]),
    ("wandb.mode", "offline", ["config.wandb.mode='offline' without config.wandb.project", "wandb.project=NAME"]),
])
def test_a_setting_the_run_would_ignore_is_refused(shared_data, tmp_path, field, value, words):
  workdir = tmp_path / "w"
  result = cli(*flags("clm", shared_data, total_steps=20), f"--workdir={workdir}", f"--config.{field}={value}")
  one_line(result, 2, *words)
  assert not workdir.exists()


def test_init_from_twice_with_different_values_is_refused(shared_data, tmp_path):
  workdir = tmp_path / "w"
  result = cli(*flags("clm", shared_data), f"--workdir={workdir}", f"--init_from={tmp_path / 'a'}",
               f"--config.init_from={tmp_path / 'b'}")
  one_line(result, 2, f"--init_from={tmp_path / 'a'}", f"--config.init_from={tmp_path / 'b'}", "differ")
  assert not workdir.exists()


def test_ppo_failing_at_start_leaves_no_workdir(shared_data, tmp_path):
  workdir = tmp_path / "ppo"
  result = cli("--config=configs/rlhf/ppo.py:tiny", f"--workdir={workdir}", "--config.ppo.reward_fn=",
               f"--config.ppo.reward_from={tmp_path / 'no_rm'}", env={"LM_JAX_DATA": str(shared_data)})
  one_line(result, 1, f"config.ppo.reward_from={str(tmp_path / 'no_rm')!r}", "not a run's workdir")
  assert not workdir.exists()

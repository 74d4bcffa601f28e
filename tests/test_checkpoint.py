"""Checkpoints: kill -9 and SIGTERM resume to exactly the uninterrupted run; a non-finite loss is never
saved; BERT phase 2 resumes phase 1 with a fresh data iterator; what invalidates an iterator position.
What real runs hit: a damaged newest step falls back to the previous one, a full disk stops the run at once,
a changed optimizer is one line, and --mode=eval prints its result on a workdir it cannot write."""
import asyncio
import errno
import gc
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from lm_jax import checkpoint, optim, train
from lm_jax.obs import metrics_log
from conftest import REPO, cli, flags, load_config, records

STEPS = 150


def _start(workdir, data_dir):
  """The training command in the background; its output goes to workdir.log (a pipe could fill and block)."""
  args = flags("clm", data_dir, total_steps=STEPS, log_every=1, eval_every=50, checkpoint_every=7,
               **{"optimizer.lr": 1e-2})
  log = open(f"{workdir}.log", "a")
  return subprocess.Popen([sys.executable, "-m", "lm_jax.main", *args, f"--workdir={workdir}"], cwd=REPO,
                          stdout=log, stderr=subprocess.STDOUT, text=True)


def _output(proc, workdir, timeout=600):
  """Waits for the process; (return code, its log so far)."""
  proc.wait(timeout=timeout)
  with open(f"{workdir}.log") as f:
    return proc.returncode, f.read()


def _wait_for_step(proc, workdir, step, timeout=600):
  """Blocks until metrics.jsonl has a record at `step` or later; the process must still be running."""
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + timeout
  while time.time() < deadline:
    recs = metrics_log.read(path)
    if recs and recs[-1]["step"] >= step:
      assert proc.poll() is None, "the run finished before it could be interrupted"
      return
    assert proc.poll() is None, _output(proc, workdir)[1][-3000:]
    time.sleep(0.02)
  raise TimeoutError(f"no step {step} in {path}")


def _comparable(workdir):
  return [{k: v for k, v in r.items() if k not in metrics_log.WALL_CLOCK}
          for r in metrics_log.read(os.path.join(workdir, "metrics.jsonl"))]


def _final_params(workdir):
  return ocp.StandardCheckpointer().restore(os.path.join(workdir, "checkpoints", str(STEPS), "state"))["params"]


def test_sigterm_and_kill_resume_exactly(shared_data, tmp_path):
  rng = random.Random()
  term_at, kill_at = rng.randint(3, 40), rng.randint(50, 100)
  uninterrupted, interrupted = tmp_path / "a", tmp_path / "b"
  a = _start(uninterrupted, shared_data)

  b = _start(interrupted, shared_data)
  _wait_for_step(b, interrupted, term_at)
  b.send_signal(signal.SIGTERM)
  code, out = _output(b, interrupted)
  assert code == 0, out[-3000:]
  saved = int(out.split("SIGTERM: saved step ")[1].split(",")[0])
  assert saved >= term_at and (interrupted / "checkpoints" / str(saved)).is_dir()

  b = _start(interrupted, shared_data)
  _wait_for_step(b, interrupted, kill_at)
  b.kill()  # SIGKILL: no chance to save
  b.wait()
  b = _start(interrupted, shared_data)
  code, out = _output(b, interrupted)
  assert code == 0, out[-3000:]
  assert out.count("resumed step") == 2
  code, out = _output(a, uninterrupted)
  assert code == 0, out[-3000:]

  msg = f"SIGTERM at {term_at}, kill -9 at {kill_at}"
  expected = _comparable(uninterrupted)
  assert len(expected) == STEPS + 3  # a record per step, evals at 50, 100, 150
  assert _comparable(interrupted) == expected, msg
  for x, y in zip(jax.tree.leaves(_final_params(uninterrupted)), jax.tree.leaves(_final_params(interrupted))):
    np.testing.assert_array_equal(x, y, err_msg=msg)


def test_ctrl_c_saves_and_exits_as_sigterm_does(shared_data, tmp_path):
  """A first Ctrl-C (SIGINT) saves after the current step and exits 0. Before, the KeyboardInterrupt rose wherever
  the interpreter was; inside JAX's garbage-collection callback it was swallowed and the run went on."""
  workdir = tmp_path / "w"
  run = _start(workdir, shared_data)
  _wait_for_step(run, workdir, 20)
  run.send_signal(signal.SIGINT)
  code, out = _output(run, workdir)
  assert code == 0 and "Traceback" not in out, out[-3000:]
  assert "Ctrl-C: saving after this step" in out
  saved = int(out.split("SIGINT: saved step ")[1].split(",")[0])
  assert 20 <= saved < STEPS and (workdir / "checkpoints" / str(saved)).is_dir()


def test_non_finite_loss_is_never_saved(shared_data, tmp_path, monkeypatch):
  make = train.compile_train_step

  def poisoned(s):
    real = make(s)

    def step(state, batch):
      state, metrics = real(state, batch)
      return state, dict(metrics, loss=jnp.where(state["step"] >= 6, jnp.nan, metrics["loss"]))
    return step
  monkeypatch.setattr(train, "compile_train_step", poisoned)
  config = load_config("clm", shared_data, total_steps=12, log_every=4, eval_every=0, checkpoint_every=2)
  with pytest.raises(FloatingPointError, match="at step 6; not saved. Last good checkpoint: step 4"):
    train.train(config, str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


def test_bert_phase_two_resumes_phase_one(shared_data, tmp_path, capsys):
  phase1 = load_config("mlm", shared_data, total_steps=8, phase_end_step=5, log_every=1, eval_every=0,
                       checkpoint_every=100)
  first = train.train(phase1, str(tmp_path))
  assert first["step"] == 5
  phase2 = load_config("mlm", shared_data, total_steps=8, log_every=1, eval_every=0, checkpoint_every=100,
                       **{"data.seq_len": 64, "data.max_predictions_per_seq": 10})
  second = train.train(phase2, str(tmp_path))
  out = capsys.readouterr().out
  assert "resumed step 5; data config changed (data.max_predictions_per_seq: 5 -> 10; data.seq_len: 32 -> 64)" in out
  assert second["step"] == 8
  recs = metrics_log.read(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7, 8]
  lr = optim.schedule(phase2.optimizer, 8)  # one schedule over both phases
  assert [r["lr"] for r in recs] == pytest.approx([float(lr(s - 1)) for s in range(1, 9)], rel=1e-6)


def test_data_changes(shared_data):
  config = load_config("clm", shared_data)
  saved = checkpoint._plain(config)
  assert checkpoint.data_changes(saved, config) == []
  other = load_config("clm", shared_data, **{"data.eval_batches": 5, "total_steps": 9, "data.seq_len": 64,
                                              "batch_size": 16})
  assert checkpoint.data_changes(saved, other) == ["data.seq_len: 32 -> 64", "batch_size: 8 -> 16"]


# ------------------------------------------------------------------------------------ what real runs hit
SMALL = dict(total_steps=6, log_every=1, eval_every=0, checkpoint_every=3, peak_tflops=1.0)


@pytest.fixture(scope="module")
def small_run(shared_data, tmp_path_factory):
  """A tiny GPT-1 workdir with checkpoints at steps 3 and 6; tests damage copies of it."""
  workdir = tmp_path_factory.mktemp("small")
  train.train(load_config("clm", shared_data, **SMALL), str(workdir))
  return workdir


def _copy(small_run, tmp_path):
  shutil.copytree(small_run, tmp_path / "w")
  return tmp_path / "w"


def _truncate_largest_state_file(step_dir):
  path = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  os.truncate(path, path.stat().st_size // 2)


def _empty_data_state(step_dir):
  (step_dir / "data" / "metadata").write_text("")


@pytest.mark.parametrize("damage, cause", [(_truncate_largest_state_file, "6/state: ValueError: OUT_OF_RANGE"),
                                           (_empty_data_state, "6/data: JSONDecodeError: Expecting value")])
def test_damaged_newest_step_falls_back_to_the_previous_one(damage, cause, small_run, shared_data, tmp_path, capfd):
  workdir = _copy(small_run, tmp_path)
  damage(workdir / "checkpoints" / "6")
  result = train.train(load_config("clm", shared_data, **SMALL), str(workdir))
  out, err = capfd.readouterr()
  warnings = [line for line in err.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 1, err
  assert warnings[0].startswith(f"warning: checkpoint step 6 in {workdir}/checkpoints unreadable ({cause}")
  assert warnings[0].endswith("; falling back to step 3")
  assert "Traceback" not in out + err and "Event loop is closed" not in out + err
  assert "resumed step 3" in out and result["step"] == 6
  assert _comparable(workdir) == _comparable(small_run)  # steps 4-6 trained again, exactly as the first time
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]


def test_a_damaged_step_on_the_console_is_one_warning_line(small_run, shared_data, tmp_path):
  """The command line as a user meets it: orbax's reads abandoned by the failed one each print a 30-line traceback
  when collected (500 lines for this tiny model; under pytest its own hook takes them, so the test above cannot
  see them). Six steps after the fallback give the collector its chance."""
  workdir = _copy(small_run, tmp_path)
  _truncate_largest_state_file(workdir / "checkpoints" / "6")
  p = cli(*flags("clm", shared_data, **{**SMALL, "total_steps": 12}), f"--workdir={workdir}")
  assert p.returncode == 0, p.stderr[-3000:]
  lines = p.stderr.splitlines()
  assert len(lines) == 1, p.stderr[-3000:]
  [warning] = lines
  assert warning.startswith(f"warning: checkpoint step 6 in {workdir}/checkpoints unreadable (6/state: ValueError")
  assert "resumed step 3" in p.stdout and "step 12/12" in p.stdout


def test_no_readable_checkpoint_is_one_line_naming_the_directory(small_run, shared_data, tmp_path):
  workdir = _copy(small_run, tmp_path)
  _empty_data_state(workdir / "checkpoints" / "6")
  _truncate_largest_state_file(workdir / "checkpoints" / "3")
  with pytest.raises(FileNotFoundError) as error:
    train.train(load_config("clm", shared_data, **SMALL), str(workdir))
  message = str(error.value)
  assert "\n" not in message and message.startswith(f"no readable checkpoint in {workdir}/checkpoints (6/data: ")


def test_abandoned_orbax_tasks_print_nothing_when_collected(caplog):
  """orbax's failed read leaves its other reads' asyncio tasks and gathers failed and unretrieved; asyncio logs each
  one's 30-line traceback whenever the collector frees it (a CI run of the CLI test above met it). A failing
  coroutine compiled as an orbax file stands for them: the filter must drop its records, and only its."""
  metrics_log.quiet_libraries()
  source = "async def read():\n  raise ValueError('OUT_OF_RANGE')\n"
  namespaces = []
  for filename in (os.path.join(os.path.dirname(ocp.__file__), "reads.py"), "/elsewhere/reads.py"):
    namespaces.append({})
    exec(compile(source, filename, "exec"), namespaces[-1])

  async def abandon_failed_reads(read):
    asyncio.get_running_loop().create_task(read())
    asyncio.gather(read())
    await asyncio.sleep(0)   # both run and fail; nobody awaits them

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    for namespace in namespaces:
      asyncio.run(abandon_failed_reads(namespace["read"]))
      gc.collect()
  records = [r for r in caplog.records if r.name == "asyncio"]
  assert sorted(r.getMessage().split()[0] for r in records) == ["Task", "_GatheringFuture"]
  assert all(traceback.extract_tb(r.exc_info[2])[-1].filename == "/elsewhere/reads.py" for r in records)


def test_changed_optimizer_on_resume_is_one_line(small_run, shared_data, tmp_path):
  workdir = _copy(small_run, tmp_path)
  config = load_config("clm", shared_data, **SMALL, **{"optimizer.name": "adafactor"})
  with pytest.raises(ValueError) as error:
    train.train(config, str(workdir))
  message = str(error.value)
  assert "\n" not in message, message
  assert message == (f"checkpoint step 6 in {workdir}/checkpoints was saved with optimizer.name='adam_l2' but the "
                     "config has optimizer.name='adafactor': its optimizer state does not fit; resume with the "
                     "checkpoint's optimizer settings or use a new --workdir")


def _fail_json_writes_after(monkeypatch, ok_writes: int):
  """Every JSON item (data state, config) written after the first `ok_writes` fails as on a full disk; the
  write runs in orbax's background commit, where a real full disk also surfaces."""
  real, calls = ocp.JsonCheckpointHandler._save_fn, []

  async def save_fn(self, x, directory):
    calls.append(directory)
    if len(calls) > ok_writes:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await real(self, x, directory)
  monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)


def _check_failed_save(error, directory, kept: list[int]):
  message = str(error.value)
  assert "\n" not in message, message
  assert message == (f"saving a checkpoint in {directory} failed: No space left on device; the last complete "
                     f"checkpoint is step {kept[-1]}")
  assert sorted(p.name for p in directory.iterdir()) == sorted(map(str, kept))  # intact, no temporary folder


def test_full_disk_stops_the_run_at_once(shared_data, tmp_path, monkeypatch):
  make = train.compile_train_step

  def slow(s):  # steps slower than the failing background save: the run must stop at the next one
    real = make(s)
    return lambda state, batch: (time.sleep(0.5), real(state, batch))[1]
  monkeypatch.setattr(train, "compile_train_step", slow)
  _fail_json_writes_after(monkeypatch, 2)  # the save of step 3 succeeds, the one of step 6 fails
  config = load_config("clm", shared_data, **dict(SMALL, total_steps=12, keep_checkpoints=1))
  with pytest.raises(OSError) as error:
    train.train(config, str(tmp_path))
  _check_failed_save(error, tmp_path / "checkpoints", [3])
  assert records(tmp_path)[-1]["step"] < 9  # stopped before the next save, where it used to surface
  state = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "3" / "state")
  assert int(state["step"]) == 3


def _tiny_save(mngr, step, state):
  checkpoint.save(mngr, step, state, {"processes": []}, ml_collections.ConfigDict({"step": step}))


def test_failed_background_save_is_one_line(tmp_path, monkeypatch):
  mngr = checkpoint.manager(str(tmp_path), keep=1)
  state = {"w": jnp.arange(8.0)}
  _tiny_save(mngr, 1, state)
  checkpoint.finish(mngr)
  _fail_json_writes_after(monkeypatch, 0)
  _tiny_save(mngr, 2, state)  # returns at once; the write fails in the background
  deadline = time.time() + 60
  with pytest.raises(OSError) as error:
    while time.time() < deadline:
      checkpoint.check_save(mngr)
      time.sleep(0.01)
  _check_failed_save(error, tmp_path / "checkpoints", [1])


def test_really_full_disk(tmp_path):
  """A 1 MiB tmpfs (needs root and the right to mount): TensorStore's own ENOSPC, not an injected one."""
  disk = tmp_path / "disk"
  disk.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  try:
    mngr = checkpoint.manager(str(disk), keep=10)
    state = {"w": jax.random.normal(jax.random.key(0), (60_000,))}  # 240 kB that do not compress
    with pytest.raises(OSError) as error:
      for step in range(1, 10):
        _tiny_save(mngr, step, state)
        checkpoint.finish(mngr)
    _check_failed_save(error, disk / "checkpoints", list(range(1, step)))
    restored = ocp.StandardCheckpointer().restore(disk / "checkpoints" / str(step - 1) / "state")
    np.testing.assert_array_equal(restored["w"], state["w"])
  finally:
    subprocess.run(["umount", str(disk)], check=True)


def test_eval_prints_its_result_on_a_workdir_it_cannot_write(small_run, shared_data, tmp_path):
  """Read-only for a normal user; as root (who writes anyway) metrics.jsonl is a directory instead."""
  workdir = _copy(small_run, tmp_path)
  if os.geteuid():
    for path in [workdir, *workdir.rglob("*")]:
      path.chmod(path.stat().st_mode & ~0o222)
    reason = "Permission denied"
  else:
    (workdir / "metrics.jsonl").unlink()
    (workdir / "metrics.jsonl").mkdir()
    reason = "Is a directory"
  try:
    run = cli(*flags("clm", shared_data, **SMALL), f"--workdir={workdir}", "--mode=eval")
  finally:
    for path in [workdir, *workdir.rglob("*")]:
      path.chmod(path.stat().st_mode | 0o200)  # so pytest can clean up
  assert run.returncode == 0, run.stderr[-3000:]
  assert "step 6/6 | eval_accuracy" in run.stdout and "eval_loss" in run.stdout
  warnings = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
  assert warnings == [f"warning: cannot write {workdir}/metrics.jsonl ({reason}); this run's metrics are not "
                      "recorded there"]


SAVE_ON_8_DEVICES = """
import jax, jax.numpy as jnp, ml_collections, numpy as np, sys
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from lm_jax import checkpoint
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
state = {"replicated": jax.device_put(jnp.arange(96.0).reshape(8, 12), NamedSharding(mesh, P())),
         "half": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("model")))}
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
mngr = checkpoint.manager(sys.argv[1], keep=1)
checkpoint.save(mngr, 1, state, {"processes": []}, ml_collections.ConfigDict({"step": 1}))
checkpoint.finish(mngr)
restored = checkpoint.ocp.StandardCheckpointer().restore(f"{sys.argv[1]}/checkpoints/1/state")
assert all(np.array_equal(restored[k], state[k]) for k in state)
print("compiles", len(compiles))
"""


def test_a_save_on_8_devices_of_one_process_compiles_nothing(tmp_path):
  """One process holds every replica, so orbax's replica-parallel slicing (a jit(slice) per replicated shape) is
  off: a save compiles no program."""
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  out = subprocess.run([sys.executable, "-c", SAVE_ON_8_DEVICES, str(tmp_path)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "compiles 0" in out.stdout, out.stdout

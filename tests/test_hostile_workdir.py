"""A hostile user's workdir (issue 44): runs started together on one new workdir, symbolic links placed where a run
writes, and gs:// workdirs (an evaluator beside the trainer, URL syntax in the name). Each case runs the CLI, checks
its one stderr line and that nothing was lost or written elsewhere (records read back, files hashed, objects listed).
Runs of one kind start together, so the module costs a few CPU-bound processes at a time."""
import hashlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, cli, flags, records
from lm_jax import storage
from lm_jax.obs import metrics_log

IN_USE = "is in use by the run of pid"


def popen(args, env=None) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "lm_jax.main", *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
  out, err = proc.communicate(timeout=timeout)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(result, code: int, *words: str) -> str:
  lines = result.stderr.strip().splitlines()
  assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
  assert all(w in lines[0] for w in words), lines[0]
  return lines[0]


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180):
  deadline = time.monotonic() + timeout
  while not condition():
    assert proc.poll() is None, f"{what}: the run ended: {proc.stderr.read()[-2000:]}"
    assert time.monotonic() < deadline, what
    time.sleep(0.2)


def stop(proc: subprocess.Popen) -> subprocess.CompletedProcess:
  """SIGTERM: the trainer saves its step and exits 0."""
  proc.send_signal(signal.SIGTERM)
  return finish(proc, timeout=120)


def in_order(recs: list[dict]) -> list[int]:
  steps = [r["step"] for r in recs]
  assert steps == list(range(1, len(steps) + 1)), steps   # one record per step, none lost, none twice
  return steps


# -------------------------------------------------------------------------------- runs started together on a new dir
def test_runs_started_together_on_a_new_workdir_train_one(shared_data, tmp_path):
  """Three runs start at once on a workdir that does not exist: one trains, the others stop in one line and leave
  its workdir alone (they also saw no workdir, and once removed it with the winner's run.lock), so a run started
  later is refused too, and the winner's records and checkpoints are its own."""
  workdir = tmp_path / "new"
  args = [*flags("clm", shared_data, log_every=1, checkpoint_every=4), "--config.total_steps=100000",
          f"--workdir={workdir}"]
  runs = [popen(args) for _ in range(3)]
  deadline = time.monotonic() + 180
  while sum(p.poll() is not None for p in runs) < 2:
    assert time.monotonic() < deadline and all(p.poll() in (None, 1) for p in runs), [p.poll() for p in runs]
    time.sleep(0.2)
  winner = next(p for p in runs if p.poll() is None)
  for p in runs:
    if p is not winner:
      one_line(finish(p), 1, str(workdir), IN_USE)
  wait_for(lambda: (workdir / "checkpoints" / "4").is_dir(), winner, "the winner's first checkpoint")
  late = cli(*args)
  assert winner.poll() is None, "the winner stopped"
  one_line(late, 1, str(workdir), IN_USE, f"pid {winner.pid} ")
  done = stop(winner)
  assert done.returncode == 0, done.stderr[-2000:]
  steps = in_order(records(workdir))
  assert (workdir / "run.lock").is_file() and str(winner.pid) in (workdir / "run.lock").read_text()
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved and saved[-1] == steps[-1] and all(s % 4 == 0 for s in saved[:-1]), (saved, steps[-1])


# ------------------------------------------------------------------------------------- links where a run writes
LINKS = {   # where the link is placed in the workdir -> whether its target is a folder
    "run.lock": False, "metrics.jsonl": False, "wandb_run_id": False, "tensorboard": True, "wandb": True,
    "profile": True, "checkpoints": True, "best": True, "policy": True,
    "checkpoints/2.orbax-checkpoint-tmp-0": True, "tensorboard/events.out.tfevents.0.host": False,
}


def tree_hash(path) -> str:
  """The names and bytes of every file under a folder (or of a file)."""
  files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
  return hashlib.sha256(b"".join(str(p.relative_to(path.parent)).encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def linked(shared_data, tmp_path_factory):
  """Three runs started at once: on a workdir with a link at each name of LINKS, on one with a link among the entries
  of its folders (one line names them all); on a workdir that is itself a link (users link workdirs on purpose) whose
  trainer's old temporary names (NAME.tmpPID, PID known once it starts) are links. {name: (workdir, its run's
  result, link target, the target's hash before)}."""
  root = tmp_path_factory.mktemp("links")
  args = flags("clm", shared_data, total_steps=2, checkpoint_every=2, log_every=1)
  out, procs = {}, {}
  for n, (name, folder) in enumerate(LINKS.items()):
    workdir, target = root / ("entries" if "/" in name else "names"), root / f"target{n}"
    if folder:
      target.mkdir()
      (target / "mine.txt").write_text("the user's own")
    else:
      target.write_text("the user's own")
    (workdir / name).parent.mkdir(parents=True, exist_ok=True)
    (workdir / name).symlink_to(target)
    out[name] = [workdir, workdir.name, target, tree_hash(target)]
  real, target = root / "real", root / "target_tmp"
  real.mkdir()
  (root / "linked_workdir").symlink_to(real)
  target.write_text("the user's own")
  for workdir in (root / "names", root / "entries", root / "linked_workdir"):
    procs[workdir.name] = popen([*args, f"--workdir={workdir}"])
  for name in ("metrics.jsonl", "tokenizer_gpt_bpe_256"):
    (real / f"{name}.tmp{procs['linked_workdir'].pid}").symlink_to(target)
  out["temporaries"] = [root / "linked_workdir", "linked_workdir", target, tree_hash(target)]
  results = {name: finish(p) for name, p in procs.items()}
  return {name: (workdir, results[run], target, before) for name, (workdir, run, target, before) in out.items()}


@pytest.mark.parametrize("name", list(LINKS))
def test_a_link_where_a_run_writes_is_refused_and_its_target_unchanged(linked, name):
  workdir, result, target, before = linked[name]
  line = one_line(result, 1, "symbolic links; lm_jax does not write through links: remove them")
  assert str(workdir / name) in line.removeprefix("error: ").split(" are symbolic links")[0].split(", ")
  assert tree_hash(target) == before


def test_a_linked_workdir_trains_and_writes_no_temporary_through_a_link(linked):
  workdir, result, target, before = linked["temporaries"]
  assert result.returncode == 0, result.stderr[-3000:]
  assert tree_hash(target) == before
  assert not (workdir / "tokenizer_gpt_bpe_256.model").is_symlink() and in_order(records(workdir)) == [1, 2]


# ---------------------------------------------------------------------------------------------- gs:// workdirs
def test_an_evaluator_beside_a_trainer_on_a_bucket_loses_no_record(gcs_server, shared_data):
  """--mode=eval while the trainer writes: both add metrics segments; the eval record and every train record stay."""
  workdir = "gs://testbucket/beside"
  args = [*flags("clm", shared_data, log_every=1, checkpoint_every=3), f"--workdir={workdir}"]
  trainer = popen([*args, "--config.total_steps=100000"])   # gcs_server points this process's environment at it
  try:
    wait_for(lambda: any(u.endswith("commit_success.txt") for u in storage.find(f"{workdir}/checkpoints")), trainer,
             "the trainer's first checkpoint")
    evaluated = cli(*args, "--mode=eval")
    wait_for(lambda: max(r["step"] for r in metrics_log.read(f"{workdir}/metrics.jsonl")) >= 6, trainer,
             "train records after the eval")   # no earlier than 3 after the eval read the step-3 checkpoint
  finally:
    done = stop(trainer)
  assert evaluated.returncode == 0 and done.returncode == 0, evaluated.stderr[-2000:] + done.stderr[-2000:]
  in_order(records(workdir))
  assert len(records(workdir, "eval")) == 1 and "eval_loss" in records(workdir, "eval")[0]


URL_SYNTAX = ["#", "?", "%41", " ", "+", "*", "[x]", "=", "@", "&", ";", ","]


def test_url_syntax_in_a_remote_workdir_name_is_named():
  """The class: every character a URL does not keep as is, or a glob reads, in a gs:// workdir's name."""
  for text in URL_SYNTAX:
    assert storage.url_unsafe(f"gs://testbucket/a{text}b") == "".join(sorted(set(text) - set("x41")))
  assert storage.url_unsafe("gs://test-bucket/run_1.v2~x/a") == "" and storage.url_unsafe("/tmp/a#b") == ""


@pytest.mark.parametrize("text", ["#", "%41", " +[x]"], ids=["fragment", "percent", "space_plus_glob"])
def test_url_syntax_in_a_bucket_workdir_is_refused_before_anything_is_written(gcs_server, shared_data, text):
  """'#' stopped TensorStore's saves, '%41' saved to gs://testbucket/cAd and hung, '[x]' gcsfs's rename as a glob."""
  workdir = f"gs://testbucket/odd/c{text}d"
  result = cli(*flags("clm", shared_data, total_steps=2, checkpoint_every=2), f"--workdir={workdir}",
               timeout=120)
  one_line(result, 2, f"--workdir={workdir}", "URL or glob syntax", "use letters, digits")
  assert storage.find("gs://testbucket/odd") == [] and storage.find("gs://testbucket/cAd") == []

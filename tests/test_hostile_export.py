"""A hostile user's exports (issue 44): an export over a bucket's run is refused as over a local one, nothing is
written through a link placed in the export folder, a missing bucket is one line, and a killed export's leftovers
are removed by the next one. One tiny run trained into the test bucket is shared."""
import fcntl
import hashlib
import os
import pathlib

import pytest

from conftest import cli, flags
from test_gcs import quiet
from test_hostile import main_with

ROOT = "gs://testbucket/hostile_export"


@pytest.fixture(scope="module")
def gs_run(gcs_server, shared_data):
  """(workdir URL, flags) of a tiny GPT trained 2 steps into the test bucket."""
  args = flags("clm", shared_data, total_steps=2, checkpoint_every=2, log_every=1, eval_every=2)
  done = cli(*args, f"--workdir={ROOT}/run", env=gcs_server["env"])
  assert done.returncode == 0, done.stderr[-3000:]
  return f"{ROOT}/run", args


def objects(prefix: str) -> dict:
  """name -> (size, md5, crc32c) of every object under `prefix`, read fresh from the server."""
  from lm_jax import storage
  fs = storage._fs(prefix)
  fs.invalidate_cache()
  return {name: (info["size"], info.get("md5Hash"), info.get("crc32c"))
          for name, info in fs.find(prefix, detail=True).items()}


def error_line(result, code: int) -> str:
  lines = quiet(result.stderr)
  assert result.returncode == code and len(lines) == 1, (result.returncode, result.stderr[-3000:])
  return lines[0]


# ------------------------------------------------------------- an export never replaces a run: on gs:// as on a disk
@pytest.mark.parametrize("target", ["own_workdir_via_dotdot", "init_from", "holds_a_run", "inside_checkpoints"])
def test_an_export_never_replaces_a_run_in_a_bucket(gs_run, gcs_server, target):
  from lm_jax import storage
  run, args = gs_run
  if target == "holds_a_run" and not storage.find(f"{ROOT}/runs/deep/old"):
    storage._fs(ROOT).copy(f"{run}/", f"{ROOT}/runs/deep/old/", recursive=True)
  workdir, out = {"own_workdir_via_dotdot": (run, f"{ROOT}/x/../run/"),
                  "init_from": (f"{ROOT}/finetune", run),
                  "holds_a_run": (f"{ROOT}/finetune", f"{ROOT}/runs"),
                  "inside_checkpoints": (run, f"{run}/checkpoints/hf")}[target]
  before = objects(ROOT)
  init = [f"--init_from={run}"] if workdir != run else []
  result = cli(*args, f"--workdir={workdir}", *init, "--mode=export", f"--export_dir={out}", "--overwrite",
               env=gcs_server["env"])
  line = error_line(result, 2)
  assert f"--export_dir={out}" in line and "choose another --export_dir" in line, line
  assert objects(ROOT) == before


def test_an_export_to_a_missing_bucket_is_one_line(gs_run, gcs_server):
  run, args = gs_run
  result = cli(*args, f"--workdir={run}", "--mode=export", "--export_dir=gs://nosuchbucket/hf", env=gcs_server["env"])
  assert error_line(result, 1) == ("error: bucket gs://nosuchbucket of gs://nosuchbucket/hf does not exist (create "
                                   "it, or fix the path)")


# ------------------------------------------------------------------------------------- links in the export folder
def digests(folder: pathlib.Path) -> dict:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


NAMES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"]


def test_an_export_never_writes_through_a_link(gs_run, gcs_server, tmp_path):
  """Links placed beforehand at each export file, at the export folder itself and at a name of its partial folders:
  --overwrite replaces the links, and the files they point at keep their bytes."""
  run, args = gs_run
  victims, out, linked = tmp_path / "victims", tmp_path / "out", tmp_path / "linked"
  victims.mkdir()
  out.mkdir()
  for name in NAMES:
    (victims / name).write_text(f"the user's own {name}")
    (out / name).symlink_to(victims / name)
  (tmp_path / ".out.partial-aaaaaaaa").symlink_to(victims)
  (tmp_path / ".linked.partial-aaaaaaaa").symlink_to(victims)
  linked.symlink_to(victims)
  before = digests(victims)
  for target in (out, linked):
    result = cli(*args, f"--workdir={run}", "--mode=export", f"--export_dir={target}", "--overwrite",
                 env=gcs_server["env"])
    assert result.returncode == 0 and quiet(result.stderr) == [], result.stderr[-3000:]
    assert not target.is_symlink() and (target / "config.json").is_file()
    assert not any(p.is_symlink() for p in target.iterdir())
  assert digests(victims) == before and not list(tmp_path.glob("*.old"))   # the replaced link is not left over
  assert (tmp_path / ".out.partial-aaaaaaaa").is_symlink() and (tmp_path / ".linked.partial-aaaaaaaa").is_symlink()


# ----------------------------------------------------------------------------------------- a killed export's leftovers
KILLED_MID_WRITE = """
import os, signal
from lm_jax.hf import export
save_file = export.save_file
def save_then_die(tensors, path, **kwargs):   # kill -9 with the weights half written
  open(path, "wb").write(b"half")
  os.kill(os.getpid(), signal.SIGKILL)
export.save_file = save_then_die"""


def test_the_next_export_removes_a_killed_exports_partial_folder(gs_run, gcs_server, tmp_path):
  """kill -9 mid-write leaves .out.partial-*; the next export to out removes it with one warning line, and leaves
  a live export's partial folder (held by its flock) and folders not of its own naming."""
  run, args = gs_run
  out = tmp_path / "out"
  killed = main_with(KILLED_MID_WRITE, *args, f"--workdir={run}", "--mode=export", f"--export_dir={out}")
  assert killed.returncode == -9, killed.stderr[-3000:]
  [stale] = tmp_path.glob(".out.partial-*")
  live, mine = tmp_path / ".out.partial-live0000", tmp_path / ".out.partial-mine"
  live.mkdir()
  mine.mkdir()
  held = os.open(live, os.O_RDONLY)
  fcntl.flock(held, fcntl.LOCK_EX)
  try:
    result = cli(*args, f"--workdir={run}", "--mode=export", f"--export_dir={out}", env=gcs_server["env"])
  finally:
    os.close(held)
  [line] = quiet(result.stderr)
  assert result.returncode == 0 and line == (f"warning: removed 1 unfinished export folder(s) beside {out} that "
                                             f"killed exports left ({stale.name})"), result.stderr[-3000:]
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, mine.name, "out"])
  assert (out / "model.safetensors").stat().st_size > 100


def test_a_killed_exports_uploads_in_a_bucket_are_named_so(gs_run, gcs_server):
  """A bucket has no rename, so a gs:// export uploads into its target with config.json last: files without it are
  an export that stopped while uploading, and the next export says so (--overwrite replaces them)."""
  from lm_jax import storage
  run, args = gs_run
  torn = f"{ROOT}/torn"
  with storage.open(f"{torn}/model.safetensors", "wb") as f:
    f.write(b"\0" * 64)
  before = objects(torn)
  result = cli(*args, f"--workdir={run}", "--mode=export", f"--export_dir={torn}", env=gcs_server["env"])
  line = error_line(result, 1)
  assert "holds an unfinished export (no config.json" in line and "--overwrite" in line, line
  assert objects(torn) == before

"""Golden runs (tests/goldens/regenerate.py says what they are): today's first 20 losses and final eval loss of each
tiny run equal the goldens to rtol 1e-5 on the JAX version they were made with (1e-3 on another), and the memory
--mode=compile reports is within 5% of theirs (tests/test_aot.py compares it: compile_memory_moved, on compiles it
makes anyway). A change that moves them regenerates them in the same commit."""
import json
import pathlib

import jax
import jaxlib
import numpy as np
import pytest

from goldens import regenerate

GOLDENS = pathlib.Path(regenerate.__file__).parent


@pytest.fixture(scope="module")
def procs(shared_data):
  """The loss workers of regenerate.py, started together: they share the machine's cores."""
  procs = regenerate.start(shared_data)
  yield procs
  regenerate.stop(procs)


@pytest.fixture(scope="module")
def measured(procs):
  return regenerate.losses(procs)


def _golden(group: str) -> dict:
  return json.loads((GOLDENS / f"{group}.json").read_text())


def _tolerance(golden: dict) -> tuple[float, str]:
  made = (golden["jax"], golden["jaxlib"])
  if made == (jax.__version__, jaxlib.__version__):
    return 1e-5, f"jax {jax.__version__}, as the goldens were made"
  return 1e-3, f"jax {jax.__version__} / jaxlib {jaxlib.__version__}; the goldens were made with {made[0]} / {made[1]}"


def _regenerate(golden: dict) -> str:
  return (f"The goldens were made {golden['date']} at {golden['commit']}: {golden['reason']!r}. If the change is meant "
          f"to move them, regenerate them in the same commit, saying why:\n  {regenerate.REGENERATE}\n"
          "(with LM_JAX_AOT_PYTHON set, as tests/test_aot.py runs, it also rewrites compile_memory.json)")


def _moved(name: str, now: dict, golden: dict, rtol: float) -> str | None:
  """What moved in run `name` (None: nothing), to rtol (atol rtol / 10: PPO's policy loss starts near 0)."""
  if (now["config"], now["overrides"]) != (golden["config"], golden["overrides"]):
    return f"{name}: its config differs from the golden's ({now['config']} {now['overrides']})"
  if len(now["losses"]) != len(golden["losses"]):
    return f"{name}: {len(now['losses'])} {now['metric']} records, the golden has {len(golden['losses'])}"
  close = np.isclose(now["losses"], golden["losses"], rtol=rtol, atol=rtol / 10)
  if not close.all():
    i = int(np.argmin(close))
    return (f"{name}: {now['metric']} at step {i + 1} is {now['losses'][i]!r}, golden {golden['losses'][i]!r} "
            f"({int((~close).sum())} of {len(close)} steps moved)")
  if (now["eval_loss"] is None) != (golden["eval_loss"] is None) or (
      golden["eval_loss"] is not None and not np.isclose(now["eval_loss"], golden["eval_loss"], rtol=rtol)):
    return f"{name}: eval_loss is {now['eval_loss']!r}, golden {golden['eval_loss']!r}"
  return None


@pytest.mark.parametrize("group", list(regenerate.MESHES))
def test_losses_match_goldens(group, measured, capsys):
  golden = _golden(group)
  rtol, why = _tolerance(golden)
  with capsys.disabled():
    print(f"\ngoldens {group}: losses compared to rtol {rtol} ({why})")
  runs = measured[group]["runs"]
  moved = [f"{name}: no golden" for name in runs if name not in golden["runs"]]
  moved += [f"{name}: not run" for name in golden["runs"] if name not in runs]
  moved += [m for name in golden["runs"].keys() & runs.keys() if (m := _moved(name, runs[name], golden["runs"][name],
                                                                               rtol))]
  assert not moved, (f"{len(moved)} golden run(s) of tests/goldens/{group}.json moved, compared to rtol {rtol} "
                     f"({why}):\n  " + "\n  ".join(sorted(moved)) + "\n" + _regenerate(golden))


def compile_memory_moved(compiled: dict) -> str | None:
  """What moved by more than 5% in tests/goldens/compile_memory.json, compared with `compiled`: {(config, overrides,
  topology): the report's memory_per_device} of tests/test_aot.py's compiles (None: nothing)."""
  golden = _golden("compile_memory")
  now = {name: compiled.get((g["config"], tuple(g["overrides"]), g["topology"]))
         for name, g in golden["memory"].items()}
  moved = [f"{name}: tests/test_aot.py compiles no {g['config']} {g['overrides']} for {g['topology']}"
           for name, g in golden["memory"].items() if now[name] is None]
  moved += [f"{name} ({g['topology']}) {field}: {now[name][field]:,} bytes, golden {g[field]:,}"
            for name, g in golden["memory"].items() if now[name] for field in regenerate.MEMORY_FIELDS
            if abs(now[name][field] - g[field]) > 0.05 * g[field]]
  if moved:
    return (f"{len(moved)} per-device memory figure(s) of tests/goldens/compile_memory.json moved by more than 5%:\n  "
            + "\n  ".join(moved) + "\n" + _regenerate(golden))
  return None


def test_compile_memory_within_5_percent_passes_and_beyond_fails():
  """compile_memory_moved as tests/test_aot.py calls it (its compiles, 7 minutes, run there)."""
  golden = _golden("compile_memory")["memory"]
  compiled = {(g["config"], tuple(g["overrides"]), g["topology"]): {f: g[f] for f in regenerate.MEMORY_FIELDS}
              for g in golden.values()}
  first, second = compiled
  compiled[first]["temporaries"] = int(compiled[first]["temporaries"] * 1.04)
  assert compile_memory_moved(compiled) is None
  compiled[first]["temporaries"] = int(compiled[first]["temporaries"] * 1.03)
  del compiled[second]
  moved = compile_memory_moved(compiled)
  assert moved.startswith("2 per-device memory figure(s)") and f"{first[2]}) temporaries: " in moved
  assert f"compiles no {second[0]} {list(second[1])} for {second[2]}" in moved, moved

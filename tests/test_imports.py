"""The import graph of lm_jax (docs/architecture.md): no cycles, and no import inside a function to hide one.

Edges are every `import lm_jax...` / `from lm_jax... import ...`, at module level or inside a function, so a cycle
dodged by a function-level import is still a cycle here. Only the CLI entry points import lazily (to start fast).
"""
import ast
import collections
import functools
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"lm_jax.main", "lm_jax.scaling.__main__",   # may import inside functions: startup time only
                "lm_jax.sweep.__main__"}
_TRAINERS = ("lm_jax.train", "lm_jax.loop", "lm_jax.rlhf", "lm_jax.init_from", "lm_jax.evals.predict")
# The arrows of docs/architecture.md as what each part must NOT import (module-name prefixes).
FORBIDDEN = {
    "lm_jax.models": ("lm_jax.data", "lm_jax.objectives", "lm_jax.step", "lm_jax.params", "lm_jax.peft", "lm_jax.hf",
                      "lm_jax.decoding", *_TRAINERS),
    "lm_jax.hf": ("lm_jax.objectives", "lm_jax.step", "lm_jax.params", "lm_jax.peft", *_TRAINERS),
    # data is handed a family's record (its tokenizer specials) by the caller; it never looks a family up
    "lm_jax.data": ("lm_jax.models", "lm_jax.objectives", "lm_jax.step", "lm_jax.params", "lm_jax.peft", "lm_jax.hf",
                    *_TRAINERS),
    "lm_jax.objectives": ("lm_jax.step", "lm_jax.peft", "lm_jax.decoding", *_TRAINERS),   # a loss, never a decoder
    "lm_jax.peft": ("lm_jax.params", "lm_jax.step", "lm_jax.objectives", *_TRAINERS),
    "lm_jax.params": ("lm_jax.step", "lm_jax.objectives", *_TRAINERS),
    "lm_jax.step": ("lm_jax.objectives", "lm_jax.peft", *_TRAINERS),
    "lm_jax.loop": ("lm_jax.train", "lm_jax.step", "lm_jax.rlhf"),
    "lm_jax.train": ("lm_jax.rlhf", "lm_jax.hf", "lm_jax.checkpoint_export", "lm_jax.evals.run_eval"),   # trains only
    "lm_jax.setup": ("lm_jax.train", "lm_jax.loop", "lm_jax.rlhf"),   # a run's setup, shared by trainers and evals
    "lm_jax.evals": ("lm_jax.train", "lm_jax.rlhf"),   # evaluators and read-only modes build on setup, not a trainer
    "lm_jax.checkpoint": ("lm_jax.peft", "lm_jax.loop"),   # adapters reach checkpoints through the params policy
}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in (REPO / "lm_jax").rglob("*.py"):
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    out[name.removesuffix(".__init__")] = path
  return out


@functools.cache   # parsed once for every test here
def _graph():
  """({module: set of lm_jax modules it imports}, [(module, imported) for imports inside functions])."""
  modules = _modules()

  def owner(name):   # `from lm_jax.data import pipeline` names a module; `from lm_jax.models import layers` too
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name

  edges, nested = collections.defaultdict(set), []
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for target in (owner(t) for t in targets if t.startswith("lm_jax")):
        if target and target != name and not name.startswith(target + "."):   # a package's own __init__
          edges[name].add(target)
          if id(node) not in top:
            nested.append((name, target))
  return edges, nested


def _cycles(edges) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def test_no_import_cycles():
  edges, _ = _graph()
  assert _cycles(edges) == []


def test_imports_inside_functions_only_in_entry_points():
  _, nested = _graph()
  assert [(m, t) for m, t in nested if m not in ENTRY_POINTS] == []


def _under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def test_dependencies_point_one_way():
  edges, _ = _graph()
  wrong = sorted((m, t) for m, targets in edges.items() for t in targets
                 for part, banned in FORBIDDEN.items() if _under(m, part) and any(_under(t, b) for b in banned))
  assert wrong == []


FAMILY_MODULES = ("lm_jax.models.bert", "lm_jax.models.gpt", "lm_jax.models.gpt2", "lm_jax.models.t5")


def test_no_family_module_imported_by_name_outside_models_and_hf():
  """Everything else asks the family record (lm_jax.models.family), so adding a family touches no other module."""
  edges, _ = _graph()
  named = sorted((m, t) for m, targets in edges.items() for t in targets
                 if t in FAMILY_MODULES and not (_under(m, "lm_jax.models") or _under(m, "lm_jax.hf")))
  assert named == []


def test_models_layers_do_one_job_each():
  """layers (primitives) <- attention (kernels, KV cache) <- blocks (blocks, the stack); relayout reads layers only."""
  edges, _ = _graph()
  assert "lm_jax.models.attention" not in edges["lm_jax.models.layers"]
  assert "lm_jax.models.blocks" not in edges["lm_jax.models.attention"] | edges["lm_jax.models.layers"]
  assert edges["lm_jax.models.relayout"] <= {"lm_jax.models.layers"}


def test_loading_a_config_imports_no_jax():
  """config_lib loads, overrides and parses; checking against devices (lm_jax.checks) is where the library loads."""
  code = ("import sys; from lm_jax import config_lib; config_lib.load('configs/bert.py:large', "
          "{'optimizer.lr': 3e-4}); print(sorted(m for m in sys.modules if m.split('.')[0] in ('lm_jax', 'jax', "
          "'flax', 'optax', 'orbax')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
  assert out.stdout.split() == ["['lm_jax',", "'lm_jax.config_lib',", "'lm_jax.defaults']"]


def _paths_into_bench(source: str) -> list[str]:
  """The string literals of a module (not its docstrings, which may cite a benchmark) that name a path in bench/."""
  tree = ast.parse(source)
  docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
  return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
          and id(n) not in docs and (n.value == "bench" or re.fullmatch(r"\S*(^|/)bench/\S*", n.value))]


def test_the_library_reads_no_file_of_bench():
  """bench/ measures the library and may write the tables it owns (lm_jax/plan/input_rates.json); lm_jax never
  reads a file of bench/."""
  found = {str(p.relative_to(REPO)): hits for p in (REPO / "lm_jax").rglob("*.py")
           if (hits := _paths_into_bench(p.read_text()))}
  assert found == {}
  old = 'RATES = pathlib.Path(__file__).parents[2] / "bench" / "input_rates.json"\nx = f"{REPO}/bench/a.json"'
  assert sorted(_paths_into_bench(old)) == ["/bench/a.json", "bench"]
  assert _paths_into_bench('"""Measured by bench/decode.py."""\nsay("run bench/data_throughput.py")') == []


def test_one_helper_names_the_lead_process():
  """`process_index() == 0` is spelled once (distributed.is_lead); everything that writes for the run asks it."""
  found = sorted(str(p.relative_to(REPO)) for p in (REPO / "lm_jax").rglob("*.py")
                 if "process_index() == 0" in p.read_text())
  assert found == ["lm_jax/distributed.py"]


def _calls(path: pathlib.Path) -> set[str]:
  """'obj.attr' and 'name' of every call in the module at `path`."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Call):
      f = node.func
      if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        out.add(f"{f.value.id}.{f.attr}")
      elif isinstance(f, ast.Name):
        out.add(f.id)
  return out


def test_both_trainers_run_in_one_loop_session():
  """The trainer and PPO's trainer set up and tear down through lm_jax.loop.session (checkpoint manager, metrics
  log, final saves, goodput line, closing), not each by hand."""
  for path, loop_name in ((REPO / "lm_jax" / "train.py", "loop"), (REPO / "lm_jax" / "rlhf" / "ppo.py", "loop_lib")):
    calls = _calls(path)
    assert f"{loop_name}.session" in calls, path
    assert not calls & {"metrics_log.MetricsLog", "checkpoint.finish", f"{loop_name}.finish"}, path


def test_the_checks_see_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

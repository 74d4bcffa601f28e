"""Hygiene: citations point inside the repository (docs/ pages and their sections exist); no private JAX; the README
is a map whose objective list, like the docs' Objective fields, matches the registry."""
import dataclasses
import pathlib
import re

from lm_jax import objectives

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for pattern in ("*.md", "lm_jax/**/*.py", "configs/*.py", "tests/*.py", "bench/*", "launch/*", ".ci/*")
           for p in REPO.glob(pattern)
           if p.is_file() and p.suffix != ".png" and p != pathlib.Path(__file__).resolve()]   # text, not plots


def _anchors(page):
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
  return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
          for line in page.read_text().splitlines() if line.startswith("#")}


def test_cited_doc_sections_exist():
  cited = {(m[0], m[1], str(p.relative_to(REPO))) for p in SOURCES
           for m in re.findall(r"((?:docs|bench)/[\w.]+\.md)(?:#([\w-]+))?", p.read_text())}
  assert any(path.startswith("docs/") for path, _, _ in cited)
  for path, anchor, where in sorted(cited):
    page = REPO / path
    assert page.is_file(), f"{where} cites missing {path}"
    assert not anchor or anchor in _anchors(page), f"{where} cites {path}#{anchor}: no such section"


def test_no_outside_documents_or_private_jax():
  outside = re.compile(r"\b(REFERENCE|TOOLCHAIN|DESIGN)\.md|shared/(?!data|run)|from jax\._src|import jax\._src")
  hits = [f"{p.relative_to(REPO)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
          if outside.search(line)]
  assert not hits, hits


def test_readme_is_a_map_that_links_every_doc():
  readme = (REPO / "README.md").read_text()
  assert len(readme.splitlines()) <= 220
  missing = [p.name for p in (REPO / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
  assert not missing, f"README.md does not link {missing}"


def test_docs_name_the_registered_objectives_and_objective_fields():
  pitch = (REPO / "README.md").read_text().split("\n## ", 1)[0]
  named = re.findall(r"`([a-z_]+)`", pitch.split("every objective:", 1)[1].split(". The same code", 1)[0])
  assert sorted(named) == sorted(objectives.names())
  section = (REPO / "docs" / "configs.md").read_text().split("## Adding an objective", 1)[1].split("\n## ", 1)[0]
  first_column = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
  documented = [name for cell in first_column for name in re.findall(r"`(\w+)", cell)]
  assert sorted(documented) == sorted(f.name for f in dataclasses.fields(objectives.Objective))

"""Hygiene: citations point inside the repository (docs/ pages and their sections exist); no private JAX."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for pattern in ("*.md", "lm_jax/**/*.py", "configs/*.py", "tests/*.py", "bench/*", "launch/*", ".ci/*")
           for p in REPO.glob(pattern) if p.is_file() and p != pathlib.Path(__file__).resolve()]


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

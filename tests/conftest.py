"""Shared test fixtures: where the offline data lives."""
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
  """Tiny Shakespeare, SST-2 and WikiText-2 (LM_JAX_DATA, default ../shared/data beside the repo)."""
  path = pathlib.Path(os.environ.get("LM_JAX_DATA", REPO.parent / "shared" / "data"))
  if not path.is_dir():
    pytest.skip(f"offline data not found at {path} (set LM_JAX_DATA)")
  return path


# Tests never reach a hub: everything is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

"""--mode=summary: exact parameter counts (docs/reference.md#parameter-counts) from shapes alone."""
import pathlib
import subprocess
import sys

import pytest

from lm_jax import config_lib, summary

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_summary_main_bert_base():
  out = subprocess.run([sys.executable, "-m", "lm_jax.main", "--config=configs/bert.py:base", "--mode=summary"],
                       cwd=REPO, capture_output=True, text=True, check=True).stdout
  assert "params: 109482240\n" in out
  assert "head mlm: 622650\n" in out and "head nsp: 1538\n" in out
  assert "layers_*/attention/query/kernel" in out


@pytest.mark.parametrize("config,count", [("bert.py:large", 335141888), ("gpt1.py:gpt1", 116534784),
                                          ("t5.py:small", 60506624), ("t5.py:base", 222903552),
                                          ("t5.py:large", 737668096)])
def test_summary_counts(config, count, capsys):
  summary.print_summary(config_lib.load(f"configs/{config}"))
  assert f"params: {count}\n" in capsys.readouterr().out

"""configs/nanogpt.py against nanoGPT (karpathy/nanoGPT): its character vocabulary and 90% / 10% split of Tiny
Shakespeare, its min_lr cosine schedule and matrix-only weight decay computed by hand, its parameter count, a short
run whose loss falls and whose eval scores every validation character once; bench/nanogpt.py's --quick form."""
import importlib.util
import math
import os

import jax
import numpy as np
import pytest

from conftest import REPO, run_tokenizer
from lm_jax import config_lib, models, optim, params as params_lib, train
from lm_jax.data import tokenizer as tokenizer_lib, windows

CHARS = 1_115_394              # Tiny Shakespeare's input.txt


def _config(shared_data, variant="shakespeare_char_cpu", **overrides):
  return config_lib.load(f"configs/nanogpt.py:{variant}",
                         {"data.files": str(shared_data / "tiny_shakespeare" / "input.txt"), **overrides})


@pytest.fixture(scope="module")
def text(shared_data):
  return (shared_data / "tiny_shakespeare" / "input.txt").read_text(encoding="utf-8")


def test_char_tokenizer_round_trips_every_character(shared_data, text, tmp_path):
  tok = run_tokenizer(_config(shared_data), str(tmp_path))
  stoi = {ch: i for i, ch in enumerate(sorted(set(text)))}     # nanoGPT's prepare.py
  assert tok.vocab_size == len(stoi) == 65
  ids = tok.encode(text)
  assert len(ids) == CHARS and ids[:200] == [stoi[ch] for ch in text[:200]]
  assert tok.decode(ids) == text
  again = tokenizer_lib.load(str(tmp_path / "tokenizer_char.json"), models.family("gpt2"))   # the workdir's saved vocabulary
  assert again.encode(text[-500:]) == ids[-500:]
  with pytest.raises(ValueError, match="not in its 65-character vocabulary"):
    tok.encode("café")


def test_split_is_nanogpts(shared_data, text):
  train_text, val_text = windows.split_texts(_config(shared_data))
  assert (len(train_text), len(val_text)) == (1_003_854, 111_540) == (int(CHARS * 0.9), CHARS - int(CHARS * 0.9))
  assert train_text + val_text == text


def test_min_lr_cosine_matches_hand_computation(shared_data):
  c = _config(shared_data)
  lr = optim.schedule(c.optimizer, c.total_steps)
  lr_max, lr_min, warmup, total = 1e-3, 1e-4, 100, 2000
  for step in (100, 500, 1050, 1700, 2000):
    ratio = (step - warmup) / (total - warmup)
    assert float(lr(step)) == pytest.approx(lr_min + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr_max - lr_min), rel=1e-5)
  assert float(lr(50)) == pytest.approx(lr_max * 50 / warmup)
  c.optimizer.schedule = "linear"
  linear = optim.schedule(c.optimizer, c.total_steps)
  assert float(linear(1050)) == pytest.approx(lr_min + (lr_max - lr_min) * (1 - 1050 / total), rel=1e-5)  # BERT's
  assert float(linear(2000)) == pytest.approx(lr_min, rel=1e-5)


def test_weight_decay_on_matrices_only(shared_data):
  """Zero gradients leave Adam's step at 0, so one update is -lr * wd * p on the decayed leaves and 0 elsewhere:
  nanoGPT decays exactly the parameters with p.dim() >= 2 (embeddings, every Linear weight)."""
  c = _config(shared_data, **{"optimizer.warmup_steps": 0})
  params = models.init(c.model, jax.random.key(0))
  tx, _ = optim.make(c, models.logical_axes(c.model))
  updates, _ = jax.jit(tx.update)(jax.tree.map(np.zeros_like, params), tx.init(params), params)
  decayed = 0
  for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(params)):
    name = jax.tree_util.keystr(path)
    if p.ndim >= 2:
      np.testing.assert_allclose(u, -1e-3 * 0.1 * np.asarray(p), rtol=1e-5, err_msg=name)
      decayed += 1
    else:
      assert not np.any(u), name
  assert decayed == 2 + 4 * (4 + 2)          # word and position embeddings; per layer q, k, v, out, wi, wo


def test_param_count_is_nanogpts(shared_data):
  """nanoGPT's get_num_params (non_embedding=True) leaves out the position embeddings; we count them."""
  c = _config(shared_data)
  n_layer, d, vocab, block = 4, 128, 65, 64
  nanogpt = n_layer * 12 * d * d + (2 * n_layer + 1) * d + vocab * d     # no biases; tied head
  assert nanogpt == 795_904
  assert params_lib.count(c) == (nanogpt + block * d,) * 2 == (804_096,) * 2


def test_short_run_loss_falls_and_eval_scores_every_character(shared_data, tmp_path):
  c = _config(shared_data, **{"model.num_layers": 1, "total_steps": 40, "log_every": 10, "eval_every": 40,
                              "checkpoint_every": 40, "optimizer.warmup_steps": 5})
  result = train.train(c, str(tmp_path))
  assert result["eval"]["eval_tokens"] == 111_539                # every validation character after the first
  assert result["eval"]["eval_loss"] < math.log(65) - 1.0
  assert result["train"]["loss"] < math.log(65) - 1.0


def test_bench_quick(shared_data, capsys):
  """bench/nanogpt.py --quick: ours always, nanoGPT's train.py too where NANOGPT_DIR names a checkout."""
  nanogpt = os.environ.get("NANOGPT_DIR", "")
  spec = importlib.util.spec_from_file_location("bench_nanogpt", REPO / "bench" / "nanogpt.py")
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  results = bench.main(["--quick", f"--data={shared_data / 'tiny_shakespeare' / 'input.txt'}", f"--nanogpt={nanogpt}"])
  assert set(results) == ({"lm_jax", "nanoGPT"} if nanogpt else {"lm_jax"})
  for r in results.values():
    assert r["wall_s"] > 0 and r["ms_step"] > 0 and 2.5 < r["val_loss"] < 4.5     # 10 steps from ln(65) = 4.17
  assert "lm_jax" in capsys.readouterr().out

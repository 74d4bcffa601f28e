"""Using a trained model from the CLI: --mode=fill_mask on a tiny BERT, checked against transformers on the
export of the same checkpoint."""
import numpy as np
import pytest

from conftest import cli, flags, load_config
from lm_jax import checkpoint_export, train
from lm_jax.evals import inference, run_eval


@pytest.fixture(scope="module")
def bert(shared_data, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("bert")
  config = load_config("mlm", shared_data, total_steps=20, log_every=20, eval_every=0, checkpoint_every=20,
                       **{"optimizer.lr": 3e-3, "optimizer.warmup_steps": 0})
  train.train(config, str(workdir))
  return config, workdir


def test_fill_mask_matches_transformers_on_the_export(bert, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config, workdir = bert
  texts = ["To be, or not to [MASK], that is the question.", "[MASK] my lord, and [MASK] the king."]
  got = inference.fill_mask(config, str(workdir), texts, top_k=5)
  assert [len(m) for m in got] == [1, 2] and all(len(best) == 5 for m in got for best in m)

  checkpoint_export.export_checkpoint(config, str(workdir), str(tmp_path / "hf"))
  model = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
  s, _, _ = run_eval.restore_params(config, str(workdir))
  tok = s.tokenizer
  for text, masks in zip(texts, got):
    ids = [tok.cls_id] + inference.encode_masked(tok, text) + [tok.sep_id]
    with torch.no_grad():
      logits = model(torch.tensor([ids])).prediction_logits[0].numpy()
    where = [i for i, t in enumerate(ids) if t == tok.mask_id]
    for j, best in zip(where, masks):
      p = np.exp(logits[j] - logits[j].max())
      p /= p.sum()
      top = np.argsort(-p)[:5]
      assert [t for t, _ in best] == [tok.decode([int(i)]) for i in top]
      np.testing.assert_allclose([q for _, q in best], p[top], atol=1e-5)


def test_fill_mask_cli(bert, shared_data):
  config, workdir = bert
  run = cli(*flags("mlm", shared_data), f"--workdir={workdir}", "--mode=fill_mask",
            "--prompt=Now is the [MASK] of our discontent", "--prompt=no mask here")
  assert run.returncode == 1 and run.stderr.strip().startswith("error: every prompt needs a [MASK]")
  run = cli(*flags("mlm", shared_data), f"--workdir={workdir}", "--mode=fill_mask",
            "--prompt=Now is the [MASK] of our discontent")
  assert run.returncode == 0, run.stderr[-2000:]
  lines = run.stdout.strip().splitlines()
  assert lines[-2] == "Now is the [MASK] of our discontent" and lines[-1].startswith("  [MASK] 1: ")
  assert lines[-1].count("0.") >= 5


def test_generate_cli_prints_the_greedy_continuation(shared_data, tmp_path):
  config = load_config("clm", shared_data, total_steps=10, log_every=10, eval_every=0, checkpoint_every=10)
  train.train(config, str(tmp_path))
  want = inference.generate_text(config, str(tmp_path), ["ROMEO:"], max_new_tokens=6)
  run = cli(*flags("clm", shared_data), f"--workdir={tmp_path}", "--mode=generate", "--prompt=ROMEO:",
            "--max_new_tokens=6")
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.strip().splitlines()[-2:] == ["ROMEO:", f"  -> {want[0]}"]
  run = cli(*flags("clm", shared_data), f"--workdir={tmp_path}", "--mode=generate", "--prompt=ROMEO:",
            "--method=sample", "--top_p=0")
  assert run.returncode == 2 and run.stderr.strip() == "error: --top_p must be in (0, 1], got 0.0"   # a flag: 2

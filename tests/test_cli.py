"""The command line: each objective trains from the CLI with its loss falling, then --mode=eval, --mode=export
(loaded by transformers) and a rerun on the same workdir; usage and checkpoint-mismatch errors."""
import numpy as np
import pytest

from lm_jax import objectives, scaling
from lm_jax.data import tokenizer
from conftest import cli, flags, load_config, records

PEAK_TFLOPS = 0.05   # fixed, so the logged MFU can be checked against the FLOP count exactly


@pytest.fixture(scope="module", params=["clm", "mlm", "span_corruption"])
def trained(request, shared_data, tmp_path_factory):
  """(objective, workdir) after 120 steps from the CLI."""
  objective = request.param
  workdir = tmp_path_factory.mktemp(objective)
  lr = {} if objective == "span_corruption" else {"optimizer.lr": 1e-2}  # T5 keeps Adafactor's 0.01 rsqrt
  overrides = dict(total_steps=120, log_every=20, eval_every=60, checkpoint_every=60, peak_tflops=PEAK_TFLOPS,
                   **{"optimizer.warmup_steps": 10}, **lr)
  run = cli(*flags(objective, shared_data, **overrides), f"--workdir={workdir}")
  assert run.returncode == 0, run.stderr[-3000:]
  return objective, workdir, run.stdout, load_config(objective, shared_data, **overrides)


def test_loss_falls(trained):
  objective, workdir, stdout, _ = trained
  train_recs, eval_recs = records(workdir), records(workdir, "eval")
  assert [r["step"] for r in train_recs] == [1, 20, 40, 60, 80, 100, 120]
  assert [r["step"] for r in eval_recs] == [60, 120]
  first, last = train_recs[0]["loss"], min(r["loss"] for r in train_recs[-2:])   # one batch's loss is noisy
  assert last < first - 0.5, (objective, [r["loss"] for r in train_recs])
  assert eval_recs[-1]["eval_loss"] < eval_recs[0]["eval_loss"]
  for key in ("lr", "grad_norm", "tokens_per_sec", "mfu", "token_loss"):
    assert np.isfinite(train_recs[-1][key]) and train_recs[-1][key] >= 0, key
  accuracy = {"clm": "accuracy", "mlm": "mlm_accuracy", "span_corruption": "accuracy"}[objective]
  assert 0 < eval_recs[-1][f"eval_{accuracy}"] <= 1
  e = eval_recs[-1]
  assert e["eval_perplexity"] == pytest.approx(np.exp(e["eval_token_loss"]), rel=1e-6)
  assert 0 < e["eval_bits_per_byte"] < e["eval_token_loss"] / np.log(2)  # > 1 byte per token
  assert "step 120/120 | loss" in stdout and "tok/s" in stdout and "mfu" in stdout
  assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [60, 120]


def test_logged_mfu_is_the_benchmarks_flop_count(trained):
  """metrics.jsonl's mfu = bench/train_step.py's FLOP count (the objective's flops_per_example, the exact matmul
  count with its target length / masked positions) per second / peak."""
  _, workdir, _, config = trained
  objective = objectives.get(config.objective)
  per_sequence = objective.flops_per_example(config)
  assert per_sequence == scaling.train_flops_per_sequence(config.model, config.data.seq_len, *_extra(config))
  for r in records(workdir)[1:]:
    sequences_per_sec = r["tokens_per_sec"] / objective.tokens_per_example(config)
    assert r["mfu"] == pytest.approx(sequences_per_sec * per_sequence / (PEAK_TFLOPS * 1e12), rel=1e-6)


def _extra(config):
  """(target_len, num_predictions) as the objective defines them."""
  from lm_jax.objectives import span_corruption
  if config.objective == "span_corruption":
    return span_corruption.target_len(config), 0
  return 0, config.data.max_predictions_per_seq if config.objective == "mlm" else 0


def test_eval_mode_and_rerun_when_done(trained, shared_data):
  objective, workdir, *_ = trained
  common = flags(objective, shared_data, total_steps=120, eval_every=60)
  run = cli(*common, f"--workdir={workdir}", "--mode=eval")
  assert run.returncode == 0, run.stderr[-3000:]
  evals = records(workdir, "eval")
  assert evals[-1].keys() == evals[-2].keys() and evals[-1]["step"] == 120
  for k, v in evals[-2].items():  # the checkpoint of step 120 evaluated again: same held-out batches
    assert evals[-1][k] == pytest.approx(v, rel=1e-6), k
  again = cli(*common, f"--workdir={workdir}")
  assert again.returncode == 0 and "nothing to do" in again.stdout
  assert len(records(workdir, "eval")) == len(evals)


def test_checkpoint_of_another_model_is_a_one_line_error(trained, shared_data):
  objective, workdir, *_ = trained
  run = cli(*flags(objective, shared_data, total_steps=120, **{"model.d_model": 64}), f"--workdir={workdir}")
  assert run.returncode != 0
  error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
  assert error and "model.d_model=32" in error[-1] and "model.d_model=64" in error[-1]


def test_export_loads_in_transformers(trained, shared_data, tmp_path):
  objective, workdir, *_ = trained
  if objective != "clm":
    pytest.skip("one family is enough here; the models' tests cover every HF mapping")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  out = tmp_path / "hf"
  run = cli(*flags(objective, shared_data, total_steps=120), f"--workdir={workdir}", "--mode=export",
            f"--export_dir={out}")
  assert run.returncode == 0, run.stderr[-3000:]
  hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  from lm_jax import models
  from lm_jax.hf import export
  model_cfg, params = export.load_hf(str(out))
  ids = np.arange(3, 19, dtype=np.int32)[None]
  ours = np.asarray(models.apply(model_cfg, params, {"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"])
  with torch.no_grad():
    theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-3)
  assert float(np.abs(ours).max()) > 0
  text = "First Citizen: Before we proceed any further, hear me speak."   # the run's tokenizer came along
  ids = tokenizer.load(str(next(workdir.glob("tokenizer_gpt_*.model"))), models.family("gpt")).encode(text)
  assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ids
  assert export.load_hf_tokenizer(str(out)).encode(text) == ids


def test_usage_errors(shared_data, tmp_path):
  no_workdir = cli(*flags("clm", shared_data))
  assert no_workdir.returncode != 0 and "--workdir is required for --mode=train" in no_workdir.stderr
  no_export_dir = cli(*flags("clm", shared_data), f"--workdir={tmp_path}", "--mode=export")
  assert no_export_dir.returncode != 0 and "--export_dir is required" in no_export_dir.stderr

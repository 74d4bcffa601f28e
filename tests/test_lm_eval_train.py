"""config.eval.lm_eval_tasks: a tiny GPT run evaluates configs/lm_eval's SST-2 (loglikelihood) and WikiText-2
(loglikelihood_rolling) tasks on its in-memory params, and its numbers equal the harness' HFLM on the export of
the same step; generate_until equals HFLM's; a wrong task name or a model without a decoder-only layout stops the
run in one line before it trains."""
import math

import jax
import pytest

from conftest import REPO, load_config, records, run_tokenizer
from lm_jax import checkpoint_export, config_lib, train
from lm_jax.evals import lm_eval_adapter

lm_eval = pytest.importorskip("lm_eval")
huggingface = pytest.importorskip("lm_eval.models.huggingface")   # needs lm-eval[hf] (accelerate)

TASKS = ("lm_jax_sst2", "lm_jax_wikitext2")
LIMIT = 2


def tiny(shared_data, **overrides):
  return load_config("clm", shared_data, total_steps=4, log_every=2, eval_every=2, checkpoint_every=4,
                     **{"model.max_positions": 64, "eval.lm_eval_tasks": TASKS, "eval.lm_eval_every": 4,
                        "eval.lm_eval_limit": LIMIT, **overrides})


@pytest.fixture(scope="module")
def run(shared_data, tmp_path_factory):
  """(config, workdir, result of train.train, its eval records, HFLM on the export of its last step)."""
  workdir, export_dir = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("export")
  config = tiny(shared_data)
  with pytest.MonkeyPatch.context() as env:
    env.setenv("LM_JAX_DATA", str(shared_data))   # the local tasks' data
    result = train.train(config, str(workdir))
  checkpoint_export.export_checkpoint(config, str(workdir), str(export_dir))
  hf = huggingface.HFLM(pretrained=str(export_dir), device="cpu", batch_size=8)
  return config, str(workdir), result, records(str(workdir), "eval"), hf


def test_tasks_in_training_equal_harness_on_export(run, shared_data):
  from lm_eval.tasks import TaskManager
  *_, evals, hf = run
  assert [r["step"] for r in evals] == [2, 4]
  assert not any(k.startswith("lm_eval/") for k in evals[0])   # lm_eval_every=4: not at step 2
  ours = {k: v for k, v in evals[1].items() if k.startswith("lm_eval/")}
  manager = TaskManager(include_path=str(REPO / "configs" / "lm_eval"), include_defaults=False,
                        metadata={"data_dir": str(shared_data)})
  out = lm_eval.simple_evaluate(model=hf, tasks=list(TASKS), task_manager=manager, limit=LIMIT, bootstrap_iters=0)
  theirs = lm_eval_adapter.metrics(out["results"])
  assert set(ours) == set(theirs) >= {"lm_eval/lm_jax_sst2_acc", "lm_eval/lm_jax_wikitext2_word_perplexity",
                                      "lm_eval/lm_jax_wikitext2_bits_per_byte"}
  for key, value in theirs.items():
    assert math.isclose(ours[key], value, rel_tol=1e-4), (key, ours[key], value)
  assert 1.0 < ours["lm_eval/lm_jax_wikitext2_word_perplexity"] < math.inf


def test_generate_until_equals_harness(run, shared_data):
  from lm_eval.api.instance import Instance
  config, workdir, result, _, hf = run
  ours = lm_eval_adapter.jax_lm()(config.model, jax.device_get(result["state"]["params"]),
                                  run_tokenizer(config, workdir), batch_size=4)
  lines = (shared_data / "tiny_shakespeare" / "input.txt").read_text()[:3000].splitlines()
  options = {"until": ["\n\n", "."], "max_gen_toks": 12}
  requests = [Instance("generate_until", {}, (text, dict(options)), 0)
              for text in [line for line in lines[:5] if line][:3] + [lines[0] * 40]]   # the last: cut on the left
  texts = ours.generate_until(requests)
  assert texts == hf.generate_until(requests, disable_tqdm=True) and any(texts)


def test_unknown_task_is_one_line_before_training(shared_data, tmp_path):
  config = tiny(shared_data, **{"eval.lm_eval_tasks": ("lm_jax_sst2", "lm_jax_sst3")})
  with pytest.raises(config_lib.ConfigError, match=r"^config.eval.lm_eval_tasks: no task 'lm_jax_sst3' in "
                     r"configs/lm_eval or lm-evaluation-harness; did you mean 'lm_jax_sst2'\?$"):
    train.train(config, str(tmp_path))
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("objective", ["mlm", "span_corruption"])
def test_encoder_models_are_a_config_error(objective, shared_data):
  config = load_config(objective, shared_data, eval_every=2, **{"eval.lm_eval_tasks": TASKS})
  with pytest.raises(config_lib.ConfigError, match=r"^config.eval.lm_eval_tasks needs a decoder-only model"):
    lm_eval_adapter.check(config)

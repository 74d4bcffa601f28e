"""lm-evaluation-harness on a tiny exported GPT: its log-likelihoods and greedy flags for the requests the local
SST-2 task of configs/lm_eval builds (plus empty contexts, which it conditions on the eos token) equal
lm_jax.decoding.score on the same token ids; both local tasks evaluate offline, their data directory given as
metadata (what the README's `--metadata` passes). The harness runs in-process: its command line would spend
half a minute indexing its thousands of built-in tasks."""
import math

import jax
import numpy as np
import pytest

from conftest import REPO
from lm_jax import defaults, models
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.hf import export

lm_eval = pytest.importorskip("lm_eval")
huggingface = pytest.importorskip("lm_eval.models.huggingface")   # needs lm-eval[hf] (accelerate)

TASKS = REPO / "configs" / "lm_eval"


@pytest.fixture(scope="module")
def gpt(shared_data, tmp_path_factory):
  """(model config, params, tokenizer, export dir): random weights, a SentencePiece model of a Shakespeare slice."""
  lines = (shared_data / "tiny_shakespeare" / "input.txt").read_text()[:100_000].splitlines()
  model = tmp_path_factory.mktemp("spm") / "gpt.model"
  model.write_bytes(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=384))
  tok = tokenizer_lib.load(str(model), models.family("gpt"))
  m = defaults.model_defaults("gpt")
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = tok.vocab_size, 32, 2, 2, 128, 512
  m.dropout_rate = m.attention_dropout_rate = 0.0
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: rng.normal(0.0, 0.2, a.shape).astype(np.float32), models.abstract_params(m))
  path = tmp_path_factory.mktemp("export")
  export.save_hf(m, params, str(path), tokenizer=tok)
  return m, params, tok, path


@pytest.fixture(scope="module")
def harness(gpt, shared_data):
  """(HFLM on the export, a TaskManager of configs/lm_eval only, reading shared_data)."""
  from lm_eval.tasks import TaskManager
  lm = huggingface.HFLM(pretrained=str(gpt[3]), device="cpu", batch_size=8)
  return lm, TaskManager(include_path=str(TASKS), include_defaults=False, metadata={"data_dir": str(shared_data)})


def our_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
  """lm-eval's split of a request into token ids (trailing spaces of the context move to the continuation, the
  continuation is what encoding the whole adds), with our tokenizer; an empty context is the eos token."""
  if not context:
    return [tok.eos_id], tok.encode(continuation)
  stripped = context.rstrip()
  continuation, context = context[len(stripped):] + continuation, stripped
  ctx = tok.encode(context)
  return ctx, tok.encode(context + continuation)[len(ctx):]


def test_loglikelihoods_equal_score(gpt, harness):
  from lm_eval.api.instance import Instance
  from lm_jax import decoding
  model_cfg, params, tok, _ = gpt
  lm, manager = harness
  task = manager.load("lm_jax_sst2")["tasks"]["lm_jax_sst2"]
  task.build_all_requests(limit=12)
  requests = list(task.instances) + [
      Instance("loglikelihood", {}, ("", text), 0) for text in ("First Citizen:", "Speak, speak.")]
  assert len(requests) == 26 and all(r.request_type == "loglikelihood" for r in requests)
  requests += greedy_requests(lm, tok, [r.args[0] for r in requests[:24:2]])
  theirs = lm.loglikelihood(requests, disable_tqdm=True)
  pairs = [our_pair(tok, *r.args) for r in requests]
  assert max(len(c) + len(x) for c, x in pairs) <= model_cfg.max_positions   # no truncation on either side
  logprob, greedy = decoding.score(model_cfg, params, [c for c, _ in pairs], [x for _, x in pairs])
  np.testing.assert_allclose(np.asarray(logprob), [lp for lp, _ in theirs], atol=1e-4, rtol=0)
  assert list(np.asarray(greedy, bool)) == [g for _, g in theirs] and greedy[26:].all() and not greedy[:26].any()


def greedy_requests(lm, tok, contexts):
  """(context, word) requests whose continuation is the one token the exported model's argmax picks after the
  context, where that token is a whole word that encodes back to itself."""
  import torch
  from lm_eval.api.instance import Instance
  out = []
  for context in contexts:
    with torch.no_grad():
      best = int(lm.model(torch.tensor([tok.encode(context)])).logits[0, -1].argmax())
    word = " " + tok.decode([best])
    if our_pair(tok, context, word)[1] == [best]:
      out.append(Instance("loglikelihood", {}, (context, word), 0))
  assert out, "no context's greedy token is a whole word"
  return out


def test_local_tasks_evaluate(harness, monkeypatch):
  monkeypatch.delenv("LM_JAX_DATA", raising=False)   # the data directory comes from the metadata
  lm, manager = harness
  out = lm_eval.simple_evaluate(model=lm, tasks=["lm_jax_wikitext2", "lm_jax_sst2"], task_manager=manager, limit=2)
  results = out["results"]
  assert results["lm_jax_sst2"]["acc,none"] in (0.0, 0.5, 1.0)
  wiki = results["lm_jax_wikitext2"]
  assert 1.0 < wiki["word_perplexity,none"] < math.inf and 0.0 < wiki["bits_per_byte,none"] < 16.0
  assert math.isclose(wiki["bits_per_byte,none"], math.log2(wiki["byte_perplexity,none"]), rel_tol=1e-9)

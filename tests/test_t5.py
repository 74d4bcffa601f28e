"""T5 v1.0 / v1.1: parity both ways with transformers, KV-cache decoding, parameter counts, config errors."""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO
from lm_jax import defaults
from lm_jax.models import t5

sys.path.insert(0, str(REPO / "configs"))
import t5 as t5_configs  # noqa: E402  (configs/t5.py)


def tiny(v1_1: bool, scan: bool):
  """Unusual sizes: heads * head_dim (60) != d_model (40), odd vocab, 2 encoder / 3 decoder layers, few
  buckets and a short max distance so short rows reach the log-spaced buckets."""
  m = defaults.model_defaults("t5")
  m.vocab_size, m.d_model, m.num_heads, m.head_dim, m.d_ff = 131, 40, 5, 12, 56
  m.num_layers, m.num_decoder_layers = 2, 3
  m.relative_attention_num_buckets, m.relative_attention_max_distance = 8, 20
  m.layer_norm_eps = 1e-6
  m.activation, m.gated_ffn, m.tie_embeddings = ("gelu_tanh", True, False) if v1_1 else ("relu", False, True)
  m.scan_layers = scan
  return m


def batch():
  rng = np.random.default_rng(0)
  enc_len, dec_len = np.array([11, 7, 4]), np.array([6, 7, 3])
  mask = (np.arange(11)[None] < enc_len[:, None]).astype(np.int32)
  dec_mask = (np.arange(7)[None] < dec_len[:, None]).astype(np.int32)
  return {"input_ids": (rng.integers(2, 131, (3, 11)) * mask).astype(np.int32), "attention_mask": mask,
          "decoder_input_ids": (rng.integers(2, 131, (3, 7)) * dec_mask).astype(np.int32),
          "decoder_attention_mask": dec_mask}


@functools.lru_cache(maxsize=None)
def params_for(v1_1: bool, scan: bool):
  """One random init per version (compiling an init is the slow part on CPU); the looped layout is converted
  from the scanned one."""
  if scan:
    return t5.init(tiny(v1_1, True), jax.random.key(int(v1_1)))
  return t5.from_hf(tiny(v1_1, False), t5.to_hf(tiny(v1_1, True), params_for(v1_1, True)))


@functools.lru_cache(maxsize=None)
def apply_fn(v1_1: bool, scan: bool, dtype: str = "float32"):
  cfg = tiny(v1_1, scan)
  cfg.dtype = dtype
  return jax.jit(functools.partial(t5.apply, cfg))


def hf_outputs(model, b):
  import torch
  with torch.no_grad():
    out = model(**{k: torch.tensor(v, dtype=torch.long) for k, v in b.items()}, output_hidden_states=True)
  return {"logits": out.logits.numpy(), "hidden": out.decoder_hidden_states[-1].numpy(),
          "encoder_hidden": out.encoder_last_hidden_state.numpy()}


def assert_close(got, want):
  for k in ("logits", "hidden", "encoder_hidden"):
    np.testing.assert_allclose(np.asarray(got[k]), want[k], atol=1e-4, rtol=1e-4, err_msg=k)


def save(cfg, params, path):  # TODO(models-core export) -> lm_jax.export.save_hf
  from safetensors.numpy import save_file
  (path / "config.json").write_text(json.dumps(t5.hf_config(cfg)))
  save_file(t5.to_hf(cfg, params), str(path / "model.safetensors"), metadata={"format": "pt"})


def load(path):
  from safetensors.numpy import load_file
  cfg = t5.config_from_hf(json.loads((path / "config.json").read_text()))
  return cfg, t5.from_hf(cfg, load_file(str(path / "model.safetensors")))


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("v1_1", [False, True])
def test_parity_ours_to_hf(v1_1, scan, tmp_path):
  transformers = pytest.importorskip("transformers")
  cfg, params = tiny(v1_1, scan), params_for(v1_1, scan)
  save(cfg, params, tmp_path)
  model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
  b = batch()
  assert_close(apply_fn(v1_1, scan)(params, b), hf_outputs(model, b))
  if v1_1:  # a separate head, not the embeddings
    assert not np.allclose(model.lm_head.weight.detach().numpy(), model.shared.weight.detach().numpy())


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("v1_1", [False, True])
def test_parity_hf_to_ours(v1_1, scan, tmp_path):
  transformers = pytest.importorskip("transformers")
  import torch
  torch.manual_seed(0)
  hf_cfg = transformers.T5Config(**t5.hf_config(tiny(v1_1, scan)))
  model = transformers.T5ForConditionalGeneration(hf_cfg).eval()
  model.save_pretrained(tmp_path)
  cfg, params = load(tmp_path)
  cfg.scan_layers = scan
  assert cfg.to_dict() == tiny(v1_1, scan).to_dict()  # hf_config -> T5Config -> config.json -> config_from_hf
  params = t5.from_hf(cfg, t5.to_hf(cfg, params))  # the scanned layout when asked for
  b = batch()
  assert_close(apply_fn(v1_1, scan)(params, b), hf_outputs(model, b))


@pytest.mark.parametrize("v1_1,scan", [(False, True), (True, False)])
def test_incremental_decoding_matches_full_forward(v1_1, scan):
  cfg, params, b = tiny(v1_1, scan), params_for(v1_1, scan), batch()
  full = apply_fn(v1_1, scan)(params, b)["logits"]
  cache = jax.jit(functools.partial(t5.init_cache, cfg, max_len=9))(params, b)  # spare slots stay masked
  step = jax.jit(functools.partial(t5.decode_step, cfg))
  ids, mask, got = b["decoder_input_ids"], b["decoder_attention_mask"], []
  for start, stop in ((0, 3), (3, 4), (4, 5), (5, 6), (6, 7)):  # a prompt chunk, then single tokens
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


def test_relative_bias_is_one_table_per_stack():
  shapes = jax.tree.map(lambda a: a.shape, t5.abstract_params(tiny(False, True)))
  for stack in ("encoder", "decoder"):
    assert shapes[stack]["relative_bias"] == {"table": {"embedding": (8, 5)}}
    assert "relative_bias" not in shapes[stack]["layers"]


@pytest.mark.parametrize("variant,count", [
    ("small", 60_506_624), ("base", 222_903_552), ("large", 737_668_096),
    ("v1_1_small", 76_961_152), ("v1_1_base", 247_577_856), ("v1_1_large", 783_150_080)])
def test_param_counts(variant, count):
  cfg = t5_configs.get_config(variant).model
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(t5.abstract_params(cfg))) == count


def test_logical_axes_name_every_param():
  cfg = tiny(True, True)
  axes = t5.logical_axes(cfg)
  shapes = t5.abstract_params(cfg)
  for spec, shape in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
                         jax.tree.leaves(shapes)):
    assert len(spec) == len(shape.shape) and all(spec), (spec, shape)
  assert axes["decoder"]["layers"]["self_attention"]["query"]["kernel"] == jax.sharding.PartitionSpec(
      "layers", "embed", "heads", "kv")


def test_dropout_only_in_training():
  cfg, params, b = tiny(False, True), params_for(False, True), batch()
  train = jax.jit(lambda seed: t5.apply(cfg, params, b, rng=jax.random.key(seed), train=True)["logits"])
  np.testing.assert_array_equal(train(0), train(0))
  assert not np.allclose(train(0), train(1))
  assert not np.allclose(train(0), apply_fn(False, True)(params, b)["logits"])  # eval (parity tests) has none
  with pytest.raises(ValueError, match="rng"):
    t5.apply(cfg, params, b, train=True)


def test_bfloat16_compute_tracks_float32():
  params = params_for(True, True)
  want = apply_fn(True, True)(params, batch())
  got = apply_fn(True, True, "bfloat16")(params, batch())
  assert got["hidden"].dtype == jnp.bfloat16 and got["logits"].dtype == jnp.float32
  np.testing.assert_allclose(got["logits"], want["logits"], atol=0.15 * float(np.std(want["logits"])))


@pytest.mark.parametrize("field,value,match", [
    ("num_heads", 3, "divisible by model.num_heads"), ("activation", "swish", "unknown activation"),
    ("num_layers", 0, "num_layers"), ("relative_attention_max_distance", 2, "max_distance")])
def test_impossible_config_fails_clearly(field, value, match):
  cfg = tiny(False, False)
  cfg.head_dim = 0
  cfg[field] = value
  with pytest.raises(ValueError, match=match):
    t5.abstract_params(cfg)

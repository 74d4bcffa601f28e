"""A family owns its facts: the shared model schema holds only what every family has, each family's own fields
(its FIELDS) appear in its config alone, its checks name the field in one line, and its cost model counts what
the model really holds."""
import jax
import jax.numpy as jnp
import pytest

from lm_jax import config_lib, defaults, flops, models
from lm_jax.plan import memory

# What every family has: a field added here must be one that bert, gpt, gpt2, t5 and every new family all read.
SHARED = {"family", "vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "d_ff", "activation", "gated_ffn",
          "layer_norm_eps", "dropout_rate", "attention_dropout_rate", "initializer_range", "dtype", "param_dtype",
          "scan_layers", "remat_policy", "attention", "pad_token_id", "eos_token_id", "frozen_reference"}
NAMES = models.names()
OWN = {name: set(models.family(name).fields) for name in NAMES}


def test_the_shared_schema_holds_no_family_field():
  for name in NAMES:
    shared = set(defaults.model_defaults(name)) - OWN[name]
    assert shared == SHARED, name
  assert not SHARED & set().union(*OWN.values())   # a family's field is never also a shared one
  assert {"max_positions", "type_vocab_size", "use_bias", "relative_attention_num_buckets",
          "num_decoder_layers", "tie_embeddings", "decoder_start_token_id"} <= set().union(*OWN.values())


@pytest.mark.parametrize("name", NAMES)
def test_each_family_has_its_own_fields_and_no_other(name):
  m = defaults.model_defaults(name)
  assert set(m) == SHARED | OWN[name]
  assert {k: m[k] for k in OWN[name]} == models.family(name).fields == defaults.family_fields(name)
  others = set().union(*(OWN[n] for n in NAMES if n != name)) - OWN[name]
  assert not others & set(m), f"{name} has other families' fields {sorted(others & set(m))}"


def test_family_fields_are_overridden_only_where_they_exist():
  assert config_lib.load("configs/t5.py:tiny", {"model.relative_attention_num_buckets": 16}).model[
      "relative_attention_num_buckets"] == 16
  assert config_lib.load("configs/nanogpt.py", ["--config.model.use_bias=true"]).model.use_bias is True
  with pytest.raises(config_lib.ConfigError, match="'model.relative_attention_num_buckets' does not exist"):
    config_lib.load("configs/bert.py:tiny", {"model.relative_attention_num_buckets": 16})
  with pytest.raises(ValueError, match="unknown model.family 'gpt3'"):
    defaults.model_defaults("gpt3")


def _tiny(name, **fields):
  m = defaults.model_defaults(name)
  m.update(dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64, dropout_rate=0.0,
                attention_dropout_rate=0.0) | fields)
  return m


def _error(check, m, *args) -> str:
  with pytest.raises(ValueError) as e:
    check(m, *args)
  return str(e.value)


@pytest.mark.parametrize("name", NAMES)
def test_a_family_check_is_one_line_naming_the_field(name):
  fam = models.family(name)
  models.validate(_tiny(name))
  fam.check_mesh(_tiny(name), {"data": 1, "fsdp": 1, "tensor": 2})
  cases = [(models.validate, _tiny(name, num_heads=3), (), "model.num_heads=3"),
           (models.validate, _tiny(name, num_kv_heads=3), (), "model.num_kv_heads=3"),
           (fam.check_mesh, _tiny(name), ({"data": 1, "fsdp": 1, "tensor": 8},), "config.model.num_heads=4"),
           (fam.check_mesh, _tiny(name, num_heads=8, num_kv_heads=2), ({"data": 1, "fsdp": 1, "tensor": 4},),
            "config.model.num_kv_heads=2")]
  cases += [(models.validate, _tiny(name, **{field: 0}), (), f"model.{field}") for field in fam.sizes]
  for check, m, args, field in cases:
    message = _error(check, m, *args)
    assert field in message and "\n" not in message, (field, message)


def test_attention_flops_count_kv_heads():
  m = _tiny("gpt2")
  assert flops.kv_width(m) == flops.attention_width(m) == 32
  grouped = _tiny("gpt2", num_kv_heads=1)
  assert flops.self_attention(m, 16) - flops.self_attention(grouped, 16) == flops.dense(16, 32, 2 * (32 - 8))
  assert flops.cross_attention(m, 4, 16) - flops.cross_attention(grouped, 4, 16) == flops.dense(16, 32, 2 * 24)


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_bytes_are_the_cache_the_model_builds(name):
  m = _tiny(name, num_layers=3, dtype="bfloat16")
  if models.family(name).layout == "encoder":
    with pytest.raises(ValueError, match="has no decoder"):
      memory.kv_cache_bytes(m, 2, 12)
    return
  batch = {"input_ids": jnp.zeros((2, 5), jnp.int32)}
  cache = jax.eval_shape(lambda p: models.init_cache(m, p, batch, 12), models.abstract_params(m))
  kv = sum(x.size * x.dtype.itemsize for layer in cache["layers"] for x in layer.values())
  assert memory.kv_cache_bytes(m, 2, 12, 5) == kv

"""Models: config errors, scan == loop, masks, sparse MLM head, KV cache, packing.

Random init compiles slowly on CPU (threefry), so each family is initialised once per module and the
scanned layout is derived from the looped one.
"""
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from lm_jax import defaults, models
from lm_jax.models import attention, layers, relayout

IDS = jnp.array([[2, 5, 6, 7, 8, 9, 3], [2, 4, 5, 3, 0, 0, 0]])
MASK = (IDS > 0).astype(jnp.int32)


def tiny(base_family, **fields):
  """Unusual sizes on purpose: head dim 16, odd vocab, d_ff not 4*d."""
  m = defaults.model_defaults(base_family)
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = 101, 48, 2, 3, 80, 32
  m.update(fields)
  return m


_apply = jax.jit(models.apply, static_argnums=0, static_argnames="train")


def run(cfg, params, batch, **kw):
  """Jitted models.apply (one compile per config and shapes; eager flax compiles op by op)."""
  return _apply(ml_collections.FrozenConfigDict(cfg), params, batch, **kw)


def scanned(params):
  """Looped params -> the scan_layers=True layout."""
  return relayout.relayout(params, scan=True)


@pytest.fixture(scope="module")
def bert_params():
  return models.init(tiny("bert"), jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def gpt_params():
  return models.init(tiny("gpt"), jax.random.PRNGKey(0))


@pytest.mark.parametrize("fields,message", [
    (dict(num_heads=5), "num_heads=5 does not divide model.d_model=48"),
    (dict(activation="swish"), "unknown model.activation 'swish'; known: gelu, gelu_tanh, relu"),
    (dict(family="rnn"), "unknown model.family 'rnn'"),
    (dict(d_model=0), "model.d_model must be a positive integer"),
    (dict(vocab_size=-3), "model.vocab_size must be a positive integer"),
    (dict(remat_policy="some"), "unknown model.remat_policy 'some'"),
    (dict(dtype="float8"), "unknown model.dtype 'float8'"),
    (dict(param_dtype="int8"), "unknown model.param_dtype 'int8'"),
    (dict(max_positions=0), "model.max_positions must be a positive integer"),
    (dict(dropout_rate=1.0), "model.dropout_rate must be in"),
])
def test_bad_config_one_line_error(fields, message):
  with pytest.raises(ValueError, match=message) as e:
    models.abstract_params(tiny("bert", **fields))
  assert "\n" not in str(e.value)


def test_head_dim_need_not_divide_width():
  m = tiny("gpt", num_heads=5, head_dim=8)
  p = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), models.abstract_params(m))
  assert p["layers_0"]["attention"]["query"]["kernel"].shape == (48, 5, 8)
  assert run(m, p, {"input_ids": IDS})["logits"].shape == (2, 7, 101)


@pytest.mark.parametrize("family", ["bert", "gpt"])
def test_scan_matches_loop_and_axes(family, bert_params, gpt_params):
  p = {"bert": bert_params, "gpt": gpt_params}[family]
  scan = tiny(family, scan_layers=True, remat_policy="full")
  assert jax.tree.structure(scanned(p)) == jax.tree.structure(models.abstract_params(scan))
  batch = {"input_ids": IDS, "attention_mask": MASK}
  np.testing.assert_allclose(run(tiny(family), p, batch)["logits"], run(scan, scanned(p), batch)["logits"], atol=1e-5)
  axes = models.logical_axes(scan)
  assert axes["layers"]["attention"]["query"]["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "heads", "kv")
  assert axes["word_embeddings"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  assert jax.tree.structure(axes, is_leaf=is_spec) == jax.tree.structure(scanned(p))



def test_relayout_converts_every_stack_both_ways():
  """Nested stacks (T5's encoder and decoder, an adapter tree beside the params) go scanned <-> looped, layer i of
  the looped tree being row i of the scanned one; other params pass through."""
  rng = np.random.default_rng(0)
  stack = lambda: {"mlp": {"wi": {"kernel": rng.normal(size=(3, 4, 5))}}, "ln": {"scale": rng.normal(size=(3, 4))}}
  tree = {"encoder": {"layers": stack(), "final_ln": {"scale": np.ones(4)}}, "decoder": {"layers": stack()},
          "adapters": {"layers": {"mlp": {"wi": {"a": rng.normal(size=(3, 4, 2))}}}},
          "shared": {"embedding": np.ones(2)}}
  looped = relayout.relayout(tree, scan=False)
  assert sorted(looped["encoder"]) == ["final_ln", "layers_0", "layers_1", "layers_2"]
  np.testing.assert_array_equal(looped["decoder"]["layers_2"]["mlp"]["wi"]["kernel"],
                                tree["decoder"]["layers"]["mlp"]["wi"]["kernel"][2])
  np.testing.assert_array_equal(looped["adapters"]["layers_1"]["mlp"]["wi"]["a"],
                                tree["adapters"]["layers"]["mlp"]["wi"]["a"][1])
  assert jax.tree.structure(relayout.relayout(looped, scan=False)) == jax.tree.structure(looped)
  jax.tree.map(np.testing.assert_array_equal, relayout.relayout(looped, scan=True), tree)


def test_remat_policies(gpt_params):
  p = scanned(gpt_params)
  loss = lambda m: jax.grad(lambda p: models.apply(m, p, {"input_ids": IDS})["logits"].std())
  for remat in ("minimal", "full"):   # the policy reaches the traced program (cheap: no compile)
    assert "remat" in str(jax.make_jaxpr(loss(tiny("gpt", scan_layers=True, remat_policy=remat)))(p))
  assert "remat" not in str(jax.make_jaxpr(loss(tiny("gpt", scan_layers=True)))(p))
  full = jax.jit(loss(tiny("gpt", scan_layers=True, remat_policy="full")))(p)
  none = jax.jit(loss(tiny("gpt", scan_layers=True)))(p)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), full, none)


def test_bert_padding_and_sparse_head(bert_params):
  m, p = tiny("bert"), bert_params
  batch = {"input_ids": IDS, "attention_mask": MASK, "token_type_ids": jnp.zeros_like(IDS)}
  full = run(m, p, batch)
  # padding is invisible: the short row alone, unpadded, gives the same outputs
  alone = run(m, p, {k: v[1:, :4] for k, v in batch.items()})
  np.testing.assert_allclose(full["hidden"][1, :4], alone["hidden"][0], atol=1e-5)
  np.testing.assert_allclose(full["nsp_logits"][1], alone["nsp_logits"][0], atol=1e-5)
  positions = jnp.array([[1, 4, 6], [0, 2, 2]])
  sparse = run(m, p, {**batch, "mlm_positions": positions})
  assert sparse["logits"].shape == (2, 3, 101)
  np.testing.assert_allclose(sparse["logits"], jnp.take_along_axis(full["logits"], positions[..., None], 1), atol=1e-5)


def test_dropout_only_in_training(bert_params):
  m, p = tiny("bert", dropout_rate=0.1, attention_dropout_rate=0.1), bert_params
  batch = {"input_ids": IDS, "attention_mask": MASK}
  a = run(m, p, batch, rng=jax.random.PRNGKey(1), train=True)["logits"]
  b = run(m, p, batch, rng=jax.random.PRNGKey(1), train=True)["logits"]
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - run(m, p, batch)["logits"]).max() > 1e-3
  with pytest.raises(ValueError, match="needs an rng"):
    models.apply(m, p, batch, train=True)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_mask_statistics(rate):
  """The hashed keep mask behaves like independent Bernoulli draws: rate within 4 sigma over 2M elements,
  no correlation between neighbours (the two 16-bit halves of one hash word included), nor across keys,
  nor between rows; survivors scaled so the expectation is unchanged."""
  x = jnp.ones((64, 128, 256), jnp.float32)
  drop = jax.jit(layers.dropout, static_argnums=1)
  a, b = (np.asarray(drop(x, rate, jax.random.key(i))) for i in (0, 1))
  keep_a, keep_b = (a > 0).astype(np.float64), (b > 0).astype(np.float64)
  n, sigma = keep_a.size, np.sqrt(rate * (1 - rate) / keep_a.size)
  assert abs(1 - keep_a.mean() - rate) < 4 * sigma
  np.testing.assert_allclose(np.unique(a), [0.0, 1 / (1 - round(rate * 2**16) / 2**16)], rtol=1e-6)
  assert abs(a.mean() - 1) < 4 * sigma / (1 - rate) * 1.1
  corr = lambda u, w: np.corrcoef(u.ravel(), w.ravel())[0, 1]
  bound = 4 / np.sqrt(n)
  assert abs(corr(keep_a[..., 0::2], keep_a[..., 1::2])) < 2 * bound   # halves of one word
  assert abs(corr(keep_a[..., 1:-1:2], keep_a[..., 2::2])) < 2 * bound  # across words
  assert abs(corr(keep_a[1:], keep_a[:-1])) < bound                     # consecutive rows
  assert abs(corr(keep_a, keep_b)) < bound                              # two keys
  np.testing.assert_array_equal(a, np.asarray(drop(x, rate, jax.random.key(0))))  # replayable


def test_dropout_mask_is_the_same_under_any_sharding():
  mesh = jax.make_mesh((len(jax.devices()),), ("d",))
  x = jnp.ones((len(jax.devices()) * 2, 6, 10), jnp.float32)
  drop = jax.jit(layers.dropout, static_argnums=1)
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
  np.testing.assert_array_equal(drop(sharded, 0.3, jax.random.key(3)), drop(x, 0.3, jax.random.key(3)))
  odd = drop(jnp.ones((3, 7)), 0.3, jax.random.key(3))   # odd last dim: the last word's second half unused
  assert odd.shape == (3, 7) and 0 < int((odd == 0).sum()) < 21


@pytest.mark.parametrize("scan", [False, True])
def test_gpt_kv_cache_matches_full_forward(scan, gpt_params):
  m, p = tiny("gpt", scan_layers=scan), scanned(gpt_params) if scan else gpt_params
  full = run(m, p, {"input_ids": IDS, "attention_mask": MASK})["logits"]
  step = jax.jit(functools.partial(models.decode_step, m))
  cache = models.init_cache(m, p, {"input_ids": IDS}, 10)
  logits, cache = step(p, IDS[:, :3], cache, MASK[:, :3])   # the prompt in one call
  out = [logits]
  for t in range(3, IDS.shape[1]):
    logits, cache = step(p, IDS[:, t:t + 1], cache, MASK[:, t:t + 1])
    out.append(logits)
  assert int(cache["index"]) == 7
  real = np.asarray(MASK, bool)
  np.testing.assert_allclose(np.concatenate(out, 1)[real], np.asarray(full)[real], atol=1e-5)
  with pytest.raises(ValueError, match="exceeds model.max_positions 32"):
    models.init_cache(m, p, {"input_ids": IDS}, 33)


def test_gpt_packed_row_equals_documents_alone(gpt_params):
  m, p = tiny("gpt"), gpt_params
  docs = [[5, 6, 7], [8, 9, 10, 11], [12]]
  ids = jnp.array([sum(docs, []) + [0]])
  segments = jnp.array([[1] * 3 + [2] * 4 + [3] + [0]])
  positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0, 0]])
  packed = run(m, p, {"input_ids": ids, "segment_ids": segments, "positions": positions})["logits"][0]
  alone = run(m, p, {"input_ids": jnp.array([docs[1] + [0] * 5])})["logits"][0]   # doc 2, right-padded
  np.testing.assert_allclose(packed[3:7], alone[:4], atol=1e-5)
  first = run(m, p, {"input_ids": ids[:, :3]})["logits"][0]
  np.testing.assert_allclose(packed[:3], first, atol=1e-5)
  unsegmented = run(m, p, {"input_ids": ids, "positions": positions})["logits"][0]
  assert np.abs(unsegmented[3:7] - alone[:4]).max() > 1e-3   # the test would notice leaking


def test_attention_matches_jax_reference_with_mask_bias_and_grads():
  """Our explicit attention (always used on CPU, and for dropout) against jax.nn.dot_product_attention,
  values and gradients, including the batch-shared bias whose gradient has a custom batch sum."""
  rng = np.random.default_rng(0)
  q, k, v = jnp.asarray(rng.normal(size=(3, 2, 5, 3, 8)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(1, 3, 5, 5)), jnp.float32)
  mask = attention.make_attention_mask(jnp.array([[1, 1, 1, 0, 0], [1] * 5]), causal=True, q_len=5, kv_len=5)
  ours = lambda q, k, v, b: (attention.dot_product_attention(q, k, v, mask=mask, bias=b) ** 2).sum()
  ref = lambda q, k, v, b: (jax.nn.dot_product_attention(q, k, v, mask=mask, bias=b) ** 2).sum()
  np.testing.assert_allclose(ours(q, k, v, bias), ref(q, k, v, bias), rtol=1e-5)
  for a, b in zip(jax.grad(ours, (0, 1, 2, 3))(q, k, v, bias), jax.grad(ref, (0, 1, 2, 3))(q, k, v, bias)):
    np.testing.assert_allclose(a, b, atol=1e-4)
  explicit = attention.dot_product_attention(q, k, v, mask=mask, bias=bias, dropout_rate=1e-9,
                                          dropout_rng=jax.random.PRNGKey(2))
  np.testing.assert_allclose(explicit, jax.nn.dot_product_attention(q, k, v, mask=mask, bias=bias), atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_causal_attention_in_query_blocks_matches_jax_reference(kv_heads):
  """A causal model's self-attention of T >= 128 on a CPU runs in blocks of queries against the keys up to each
  block's last row (attention._causal_rows): values and gradients still equal jax.nn.dot_product_attention's, with
  padding, a bias and grouped kv heads, and no (T, T) logits are formed."""
  T = 256
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, T, 4, 8)), jnp.float32)
  k, v = jnp.asarray(rng.normal(size=(2, 2, T, kv_heads, 8)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=(1, 4, T, T)), jnp.float32)
  mask = attention.make_attention_mask(jnp.arange(T)[None] < jnp.array([[T], [T - 37]]), causal=True, q_len=T,
                                       kv_len=T)

  def ours(q, k, v, b):
    with attention.attention_kernel("xla", True):
      return (attention.dot_product_attention(q, k, v, mask=mask, bias=b) ** 2).sum()

  ref = lambda q, k, v, b: (jax.nn.dot_product_attention(q, k, v, mask=mask, bias=b) ** 2).sum()
  np.testing.assert_allclose(ours(q, k, v, bias), ref(q, k, v, bias), rtol=1e-5)
  for a, b in zip(jax.grad(ours, (0, 1, 2, 3))(q, k, v, bias), jax.grad(ref, (0, 1, 2, 3))(q, k, v, bias)):
    np.testing.assert_allclose(a, b, atol=1e-4)
  jaxpr = jax.make_jaxpr(jax.grad(ours, (0, 1, 2)))(q, k, v, bias).jaxpr
  shapes = [var.aval.shape for eqn in jaxpr.eqns for var in eqn.outvars if eqn.primitive.name == "dot_general"]
  assert shapes and all(s[-2:] != (T, T) for s in shapes), shapes


def test_bfloat16_compute_keeps_float32_params(bert_params):
  batch = {"input_ids": IDS, "attention_mask": MASK}
  out = run(tiny("bert", dtype="bfloat16"), bert_params, batch)
  assert out["hidden"].dtype == jnp.bfloat16 and out["logits"].dtype == jnp.float32
  ref = run(tiny("bert"), bert_params, batch)["logits"]
  assert np.abs(out["logits"] - ref).max() < 0.1
  abstract = models.abstract_params(tiny("bert", dtype="bfloat16"))
  assert {a.dtype for a in jax.tree.leaves(abstract)} == {jnp.dtype("float32")}


def test_frozen_config_accepted(gpt_params):
  m = ml_collections.FrozenConfigDict(tiny("gpt"))
  assert models.count(models.abstract_params(m)) == models.count(gpt_params) == 101 * 48 + 32 * 48 + 2 * (4 * 48 * 48 + 4 * 48 + 2 * 48 * 80 + 80 + 48 + 4 * 48)

"""NF4 with double quantisation (lm_jax.models.nf4) against bitsandbytes' quantize_4bit / dequantize_4bit on CPU."""
import contextlib
import io

import jax
import jax.numpy as jnp
from jax import ad_checkpoint
import numpy as np
import pytest

from lm_jax import config_lib, models
from lm_jax.models import nf4

bnb_functional = pytest.importorskip("bitsandbytes.functional")
torch = pytest.importorskip("torch")

# (300, 70): 329 blocks of 64 (two of 256 for double quantisation) with a partial last block; (129, 5): odd size;
# (7,): less than a block. The first block of (300, 70) is all zeros.
SHAPES = [(300, 70), (129, 5), (7,)]

def _bits_per_param(tree) -> float:
  """Storage bits per represented parameter (nf4.storage)."""
  nbytes, params = nf4.storage(tree)
  return 8 * nbytes / params



def _weight(shape, seed):
  w = (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)
  w.reshape(-1)[:64 if w.size > 64 else 0] = 0
  return w


@pytest.fixture(scope="module")
def reference():
  """(shape, double_quant) -> (w, bitsandbytes' packed codes, QuantState, its dequantised weight, plain absmax)."""
  out = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(torch._dynamo.config, "disable", True)  # bitsandbytes compiles its odd-shape dequantisation
    for seed, shape in enumerate(SHAPES):
      w = _weight(shape, seed)
      for dq in (False, True):
        packed, state = bnb_functional.quantize_4bit(torch.from_numpy(w), blocksize=64, compress_statistics=dq,
                                                     quant_type="nf4")
        plain = state.absmax if not dq else bnb_functional.quantize_4bit(
            torch.from_numpy(w), blocksize=64, quant_type="nf4")[1].absmax
        out[shape, dq] = (w, packed, state, bnb_functional.dequantize_4bit(packed, state).numpy(), plain.numpy())
  return out


def test_code_tables_are_bitsandbytes():
  assert np.array_equal(nf4.NF4_VALUES, bnb_functional.get_4bit_type("nf4", device="cpu").numpy())
  assert np.array_equal(nf4.DYNAMIC_VALUES, bnb_functional.create_dynamic_map().numpy())


@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_bitsandbytes(reference, shape):
  w, packed, state, deq, _ = reference[shape, False]
  q = nf4.quantize(jnp.asarray(w), double_quant=False)
  assert q.codes.dtype == jnp.uint8 and np.array_equal(q.codes, packed.numpy().reshape(-1))
  assert np.array_equal(q.absmax, state.absmax.numpy())
  assert q.absmax.dtype == jnp.float32 and q.absmax_scale is None and q.absmax_mean is None
  assert np.array_equal(nf4.dequantize(q), deq)


@pytest.mark.parametrize("shape", SHAPES)
def test_double_quantize_matches_bitsandbytes(reference, shape):
  w, packed, state, deq, plain = reference[shape, True]
  q = nf4.quantize(jnp.asarray(w))
  assert np.array_equal(q.codes, packed.numpy().reshape(-1))
  # the mean of the absmax values is a float32 sum, whose last bit depends on the summation order
  np.testing.assert_allclose(q.absmax_mean, state.offset.numpy(), rtol=1e-6)
  theirs = state.absmax.numpy()
  assert q.absmax.dtype == jnp.uint8 and np.abs(q.absmax.astype(int) - theirs.astype(int)).max() <= 1
  assert np.mean(q.absmax != theirs) <= 0.01
  np.testing.assert_allclose(q.absmax_scale, state.state2.absmax.numpy(), rtol=1e-6)
  # given bitsandbytes' mean, the 8-bit statistics are bit for bit its own
  codes, scale = nf4.quantize_dynamic(jnp.asarray(plain - state.offset.numpy()))
  assert np.array_equal(codes, theirs) and np.array_equal(scale, state.state2.absmax.numpy())
  # dequantising bitsandbytes' own statistics and codes gives its weight (XLA may fuse a multiply-add)
  theirs_q = nf4.NF4(jnp.asarray(packed.numpy().reshape(-1)), jnp.asarray(theirs),
                     jnp.asarray(state.state2.absmax.numpy()), jnp.asarray(state.offset.numpy()),
                     shape, "float32", 64, 256)
  np.testing.assert_allclose(nf4.dequantize(theirs_q), deq, rtol=1e-6, atol=0)
  np.testing.assert_allclose(nf4.dequantize(q), deq, rtol=1e-3, atol=1e-4)


def test_bits_per_param():
  n = 64 * 256 * 4
  assert _bits_per_param(nf4.quantize(jnp.ones((n,)))) == 4 + 8 / 64 + 32 / (64 * 256) + 32 / n
  assert _bits_per_param(nf4.quantize(jnp.ones((n,)), double_quant=False)) == 4 + 32 / 64
  abstract = jax.eval_shape(nf4.quantize, jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16))
  assert _bits_per_param(abstract) == pytest.approx(4.127, abs=1e-3)


def test_dequantize_jits_to_any_dtype():
  w = jnp.asarray(_weight((96, 40), 3)).astype(jnp.bfloat16)
  q = nf4.quantize(w)
  assert (q.shape, q.dtype) == ((96, 40), "bfloat16")
  assert jax.tree.structure(q) == jax.tree.structure(jax.eval_shape(nf4.quantize, w))
  out = nf4.dequantize(q, dtype=jnp.bfloat16)
  assert out.shape == (96, 40) and out.dtype == jnp.bfloat16
  assert np.array_equal(out, nf4.dequantize(q).astype(jnp.bfloat16))
  assert np.abs(nf4.dequantize(q) - w.astype(jnp.float32)).max() <= 0.16 * np.abs(w.astype(jnp.float32)).max()


def test_a_scanned_stack_is_quantised_layer_by_layer_and_dequantised_inside_the_matmul():
  """quantize_tree(stacked=...) = each layer quantised alone (as bitsandbytes quantises each Linear), its storage
  counts every layer, and nf4.matmul equals the matmul with the dequantised kernel, gradient included, without
  keeping the float kernel for the backward pass."""
  w = jnp.asarray(_weight((3, 64, 48), 5))
  q = nf4.quantize_tree({"layers": {"kernel": w}}, ["kernel$"], stacked=["^layers/"])["layers"]["kernel"]
  assert nf4.layers(q) == (3,) and q.shape == (64, 48)
  for i in range(3):
    alone = nf4.quantize(w[i])
    for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(jax.tree.map(lambda a: a[i], q))):
      np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(nf4.dequantize(q), np.stack([nf4.dequantize(nf4.quantize(w[i])) for i in range(3)]))
  assert nf4.storage(q)[1] == w.size
  one = jax.tree.map(lambda a: a[1], q)
  x = jnp.asarray(_weight((5, 64), 6))
  contract = ((1,), (0,))
  loss = lambda x: jnp.sum(nf4.matmul(x, one, contract, jnp.float32) ** 2)
  want = lambda x: jnp.sum((x @ nf4.dequantize(one)) ** 2)
  np.testing.assert_allclose(loss(x), want(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(loss)(x), jax.grad(want)(x), rtol=1e-5, atol=1e-6)
  out = io.StringIO()   # what the backward pass keeps: x and the NF4 parts, no float (64, 48) kernel
  with contextlib.redirect_stdout(out):
    ad_checkpoint.print_saved_residuals(loss, x)
  assert "f32[64,48]" not in out.getvalue() and "u8[" in out.getvalue(), out.getvalue()


def test_tree_round_trip_and_checkpoint(tmp_path):
  import orbax.checkpoint as ocp
  config = config_lib.load("configs/gpt1.py:tiny", {"model.d_model": 32, "model.num_heads": 2, "model.d_ff": 128,
                                                    "model.num_layers": 1, "model.vocab_size": 256})
  params = models.init(config.model, jax.random.key(0))
  q = nf4.quantize_tree(params, [r"mlp/.*/kernel$", r"attention/query/kernel$"])
  paths = {nf4._path(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  quantised = {nf4._path(p): x for p, x in jax.tree_util.tree_flatten_with_path(q, is_leaf=nf4.is_nf4)[0]}
  assert paths.keys() == quantised.keys()
  hits = {p for p, x in quantised.items() if isinstance(x, nf4.NF4)}
  assert hits and all(("mlp/" in p or "attention/query/" in p) and p.endswith("kernel") for p in hits)
  assert all(quantised[p] is paths[p] for p in paths.keys() - hits)
  back = nf4.dequantize_tree(q)
  for p, x in jax.tree_util.tree_flatten_with_path(back)[0]:
    ref = paths[nf4._path(p)]
    assert x.shape == ref.shape and x.dtype == ref.dtype
    bound = 0.16 * np.abs(ref).max() if nf4._path(p) in hits else 0
    assert np.abs(np.asarray(x, np.float32) - np.asarray(ref, np.float32)).max() <= bound
  # orbax keeps the arrays; the static shapes come back from the abstract tree of the same quantize_tree
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "q", q)
  ckpt.wait_until_finished()
  abstract = jax.eval_shape(lambda p: nf4.quantize_tree(p, [r"mlp/.*/kernel$", r"attention/query/kernel$"]), params)
  restored = ckpt.restore(tmp_path / "q", abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(q)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(q)))


def test_memory_report_counts_nf4_weights_as_the_params_they_stand_for():
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

  from lm_jax import sharding
  from lm_jax.plan import memory
  config = config_lib.load("configs/bert.py:tiny")
  abstract = models.abstract_params(config.model)
  quantised = jax.eval_shape(lambda p: nf4.quantize_tree(p, [r"kernel$"]), abstract)
  mesh = AbstractMesh((1, 1, 1), sharding.AXES)
  replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), quantised)
  nbytes, count = memory.param_bytes(quantised, replicated)
  kernels = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0] if nf4._path(p).endswith("kernel"))
  assert (nbytes, count) == (nf4.storage(quantised)[0], models.count(abstract))
  assert nbytes < 4 * (count - kernels) + 0.6 * kernels


def test_memory_estimate_of_a_qlora_run():
  from lm_jax import params
  from lm_jax.plan import memory
  config = config_lib.load("configs/finetune/bert.py:tiny", {"lora.rank": 8, "lora.qlora": True})
  est = memory.estimate(config, mesh=(1, 1, 1))
  trainable, total = params.count(config)
  assert est.param_count == total and est.grads == 4 * trainable
  plain = memory.estimate(config_lib.load("configs/finetune/bert.py:tiny", {"lora.rank": 8}), mesh=(1, 1, 1))
  assert plain.param_count == total and est.params < plain.params
  assert "bytes/param" in str(est)

"""config.model.attention: the cuDNN path (jax.nn.dot_product_attention, XLA's implementation on a CPU) and Pallas
splash attention (interpreted on a CPU) give the explicit XLA form's outputs and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_jax import config_lib, models
from lm_jax.models import attention

B, T, H, D = 2, 128, 2, 16


def _inputs(causal):
  q, k, v = jax.random.normal(jax.random.key(0), (3, B, T, H, D))
  valid = jnp.arange(T)[None, :] < jnp.array([[T], [T - 7]])          # the second row is right-padded
  mask = valid[:, None, None, :]
  if causal:
    mask = mask & jnp.tril(jnp.ones((T, T), bool))[None, None]
  return q, k, v, mask, valid


@pytest.mark.parametrize("causal", [False, True], ids=["padding", "causal+padding"])
@pytest.mark.parametrize("kernel", ["cudnn", "splash"])
def test_kernels_equal_xla(kernel, causal):
  q, k, v, mask, valid = _inputs(causal)

  def loss(kernel_name, q, k, v):
    with attention.attention_kernel(kernel_name, causal):
      out = attention.dot_product_attention(q, k, v, mask=mask)
    return jnp.sum(jnp.where(valid[:, :, None, None], out, 0.0) ** 2), out

  (ref_loss, ref), ref_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)("xla", q, k, v)
  (got_loss, got), got_grads = jax.value_and_grad(loss, argnums=(1, 2, 3), has_aux=True)(kernel, q, k, v)
  rows = np.asarray(valid)
  np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(ref)[rows], atol=2e-5, rtol=2e-5)
  for g, r in zip(got_grads, ref_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=5e-5)


def test_splash_gpt_model_equals_xla():
  config = config_lib.load("configs/gpt1.py:tiny", {"model.num_layers": 1})
  params = models.init(config.model, jax.random.key(0))
  batch = {"input_ids": jnp.arange(2 * 128).reshape(2, 128) % 100, "attention_mask": jnp.ones((2, 128), jnp.int32)}
  ref = models.apply(config.model, params, batch)
  config.model.attention = "splash"
  got = models.apply(config.model, params, batch)
  np.testing.assert_allclose(np.asarray(jax.tree.leaves(got)[0]), np.asarray(jax.tree.leaves(ref)[0]), atol=1e-4)


def test_unknown_kernel_or_attention_dropout_is_one_line():
  config = config_lib.load("configs/gpt1.py:tiny", {"model.attention": "flash"})
  with pytest.raises(ValueError, match="unknown model.attention 'flash'; known: xla, cudnn, splash"):
    models.validate(config.model)
  config = config_lib.load("configs/gpt1.py:tiny", {"model.attention": "splash", "model.attention_dropout_rate": 0.1})
  with pytest.raises(ValueError, match="model.attention='splash' has no dropout on the attention probabilities"):
    models.validate(config.model)

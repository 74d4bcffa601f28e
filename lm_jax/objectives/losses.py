"""Weighted token cross-entropy returning SUMS, so a step can divide by global denominators and microbatch
accumulation gives exactly the full-batch value."""
import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, weights, *, z_loss=0.0, label_smoothing=0.0):
  """logits (..., V) any float dtype, targets (...) int, weights (...) -> dict of float32 weighted sums:
    loss:    the training loss: (1-ls) * nll + ls * mean_v(-log p_v) + z_loss * log(Z)^2
             (label smoothing as torch's CrossEntropyLoss: target (1-ls)*onehot + ls/V; z-loss as PaLM / T5X)
    nll:     plain -log p(target), for perplexity and bits per byte
    correct: argmax == target
  Computed in float32 even for bf16 logits; positions with weight 0 contribute exactly 0.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  nll = log_z - jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  loss = nll
  if label_smoothing:
    loss = (1.0 - label_smoothing) * nll + label_smoothing * (log_z - logits.mean(-1))
  if z_loss:
    loss = loss + z_loss * jnp.square(log_z)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  weights = weights.astype(jnp.float32)
  total = lambda x: jnp.sum(jnp.where(weights != 0, x * weights, 0.0))
  return dict(loss=total(loss), nll=total(nll), correct=total(correct))


def options(config) -> dict:
  """The token-loss options of a config: z-loss weight and label smoothing (0 = off, the papers' setting)."""
  return dict(z_loss=float(config.get("z_loss", 0.0)), label_smoothing=float(config.get("label_smoothing", 0.0)))

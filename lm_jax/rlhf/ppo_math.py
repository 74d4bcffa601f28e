"""PPO's arithmetic on (B, N) response tensors, as pure functions (Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"; Ouyang et al. 2022; the formulas of TRL's PPOTrainer).

Column t of a response tensor is response token t: its log-probability under the policy that sampled it, the value
of the state before it, its reward. `mask` is 1 on the response's tokens (up to and including EOS), 0 on the
padding after it; every sum and mean runs over the mask only.
"""
import jax
import jax.numpy as jnp


def masked_sum(x, mask):
  return jnp.sum(jnp.where(mask != 0, x * mask, 0.0))


def masked_mean(x, mask):
  return masked_sum(x, mask) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_var(x, mask):
  """Unbiased (Bessel-corrected) variance of x over the mask, as TRL's masked_var."""
  n = jnp.sum(mask)
  centered = x - masked_mean(x, mask)
  return masked_mean(jnp.square(centered), mask) * n / jnp.maximum(n - 1, 1.0)


def whiten(x, mask, shift_mean: bool = True):
  """(x - mean) / sqrt(var + 1e-8) over the mask; shift_mean=False adds the mean back (TRL's masked_whiten)."""
  mean, var = masked_mean(x, mask), masked_var(x, mask)
  out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
  return out if shift_mean else out + mean


def token_rewards(logprobs, ref_logprobs, scores, mask, kl_coef):
  """Per-token reward -kl_coef * (logprob - ref_logprob), plus each sequence's score at its last response token
  -> (rewards (B, N), kl (B, N)): the KL penalty keeps the policy near the reference (Ziegler et al. eq. 2)."""
  kl = jnp.where(mask != 0, logprobs - ref_logprobs, 0.0)
  last = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.int32) - 1, 0)
  at_last = jax.nn.one_hot(last, mask.shape[1], dtype=kl.dtype)
  return -kl_coef * kl + scores[:, None] * at_last, kl


def gae(rewards, values, mask, gamma: float, lam: float):
  """Generalised advantage estimation (Schulman et al. 2016) -> (advantages, returns = advantages + values), both
  (B, N). The value after the last response token is 0 (the episode ends); masked columns contribute nothing."""
  rewards, values = rewards * mask, values * mask
  next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
  deltas = rewards + gamma * next_values - values

  def back(carry, delta):
    carry = delta + gamma * lam * carry
    return carry, carry
  _, adv = jax.lax.scan(back, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
  advantages = adv.T * mask
  return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float, den=None):
  """Clipped surrogate (Schulman et al. 2017 eq. 7): sum over the mask of max(-A r, -A clip(r, 1 +- eps)) / den
  (den: the number of response tokens when None). -> (loss, {clip_frac, approx_kl}), both also sums / den;
  approx_kl = 0.5 * (log r)^2 per token."""
  den = jnp.sum(mask) if den is None else den
  diff = logprobs - old_logprobs
  ratio = jnp.exp(diff)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
  loss = masked_sum(jnp.maximum(unclipped, clipped), mask) / den
  return loss, {"clip_frac": masked_sum((clipped > unclipped).astype(jnp.float32), mask) / den,
                "approx_kl": masked_sum(0.5 * jnp.square(diff), mask) / den}


def value_loss(values, old_values, returns, mask, cliprange_value: float, den=None):
  """Clipped value loss (TRL): 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), summed over the mask / den
  -> (loss, {value_clip_frac})."""
  den = jnp.sum(mask) if den is None else den
  unclipped = jnp.square(values - returns)
  clipped = jnp.square(jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value) - returns)
  loss = 0.5 * masked_sum(jnp.maximum(unclipped, clipped), mask) / den
  return loss, {"value_clip_frac": masked_sum((clipped > unclipped).astype(jnp.float32), mask) / den}


def entropy(logits):
  """Entropy of softmax(logits) over the last axis."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, horizon: float, n_steps: int) -> float:
  """Ziegler et al.'s adaptive KL controller (§2.2): beta *= 1 + clip(KL / target - 1, +-0.2) * n_steps / horizon,
  with KL the batch's mean summed KL per sequence and n_steps its number of sequences."""
  error = min(max(kl / target - 1.0, -0.2), 0.2)
  return kl_coef * (1.0 + error * n_steps / horizon)

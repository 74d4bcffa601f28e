"""PPO's scoring: ONE jitted pass over prompt + response gives the policy's and the frozen reference's
log-probabilities of the response tokens, the value model's values and the reward model's score at the last response
token (or an exact reward of the text, config.ppo.reward_fn, computed on the host: exact_rewards); from them the
per-token rewards -beta * (logp - ref_logp) with the score added at the last token, GAE advantages (whitened) and
returns: the update's targets (lm_jax/rlhf/ppo_math.py holds the formulas).

The models are read as the train step reads them (LoRA adapters applied unmerged), so the first update's ratio is
exactly 1. The update (update.py) trains the same log-probabilities and values; the trainer (ppo.py) calls both.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import models, params as params_lib
from lm_jax.objectives import reward as reward_lib
from lm_jax.rlhf import ppo_math


def inputs(batch) -> dict:
  return {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}


def _responses(config, x):
  """Columns of a (B, prompt_len + max_new_tokens, ...) output that predict (or value) the response tokens."""
  p = config.ppo
  return x[:, p.prompt_len - 1:p.prompt_len - 1 + p.max_new_tokens]


def policy_out(config, params, batch):
  """(log-probabilities of the response tokens (B, N), the response positions' logits / temperature (B, N, V))."""
  logits = _responses(config, models.apply(config.model, params, inputs(batch))["logits"]) / config.ppo.temperature
  tokens = batch["input_ids"][:, config.ppo.prompt_len:]
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], axis=-1)[..., 0]
  return logprobs, logits


def values(config, params, batch):
  """The value model's value at each response position (B, N)."""
  return _responses(config, models.apply(config.model, params, inputs(batch))["scores"])[..., 0]


def _as_in_step(policy, fn, params, batch):
  """fn(config, params, batch) outside the train step, adapters applied as the step applies them (policy: the
  model's params.Policy)."""
  with params_lib.running(policy, train=False):
    return fn(policy.config, params, batch)


def exact_rewards(tokenizer, reward_fn, prompts, responses) -> np.ndarray:
  """reward_fn(prompt text, response text) per rollout; ids past the tokenizer's pieces (a model vocabulary larger
  than the tokenizer) and EOS have no text."""
  text = lambda ids: tokenizer.decode([i for i in ids if i < tokenizer.vocab_size and i != tokenizer.eos_id])
  return np.array([reward_fn(text(q), text(r)) for q, r in zip(prompts, responses)], np.float32)


def scoring_pass(policy_run, value_run, reward_model, mesh):
  """Jitted (policy, reference, value, reward-model params, rollout batch, beta) -> the rollouts' update targets
  (logprobs, values, advantages, returns) and their per-sequence statistics, replicated (policy_run,
  value_run: the two models' params.Policy). Without a reward model the batch carries the exact rewards as
  'scores'."""
  p = policy_run.config.ppo

  def score(policy, reference, value, reward, batch, kl_coef):
    mask = batch["response_mask"]
    logprobs, logits = _as_in_step(policy_run, policy_out, policy, batch)
    ref_logprobs, _ = _as_in_step(policy_run, policy_out, reference, batch)
    value_of = _as_in_step(value_run, values, value, batch) * mask
    scores = reward_lib.sequence_rewards(reward_model, reward, inputs(batch)) if reward_model else batch["scores"]
    token_rewards, kl = ppo_math.token_rewards(logprobs, ref_logprobs, scores, mask, kl_coef)
    advantages, returns = ppo_math.gae(token_rewards, value_of, mask, p.gamma, p.lam)
    targets = dict(logprobs=logprobs * mask, values=value_of, advantages=ppo_math.whiten(advantages, mask) * mask,
                   returns=returns)
    stats = dict(scores=scores, kl=jnp.sum(kl, axis=1), entropy=jnp.sum(ppo_math.entropy(logits) * mask, axis=1),
                 length=jnp.sum(mask, axis=1))
    return targets, stats

  return jax.jit(score, out_shardings=NamedSharding(mesh, P()))

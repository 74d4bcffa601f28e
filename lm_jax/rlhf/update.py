"""PPO's update: config.ppo.epochs passes over the scored rollouts in config.ppo.minibatches shuffled minibatches,
each a policy step (clipped surrogate, plus config.ppo.ptx_coef times the LM loss on a pre-training batch: PPO-ptx)
and a value step (clipped value loss). Both are lm_jax.step's jitted train step on the mesh, each model with its own
optimizer (Part), so microbatches, frozen parameters and the optimizers work as in pre-training. Everything runs
without dropout: an iteration's first update has ratio 1.

Builds on the scoring pass's model reads (scoring.py); the trainer (ppo.py) builds the Parts and runs `epochs`.
"""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import layout as layout_lib, sharding, step
from lm_jax.objectives import clm
from lm_jax.rlhf import ppo_math, rollout, scoring


def _policy_loss(config, params, batch, den, *, rng=None, train=False):
  """Clipped surrogate over the minibatch's response tokens, plus ptx_coef * the LM loss of its ptx rows."""
  del rng, train   # no dropout: the ratio of the first update is exactly 1
  logprobs, _ = scoring.policy_out(config, params, batch)
  loss, metrics = ppo_math.policy_loss(logprobs, batch["logprobs"], batch["advantages"], batch["response_mask"],
                                       config.ppo.cliprange, den["tokens"])
  metrics["policy_loss"] = loss
  if config.ppo.ptx_coef:
    lm_loss, lm = clm.loss(config, params, _ptx(batch), {"tokens": den["ptx_tokens"]})
    loss = loss + config.ppo.ptx_coef * lm_loss
    metrics["ptx_loss"] = lm["token_loss"]
  return loss, dict(metrics, loss=loss)


def _ptx(batch):
  """The pre-training rows of a PPO-ptx minibatch (features ptx_*), as the clm objective reads them."""
  return {k.removeprefix("ptx_"): v for k, v in batch.items() if k.startswith("ptx_")}


def _response_tokens(batch):
  return {"tokens": jnp.maximum(jnp.sum(batch["response_mask"]), 1.0)}


def _policy_denominators(batch):
  den = _response_tokens(batch)
  if "ptx_input_ids" in batch:
    den["ptx_tokens"] = clm.denominators(_ptx(batch))["tokens"]
  return den


def _value_loss(config, params, batch, den, *, rng=None, train=False):
  del rng, train
  loss, metrics = ppo_math.value_loss(scoring.values(config, params, batch), batch["values"], batch["returns"],
                                      batch["response_mask"], config.ppo.cliprange_value, den["tokens"])
  return loss, dict(metrics, loss=loss, value_loss=loss)


POLICY = types.SimpleNamespace(loss=_policy_loss, denominators=_policy_denominators)
VALUE = types.SimpleNamespace(loss=_value_loss, denominators=_response_tokens)


@dataclasses.dataclass(frozen=True)
class Part:
  """One trained model: its config (model, optimizer, update-counting schedule), params policy and jitted update."""
  config: object
  policy: object       # its params.Policy
  tx: object
  abstract: dict
  sharding: dict
  update: object


def part(config, mesh, rules, objective) -> Part:
  """The model of `config` trained on `objective` (POLICY or VALUE) by lm_jax.step's train step."""
  lay = layout_lib.build(config, mesh, rules)
  return Part(config, lay.policy, lay.tx, lay.abstract_state, lay.state_sharding,
              step.make_train_step(lay.policy, objective, lay.tx, lay.lr_schedule, lay.state_sharding, mesh))


def epochs(policy: Part, value: Part, states: tuple, rollouts: dict, gen: np.random.Generator, ptx_it,
           batch_sh) -> tuple[dict, dict, dict]:
  """(policy state, value state) after the epochs of minibatch updates on `rollouts` (global rows, shuffled by gen;
  ptx_it: the PPO-ptx stream or None) -> (policy state, value state, the updates' mean metrics)."""
  c = policy.config
  (policy_state, value_state), metrics = states, []
  for _ in range(c.ppo.epochs):
    for idx in np.split(gen.permutation(len(rollouts["input_ids"])), c.ppo.minibatches):
      minibatch = sharding.global_batch(rollout.local({k: v[idx] for k, v in rollouts.items()}), batch_sh)
      extra = {f"ptx_{k}": v for k, v in sharding.global_batch(next(ptx_it), batch_sh).items()} if ptx_it else {}
      policy_state, policy_metrics = policy.update(policy_state, {**minibatch, **extra})
      value_state, value_metrics = value.update(value_state, minibatch)
      metrics.append({**{k: policy_metrics[k] for k in ("policy_loss", "clip_frac", "approx_kl", "grad_norm", "lr")},
                      **({"ptx_loss": policy_metrics["ptx_loss"]} if ptx_it else {}),
                      "value_loss": value_metrics["value_loss"], "value_clip_frac": value_metrics["value_clip_frac"],
                      "value_grad_norm": value_metrics["grad_norm"]})
  metrics = jax.device_get(metrics)
  return policy_state, value_state, {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}

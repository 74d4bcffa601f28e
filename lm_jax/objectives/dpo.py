"""Direct Preference Optimization (Rafailov et al. 2023, eq. 7) for the GPT family: the policy learns from
preference pairs directly, against a frozen reference model, with no reward model and no sampling.

Per pair, with log pi(y|x) summed over the response tokens (and its eos):
  chosen_reward   = beta * (log pi(y_c|x) - log ref(y_c|x))       (the implicit rewards, paper §5)
  rejected_reward = beta * (log pi(y_r|x) - log ref(y_r|x))
  loss            = -log sigmoid(chosen_reward - rejected_reward)
averaged over the pairs of the global batch; beta = config.rlhf.dpo_beta. Metrics: loss, accuracy (chosen_reward >
rejected_reward), margin (chosen_reward - rejected_reward), chosen_reward, rejected_reward.

The reference: the model config sets model.frozen_reference, so the params hold a second copy of the model under
'reference' (lm_jax.models.REFERENCE). lm_jax.params freezes it (no gradient, no optimizer state), lm_jax.init_from
fills it from config.init_from (the SFT workdir) like the policy, so both start equal; it is sharded and checkpointed
like the policy. The one jitted train step runs the reference forward on each batch next to the policy's (no dropout,
no gradient): nothing is precomputed, and a resumed run needs nothing but its checkpoint. The cost is one more
forward pass per step and the reference's memory. With an adapter method (LoRA, IA³: lm_jax.params) the reference
is the frozen base itself, the params without their adapters (PEFT's disable_adapter, as TRL does): no copy, so
model.frozen_reference must be False; fresh adapters leave the model as it is, so policy and reference start equal.

Data: 'preference' records of config.rlhf.files (lm_jax/data/instructions.py); a row is one pair as two causal
sequences (2, seq_len): chosen then rejected, input_ids / targets the sequence shifted, weights 1 on the response
targets.
"""
import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models, params as params_lib
from lm_jax.data import instructions
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def check(config):
  copy = config.model.get("frozen_reference", False)
  method = params_lib.method(config)
  if method:
    if copy:
      raise ValueError(f"config.objective='dpo' with config.{method} uses the frozen base as its reference: set "
                       "config.model.frozen_reference=False")
    if config[method].init_from:
      raise ValueError(f"config.objective='dpo' with config.{method}.init_from={config[method].init_from!r}: the "
                       "reference (the base without adapters) would not be the starting policy; merge the adapters "
                       "first (--mode=export --export_merged) and init_from that")
  elif not copy:
    raise ValueError("config.objective='dpo' needs config.model.frozen_reference=True (the frozen reference model)")
  if not config.rlhf.dpo_beta > 0:
    raise ValueError(f"config.rlhf.dpo_beta must be > 0, got {config.rlhf.dpo_beta}")
  instructions.check(config)
  if config.data.seq_len < 2:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} leaves no room for a prompt and a response token")


def lengths(config):
  """A pair is two causal sequences of seq_len (counted as one of 2 * seq_len); the reference's forward pass is
  not counted."""
  return Lengths(inputs=2 * config.data.seq_len, targets=0, scored=2 * config.data.seq_len)


def pair_rows(examples, width: int, pad_id: int) -> dict:
  """(n, 2, width) causal rows of the chosen and rejected sequences: input_ids, targets, weights (response
  targets), attention_mask; pair_weights (n,)."""
  n = len(examples)
  ids, targets = np.full((n, 2, width), pad_id, np.int32), np.full((n, 2, width), pad_id, np.int32)
  mask, weights = np.zeros((n, 2, width), np.int32), np.zeros((n, 2, width), np.float32)
  for i, ex in enumerate(examples):
    for j, response in enumerate(ex.responses):
      tokens, p = instructions.sequence(ex.prompt, response, width + 1)
      m = len(tokens) - 1
      ids[i, j, :m], targets[i, j, :m], mask[i, j, :m] = tokens[:-1], tokens[1:], 1
      weights[i, j, p - 1:m] = 1.0
  return dict(input_ids=ids, targets=targets, weights=weights, attention_mask=mask,
              pair_weights=np.ones(n, np.float32))


def row_layout(config, tokenizer):
  width = config.data.seq_len
  real = lambda ex: sum(len(instructions.sequence(ex.prompt, r, width + 1)[0]) - 1 for r in ex.responses)
  return instructions.layout(config, tokenizer, "preference", lambda exs: pair_rows(exs, width, tokenizer.pad_id),
                             real)


def features(config):
  shape = (2, config.data.seq_len)
  return dict(input_ids=(shape, np.int32), targets=(shape, np.int32), weights=(shape, np.float32),
              attention_mask=(shape, np.int32), pair_weights=((), np.float32))


def denominators(batch):
  return {"pairs": jnp.maximum(jnp.sum(jnp.asarray(batch["pair_weights"], jnp.float32)), 1.0)}


def sequence_logps(model_cfg, params, batch: dict, *, rng=None, train=False) -> jax.Array:
  """(N,) float32 sum over the weighted targets of log p(target): batch input_ids, targets, weights,
  attention_mask (N, T)."""
  inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
  logits = models.apply(model_cfg, params, inputs, rng=rng, train=train)["logits"].astype(jnp.float32)
  picked = jnp.take_along_axis(logits, batch["targets"][..., None].astype(jnp.int32), axis=-1)[..., 0]
  logp = picked - jax.nn.logsumexp(logits, axis=-1)
  weights = jnp.asarray(batch["weights"], jnp.float32)
  return jnp.sum(jnp.where(weights != 0, logp * weights, 0.0), axis=-1)


def pair_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, weights, beta: float) -> dict:
  """Weighted SUMS over pairs of the DPO loss and the metrics' numerators, from sequence log-probabilities."""
  chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
  w = jnp.asarray(weights, jnp.float32)
  total = lambda x: jnp.sum(jnp.where(w != 0, x * w, 0.0))
  margin = chosen - rejected
  return dict(loss=total(-jax.nn.log_sigmoid(margin)), accuracy=total((margin > 0).astype(jnp.float32)),
              margin=total(margin), chosen_reward=total(chosen), rejected_reward=total(rejected))


def split_reference(config, params: dict) -> tuple[dict, dict]:
  """(policy params, reference params): a model.frozen_reference tree's two parts, or with adapters the params
  and their base."""
  if params_lib.method(config):
    return params, params_lib.without_adapters(config, params)
  return {k: v for k, v in params.items() if k != models.REFERENCE}, params[models.REFERENCE]


def loss(config, params, batch, den, *, rng=None, train=False):
  n, _, length = batch["input_ids"].shape
  flat = {k: batch[k].reshape(2 * n, length) for k in ("input_ids", "targets", "weights", "attention_mask")}
  policy, reference = split_reference(config, params)
  pi = sequence_logps(config.model, policy, flat, rng=rng, train=train).reshape(n, 2)
  ref = jax.lax.stop_gradient(sequence_logps(config.model, reference, flat)).reshape(n, 2)
  sums = pair_loss(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], batch["pair_weights"], config.rlhf.dpo_beta)
  metrics = {k: v / den["pairs"] for k, v in sums.items()}
  return metrics["loss"], metrics


OBJECTIVE = Objective(name="dpo", layouts=("decoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss)

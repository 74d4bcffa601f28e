"""Reward model from preference pairs (InstructGPT's second step, Ouyang et al. 2022 §3.5, eq. 1) for the GPT
family: a scalar head read at the last token of prompt + response.

The model is a GPT with model.num_labels = 1: its 'classifier' head gives a score at every position and the
reward of a sequence is the score at its last non-padding token (`sequence_rewards`, which PPO also uses). Started
from an SFT workdir (config.init_from) the transformer is the SFT model's and the head is fresh.

Data: 'preference' records of config.rlhf.files (lm_jax/data/instructions.py). A data row is one pair: input_ids
(2, seq_len) with the chosen sequence first and the rejected one second (prompt + response + eos, right-padded),
so both always land in the same batch and the model reads them as two rows. Per pair
  loss = -log sigmoid(r_chosen - r_rejected - config.rlhf.margin)
averaged over the pairs of the global batch. Metrics: loss, accuracy (r_chosen > r_rejected), reward_gap
(r_chosen - r_rejected), chosen_reward, rejected_reward (means over pairs).
"""
import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.data import instructions
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def check(config):
  n = config.model.get("num_labels", 0)
  if n != 1:
    raise ValueError(f"config.objective='reward' needs config.model.num_labels=1 (a scalar reward head), got {n}")
  instructions.check(config)
  if config.data.seq_len < 2:
    raise ValueError(f"config.data.seq_len={config.data.seq_len} leaves no room for a prompt and a response token")


def lengths(config):
  """A pair is two sequences of seq_len (counted as one of 2 * seq_len, which overstates attention a little)."""
  return Lengths(inputs=2 * config.data.seq_len, targets=0, scored=0)


def pair_rows(examples, width: int, pad_id: int) -> dict:
  """input_ids / attention_mask (n, 2, width): chosen then rejected sequence, right-padded; pair_weights (n,)."""
  n = len(examples)
  ids, mask = np.full((n, 2, width), pad_id, np.int32), np.zeros((n, 2, width), np.int32)
  for i, ex in enumerate(examples):
    for j, response in enumerate(ex.responses):
      tokens, _ = instructions.sequence(ex.prompt, response, width)
      ids[i, j, :len(tokens)], mask[i, j, :len(tokens)] = tokens, 1
  return dict(input_ids=ids, attention_mask=mask, pair_weights=np.ones(n, np.float32))


def row_layout(config, tokenizer):
  width = config.data.seq_len
  real = lambda ex: sum(len(instructions.sequence(ex.prompt, r, width)[0]) for r in ex.responses)
  return instructions.layout(config, tokenizer, "preference", lambda exs: pair_rows(exs, width, tokenizer.pad_id),
                             real)


def features(config):
  length = config.data.seq_len
  return dict(input_ids=((2, length), np.int32), attention_mask=((2, length), np.int32),
              pair_weights=((), np.float32))


def denominators(batch):
  return {"pairs": jnp.maximum(jnp.sum(jnp.asarray(batch["pair_weights"], jnp.float32)), 1.0)}


def sequence_rewards(model_cfg, params, batch: dict, *, rng=None, train=False) -> jax.Array:
  """(N,) float32: the reward model's score at the last non-padding token of each row. batch: input_ids (N, T),
  attention_mask (N, T) (1 = token; left or right padding), optional positions (N, T)."""
  out = models.apply(model_cfg, params, batch, rng=rng, train=train)
  mask = jnp.asarray(batch["attention_mask"])
  last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
  return jnp.take_along_axis(out["scores"][..., 0], last[:, None], axis=1)[:, 0]


def pair_loss(chosen, rejected, weights, margin: float = 0.0) -> dict:
  """Weighted SUMS over pairs of the loss -log sigmoid(chosen - rejected - margin) and the metrics' numerators."""
  w = jnp.asarray(weights, jnp.float32)
  total = lambda x: jnp.sum(jnp.where(w != 0, x * w, 0.0))
  gap = chosen - rejected
  return dict(loss=total(-jax.nn.log_sigmoid(gap - margin)), accuracy=total((gap > 0).astype(jnp.float32)),
              reward_gap=total(gap), chosen_reward=total(chosen), rejected_reward=total(rejected))


def loss(config, params, batch, den, *, rng=None, train=False):
  n, _, length = batch["input_ids"].shape
  flat = {k: batch[k].reshape(2 * n, length) for k in ("input_ids", "attention_mask")}
  rewards = sequence_rewards(config.model, params, flat, rng=rng, train=train).reshape(n, 2)
  sums = pair_loss(rewards[:, 0], rewards[:, 1], batch["pair_weights"], config.rlhf.margin)
  metrics = {k: v / den["pairs"] for k, v in sums.items()}
  return metrics["loss"], metrics


OBJECTIVE = Objective(name="reward", layouts=("decoder",), check=check, lengths=lengths, rows=row_layout,
                      transform=no_transform, features=features, denominators=denominators, loss=loss)

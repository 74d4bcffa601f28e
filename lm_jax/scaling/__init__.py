"""Scaling laws: published laws, compute-optimal allocation, FLOP counts, and fitting our own runs.

`python -m lm_jax.scaling {fit,allocate,predict,sweep}`; see docs/scaling_laws.md.
"""
from lm_jax import models
from lm_jax.flops import PF_DAY, Lengths, flops_6nd, kaplan_forward_flops_per_token, kaplan_params
from lm_jax.scaling.laws import (CHINCHILLA, EPOCH, KAPLAN_ALLOC, KAPLAN_C_MIN, KAPLAN_D, KAPLAN_N, KAPLAN_ND,
                                 LAWS, PRESETS, Chinchilla, allocate, get_law, isoflop_minimum, kaplan_allocate,
                                 kaplan_loss_c_min, kaplan_loss_d, kaplan_loss_n, kaplan_loss_nd, predict)


def forward_flops_per_sequence(model_cfg, seq_len, target_len=0, num_predictions=0):
  """Exact matmul FLOPs of one forward pass on one example (the family's count, lm_jax.flops): seq_len input
  tokens, target_len decoder tokens (T5), the vocabulary head on num_predictions positions (BERT's sparse MLM head)
  or, with 0, on every output position as the model computes it without an objective."""
  scored = num_predictions or target_len or seq_len
  return models.forward_flops(model_cfg, Lengths(seq_len, target_len, scored))


def train_flops_per_sequence(model_cfg, seq_len, target_len=0, num_predictions=0):
  """3x forward_flops_per_sequence: each matmul has two backward matmuls (input and weight gradients)."""
  return 3.0 * forward_flops_per_sequence(model_cfg, seq_len, target_len, num_predictions)

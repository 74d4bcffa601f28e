"""Scaling laws: published laws, compute-optimal allocation, FLOP counts, and fitting our own runs.

`python -m lm_jax.scaling {fit,allocate,predict,sweep}`; see README "Scaling laws".
"""
from lm_jax.flops import (PF_DAY, flops_6nd, forward_flops_per_sequence, kaplan_forward_flops_per_token,
                          kaplan_params, train_flops_per_sequence)
from lm_jax.scaling.laws import (CHINCHILLA, EPOCH, KAPLAN_ALLOC, KAPLAN_C_MIN, KAPLAN_D, KAPLAN_N, KAPLAN_ND,
                                 LAWS, PRESETS, Chinchilla, allocate, get_law, isoflop_minimum, kaplan_allocate,
                                 kaplan_loss_c_min, kaplan_loss_d, kaplan_loss_n, kaplan_loss_nd, predict)

"""Qwen3 (Qwen team 2025, arXiv 2505.09388; HF Qwen3ForCausalLM): Llama's model (lm_jax/models/llama.py) with an
RMSNorm over each query and key head before the rotation (QK-norm) and a head_dim set apart from d_model /
num_heads (Qwen3-0.6B: 16 heads of 128 on a width of 1024)."""
from lm_jax.models import llama

FIELDS = llama.FIELDS | dict(qk_norm=True, rope_theta=1_000_000.0)
FAMILY = llama.family("qwen3")

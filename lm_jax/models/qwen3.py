"""Qwen3 (Qwen team 2025, arXiv 2505.09388; HF Qwen3ForCausalLM): Llama's model (lm_jax/models/llama.py) with an
RMSNorm over each query and key head before the rotation (QK-norm) and a head_dim set apart from d_model /
num_heads (Qwen3-0.6B: 16 heads of 128 on a width of 1024)."""
from lm_jax.models import llama

FIELDS = {                   # llama's fields with Qwen3's defaults (HF Qwen3Config's)
    "max_positions": 32768,
    "num_kv_heads": 0,
    "rope_theta": 1000000.0,
    "qk_norm": True,
    "norm": "rmsnorm",
    "use_bias": False,
    "tie_embeddings": False,
    "mup_base_width": 0,    # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}
FAMILY = llama.family("qwen3", FIELDS)

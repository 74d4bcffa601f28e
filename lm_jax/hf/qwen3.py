"""Hugging Face Qwen3ForCausalLM: LlamaForCausalLM's tensors (lm_jax/hf/llama.py) plus self_attn.q_norm / k_norm,
the RMSNorm of each query / key head, and an explicit head_dim."""
import functools

from lm_jax.hf import llama

FAMILY, MODEL_TYPE, ARCHITECTURE = "qwen3", "qwen3", "Qwen3ForCausalLM"
FAN_IN_FAN_OUT, BASE_PREFIX = llama.FAN_IN_FAN_OUT, llama.BASE_PREFIX

hf_config = functools.partial(llama.hf_config, model_type=MODEL_TYPE, architecture=ARCHITECTURE)
config_from_hf = functools.partial(llama.config_from_hf, family=FAMILY)
to_hf, from_hf, table = llama.to_hf, llama.from_hf, llama.table

"""lm_jax: BERT, GPT-1 and T5 pre-training, fine-tuning and export in pure JAX."""

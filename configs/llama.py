"""Llama-style causal LMs (Touvron et al. 2023, arXiv 2302.13971; HF LlamaForCausalLM): pre-RMSNorm, rotary
positions, SwiGLU, grouped-query attention, no biases.

Variants (shapes from the released config.json of each model on the Hugging Face Hub):
  smollm_135m  HuggingFaceTB/SmolLM-135M: 30 layers of 576, 9 heads of 64, 3 kv heads, d_ff 1536, vocabulary
               49,152, tied head, rope_theta 10,000, rms_norm_eps 1e-5, context 2048: 134,515,008 parameters.
  smollm_360m  HuggingFaceTB/SmolLM-360M: 32 layers of 960, 15 heads of 64, 5 kv heads, d_ff 2560, the same
               vocabulary, head, theta, eps and context: 361,821,120 parameters.
  tiny         2 layers of 128, 4 heads, 2 kv heads, on Tiny Shakespeare (CPU).
The optimizer is Llama's (paper §2.2: AdamW b1 0.9, b2 0.95, weight decay 0.1, clip 1.0, 2000 warmup steps,
cosine to 10% of the peak); SmolLM's own learning rate, batch and steps are not in its config: set them for your
data (lr 3e-4 here is Llama-7B's).
--mode=compile --plan for v5e-8 chooses mesh data 8, 16 microbatches (4 rows per device), remat minimal, scanned:
train step 11.29 GiB per device compiled (lm_jax.plan.memory's estimate 12.34), eval step (the same
microbatches) 2.34 GiB, 1.291e15 FLOPs per step, 2.05 s at MFU 40%. Without remat no microbatching fits: 2 rows
need 20.83 GiB. (Remat full, 16 microbatches, fsdp 8: 4.0 GiB, a third more compute.)
"""
from lm_jax import defaults

# layers, d_model, heads, kv heads, d_ff
_SIZES = {"smollm_135m": (30, 576, 9, 3, 1536), "smollm_360m": (32, 960, 15, 5, 2560)}


def get_config(arg="smollm_135m"):
  if arg not in (*_SIZES, "tiny"):
    raise ValueError(f"configs/llama.py: unknown variant {arg!r}; use {', '.join(_SIZES)} or tiny")
  c = defaults.base_config()
  c.objective = "clm"

  m = c.model = defaults.model_defaults("llama")
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = _SIZES.get(arg, _SIZES["smollm_135m"])
  m.vocab_size, m.max_positions, m.tie_embeddings = 49152, 2048, True
  m.rope_theta, m.layer_norm_eps = 10000.0, 1e-5
  m.activation, m.gated_ffn = "silu", True   # SwiGLU
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.scan_layers = arg != "tiny"          # compile time independent of depth (--mode=compile --plan tries both)

  c.data.tfds_name = ""
  c.data.seq_len = 2048
  c.data.tokenizer_type = "bpe"

  o = c.optimizer
  o.name, o.lr, o.b1, o.b2, o.eps, o.weight_decay = "adamw", 3e-4, 0.9, 0.95, 1e-8, 0.1
  o.warmup_steps, o.schedule, o.min_lr_ratio, o.clip_norm = 2000, "cosine", 0.1, 1.0

  c.batch_size = 512                    # 512 x 2048 = 1M tokens
  c.total_steps = 600_000               # not in the config: set it for your data
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 10_000

  if arg == "tiny":
    defaults.tiny(c)
    m.num_kv_heads, m.max_positions = 2, 128
    c.optimizer.lr = 1e-3
  return c

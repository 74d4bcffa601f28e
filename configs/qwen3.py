"""Qwen3 (Qwen team 2025, arXiv 2505.09388; HF Qwen3ForCausalLM): Llama's block (configs/llama.py) with QK-norm,
an RMSNorm over each query and key head, and a head_dim set apart from d_model / num_heads.

Variants:
  0_6b  Qwen/Qwen3-0.6B's released config.json: 28 layers of 1024, 16 heads of 128 (so 2048 wide), 8 kv heads,
        d_ff 3072, vocabulary 151,936, tied head, rope_theta 1,000,000, rms_norm_eps 1e-6, context 40,960:
        596,049,920 parameters (0.44B without the embeddings, as its model card says).
  tiny  2 layers of 128, 4 heads of 48, 2 kv heads, on Tiny Shakespeare (CPU).
Qwen3's optimizer settings are not published: Llama's are used (configs/llama.py).
--mode=compile of 0_6b for v5e-8 (scanned, remat full, 32 microbatches, fsdp 8; eval_every=0, compiled before the
eval step ran the train step's microbatches): 6.44 GiB per device, 6.705e15 FLOPs per step, 10.6 s at MFU 40%.
"""
from lm_jax import defaults


def get_config(arg="0_6b"):
  if arg not in ("0_6b", "tiny"):
    raise ValueError(f"configs/qwen3.py: unknown variant {arg!r}; use 0_6b or tiny")
  c = defaults.base_config()
  c.objective = "clm"

  m = c.model = defaults.model_defaults("qwen3")
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff = 28, 1024, 16, 8, 128, 3072
  m.vocab_size, m.max_positions, m.tie_embeddings = 151936, 40960, True
  m.rope_theta, m.layer_norm_eps = 1_000_000.0, 1e-6
  m.activation, m.gated_ffn = "silu", True   # SwiGLU
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.scan_layers = arg != "tiny"          # compile time independent of depth (--mode=compile --plan tries both)

  c.data.tfds_name = ""
  c.data.seq_len = 4096
  c.data.tokenizer_type = "bpe"

  o = c.optimizer
  o.name, o.lr, o.b1, o.b2, o.eps, o.weight_decay = "adamw", 3e-4, 0.9, 0.95, 1e-8, 0.1
  o.warmup_steps, o.schedule, o.min_lr_ratio, o.clip_norm = 2000, "cosine", 0.1, 1.0

  c.batch_size = 256                    # 256 x 4096 = 1M tokens
  c.total_steps = 600_000               # not published: set it for your data
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 10_000

  if arg == "tiny":
    defaults.tiny(c)
    m.num_kv_heads, m.head_dim, m.max_positions = 2, 48, 128
    c.optimizer.lr = 1e-3
  return c

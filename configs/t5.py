"""T5 (Raffel et al. 2020): span corruption. Variants: small, base, large (v1.0),
v1_1_small, v1_1_base, v1_1_large, v1_1_xl, v1_1_xxl (gated-GELU, untied head), tiny (CPU)."""
from lm_jax import defaults

SIZES = {  # d_model, d_ff, heads, layers per stack (docs/reference.md#t5-sizes)
    "small": (512, 2048, 8, 6),
    "base": (768, 3072, 12, 12),
    "large": (1024, 4096, 16, 24),
    "v1_1_small": (512, 1024, 6, 8),
    "v1_1_base": (768, 2048, 12, 12),
    "v1_1_large": (1024, 2816, 16, 24),
    "v1_1_xl": (2048, 5120, 32, 24),
    "v1_1_xxl": (4096, 10240, 64, 24),
}


def get_config(arg="base"):
  if arg not in (*SIZES, "tiny"):
    raise ValueError(f"configs/t5.py: unknown variant {arg!r}; use one of {', '.join(SIZES)}, tiny")
  c = defaults.base_config()
  c.objective = "span_corruption"

  m = c.model = defaults.model_defaults("t5")
  if arg in SIZES:
    m.d_model, m.d_ff, m.num_heads, m.num_layers = SIZES[arg]
  m.head_dim = 64
  m.vocab_size = 32128
  m.layer_norm_eps = 1e-6
  m.relative_attention_num_buckets = 32
  m.relative_attention_max_distance = 128
  v1_1 = arg.startswith("v1_1")
  m.activation = "gelu_tanh" if v1_1 else "relu"
  m.gated_ffn = v1_1
  m.tie_embeddings = not v1_1
  m.dropout_rate = m.attention_dropout_rate = 0.0 if v1_1 else 0.1

  c.data.tfds_name = "c4/en:3.1.0"
  c.data.seq_len = 512                  # -> targets 114 for density 0.15, mean span 3
  c.data.noise_density = 0.15
  c.data.mean_noise_span_length = 3.0

  c.optimizer.name = "adafactor"
  c.optimizer.lr = 0.01                 # 1/sqrt(max(step, 10k))
  c.optimizer.warmup_steps = 10_000
  c.optimizer.schedule = "rsqrt"
  c.optimizer.clip_norm = 0.0

  c.batch_size = 128                    # 128 x 512 ~ 2^16 tokens
  c.total_steps = 2**19                 # the baseline's 524,288 steps (~34B tokens)
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 5_000

  if arg == "tiny":                      # seq 128 -> targets 29; lr 1/sqrt(max(step, 20)) ~ 0.22
    defaults.tiny(c)
    m.head_dim = 32
  return c

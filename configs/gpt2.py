"""GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"): causal LM, pre-LN.

Variants: small (124M: 12 layers of 768; HF gpt2), medium (355M: 24 layers of 1024; HF gpt2-medium), tiny (CPU).
Published (paper §2.3, Table 2): vocabulary 50,257 (byte-level BPE), context 1024, batch 512, LayerNorm before
each sub-block and after the last, residual projections initialised scaled by 1/sqrt(N) for N residual layers.
From the released model (HF GPT2Config): GELU tanh form, LayerNorm eps 1e-5, dropout 0.1, init N(0, 0.02).
Not published: the optimizer and its settings (Adam and GPT-1's schedule are used here), the learning rate ("manually
tuned for the best perplexity on a 5% held-out sample of WebText"), the number of steps, and WebText itself (not
distributed: point data.files at your own text).
"""
from lm_jax import defaults

_SIZES = {"small": (12, 768, 12), "medium": (24, 1024, 16)}   # layers, d_model, heads (Table 2)


def get_config(arg="small"):
  if arg not in (*_SIZES, "tiny"):
    raise ValueError(f"configs/gpt2.py: unknown variant {arg!r}; use small, medium or tiny")
  c = defaults.base_config()
  c.objective = "clm"

  m = c.model = defaults.model_defaults("gpt2")
  m.num_layers, m.d_model, m.num_heads = _SIZES.get(arg, _SIZES["small"])
  m.d_ff = 4 * m.d_model
  m.vocab_size, m.max_positions = 50257, 1024
  m.activation, m.layer_norm_eps = "gelu_tanh", 1e-5

  c.data.tfds_name = ""
  c.data.seq_len = 1024
  c.data.tokenizer_type = "bpe"

  c.optimizer.name = "adam_l2"          # GPT-1's (not published for GPT-2)
  c.optimizer.lr = 2.5e-4               # GPT-1's (GPT-2's was tuned per size and not published)
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-8
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 2000
  c.optimizer.schedule = "cosine"
  c.optimizer.clip_norm = 1.0

  c.batch_size = 512                    # 512 x 1024 = 524,288 tokens
  c.total_steps = 800_000               # not published: set it for your data
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 10_000

  if arg == "tiny":
    defaults.tiny(c)
    m.max_positions = 128
    c.optimizer.lr = 1e-3
  return c

"""GPT-1 (Radford et al. 2018): causal LM. Variants: gpt1 (the paper's run), tiny (CPU)."""
from lm_jax import defaults


def get_config(arg="gpt1"):
  if arg not in ("gpt1", "tiny"):
    raise ValueError(f"configs/gpt1.py: unknown variant {arg!r}; use gpt1 or tiny")
  c = defaults.base_config()
  c.objective = "clm"

  m = c.model = defaults.gpt1_model()
  m.activation = "gelu_tanh"

  # BooksCorpus is no longer distributed: point data.files at your own text.
  c.data.tfds_name = ""
  c.data.seq_len = 512
  c.data.tokenizer_type = "bpe"

  c.optimizer.name = "adam_l2"          # Adam + decoupled L2 0.01 on weights of rank > 1
  c.optimizer.lr = 2.5e-4
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-8
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 2000
  c.optimizer.schedule = "cosine"       # to 0 at total_steps
  c.optimizer.clip_norm = 1.0

  c.batch_size = 64                     # 64 x 512 = 32,768 tokens
  # 100 epochs over BooksCorpus; the paper gives no step count. ~800M words ~ 1B tokens -> ~3M steps (estimate).
  c.total_steps = 3_000_000
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 10_000

  if arg == "tiny":
    defaults.tiny(c)
    m.max_positions = 128
    c.optimizer.lr = 1e-3
  return c


def get_sweep(arg="gpt1"):
  """`python -m lm_jax.sweep run --config=configs/gpt1.py:tiny --root=DIR`: the learning rate around the config's,
  2x apart; tiny's also at two widths (docs/sweeps.md)."""
  from lm_jax.sweep import hyper
  lr = get_config(arg).optimizer.lr
  lrs = hyper.sweep("optimizer.lr", [lr / 2, lr, 2 * lr])
  return hyper.product(lrs, hyper.sweep("model.d_model", [64, 128])) if arg == "tiny" else lrs

"""nanoGPT's character-level Shakespeare runs (karpathy/nanoGPT, config/train_shakespeare_char.py and its README).

Variants:
  shakespeare_char      the GPU recipe: 6 layers of 384, 6 heads, context 256, batch 64, 5000 iterations, dropout
                        0.2; nanoGPT reports a best validation loss of 1.4697 in about 3 minutes on one A100.
  shakespeare_char_cpu  the README's CPU line (--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
                        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0 --eval_iters=20): validation loss 1.88.
  shakespeare_char_cpu_muon  the CPU line with Muon (Jordan et al. 2024; optax.contrib.muon) on the hidden
                        matrices at lr 0.04, momentum 0.95, and AdamW at 1e-3 (the recipe's) on the embeddings and
                        norms; the same warmup, cosine and weight decay. Rates from a sweep of 500-step runs, 1 seed
                        (bench/README.md): Muon lr 0.01 / 0.02 / 0.04 / 0.08 gave val loss 1.979 / 1.913 / 1.895 /
                        2.012 with adam_lr 1e-3.
Both: a character vocabulary (65 symbols for Tiny Shakespeare), the file's first 90% of characters train and the
rest evaluates (data/shakespeare_char/prepare.py), random windows (train.py get_batch), GPT-2's pre-LN block
without biases (model.py, bias=False), exact GELU, LayerNorm eps 1e-5, N(0, 0.02) init with the residual
projections scaled by 1/sqrt(2 * n_layer), tied head; AdamW lr 1e-3, betas (0.9, 0.99), weight decay 0.1 on
parameters of 2 or more dimensions, clip 1.0, 100 warmup steps, cosine to min_lr 1e-4 at max_iters.
Point data.files at Tiny Shakespeare's input.txt. The eval is the exact loss over the whole validation split
(lm_jax/data/windows.py); nanoGPT prints the mean of eval_iters random batches. Two small differences remain:
nanoGPT's warmup is lr * (it + 1) / (warmup + 1) where ours starts at 0, and its batches come from torch's
generator, ours from numpy's (bench/nanogpt.py runs both).
"""
from lm_jax import defaults

VARIANTS = ("shakespeare_char", "shakespeare_char_cpu", "shakespeare_char_cpu_muon")


def get_config(arg="shakespeare_char"):
  if arg not in VARIANTS:
    raise ValueError(f"configs/nanogpt.py: unknown variant {arg!r}; use {' or '.join(VARIANTS)}")
  cpu = arg.startswith("shakespeare_char_cpu")
  c = defaults.base_config()
  c.objective = "clm"

  m = c.model = defaults.model_defaults("gpt2")
  m.num_layers, m.num_heads, m.d_model = (4, 4, 128) if cpu else (6, 6, 384)
  m.d_ff = 4 * m.d_model
  m.vocab_size = 65                     # Tiny Shakespeare's distinct characters
  m.activation, m.layer_norm_eps, m.use_bias = "gelu", 1e-5, False
  m.dropout_rate = m.attention_dropout_rate = 0.0 if cpu else 0.2

  c.data.tokenizer_type = "char"
  c.data.split_fraction = 0.9
  c.data.windows = True
  c.data.seq_len = m.max_positions = 64 if cpu else 256   # block_size
  c.data.eval_batches = 0               # the whole validation split

  o = c.optimizer
  o.name, o.lr, o.min_lr_ratio = "adamw", 1e-3, 0.1
  o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm = 0.9, 0.99, 1e-8, 0.1, 1.0
  o.warmup_steps, o.schedule = 100, "cosine"
  if arg == "shakespeare_char_cpu_muon":
    o.name, o.lr, o.adam_lr, o.muon_momentum = "muon", 0.04, 1e-3, 0.95   # the docstring's sweep

  c.batch_size = 12 if cpu else 64
  c.total_steps = 2000 if cpu else 5000
  c.log_every = 100 if cpu else 10
  c.eval_every = 500 if cpu else 250   # nanoGPT: 250; our exact eval reads the whole split (CPU: 146 batches)
  c.checkpoint_every = 1000
  return c

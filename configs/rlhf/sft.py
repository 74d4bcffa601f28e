"""Supervised fine-tuning, the first RLHF stage (Ouyang et al. 2022, InstructGPT §3.5 and Appendix C.1: 16 epochs,
cosine learning-rate decay, residual dropout 0.2): the loss on the response tokens of (prompt, response) pairs
(lm_jax/objectives/sft.py; data format in lm_jax/data/instructions.py; walk-through in docs/rlhf.md).

Variants:
  gpt1   a GPT-1-size model from a pre-trained one: --config.init_from=WORKDIR_OR_HF_DIR and
         --config.rlhf.files=.../sft_{split}.jsonl
  tiny   a 2-layer GPT from scratch on the toy instruction task (copy / reverse / add) that
         `python -m lm_jax.data.toy_tasks --out=rlhf_data` writes; a CPU run
  sst2   the same tiny GPT continuing SST-2 sentences from their first word (the docs/rlhf.md demonstration;
         `python -m lm_jax.data.toy_tasks --out=rlhf_data --sst2=$LM_JAX_DATA/sst2` writes the files)
The T5 family trains the same way: --config=configs/t5.py:tiny --config.objective=sft --config.rlhf.files=...
"""
from lm_jax import defaults

VARIANTS = ("gpt1", "tiny", "sst2")


def get_config(arg="gpt1"):
  if arg not in VARIANTS:
    raise ValueError(f"configs/rlhf/sft.py: unknown variant {arg!r}; use {', '.join(VARIANTS)}")
  c = defaults.base_config()
  c.objective = "sft"
  m = c.model = defaults.gpt1_model()   # init_from's architecture wins
  m.dropout_rate = 0.2                  # InstructGPT's residual dropout for SFT
  c.data.seq_len = 512
  c.data.eval_batches = 0               # the whole dev split
  c.data.train_split, c.data.eval_split = "train", "dev"

  c.optimizer.name = "adamw"
  c.optimizer.lr = 2e-5                 # the paper searches lr per model size; a fine-tuning lr for GPT-1's size
  c.optimizer.weight_decay = 0.0
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 100
  c.batch_size = 32
  c.total_steps = 10_000                # ~16 epochs of 20k examples at batch 32: set it for your data
  c.log_every, c.eval_every, c.checkpoint_every = 50, 1000, 1000
  c.finetune.best_metric = "eval_loss"
  if arg == "gpt1":
    return c

  defaults.tiny(c)
  m.max_positions = 64
  m.dropout_rate = 0.0
  c.data.tfds_name = ""
  c.data.train_split, c.data.eval_split = "train", "dev"
  name = "instructions" if arg == "tiny" else "sst2_sft"
  c.rlhf.files = f"rlhf_data/{name}_{{split}}.jsonl"
  c.data.files, c.data.text_field = c.rlhf.files, "text"   # trains the tokenizer from scratch on the same files
  c.data.seq_len, c.data.eval_batches = 64, 8
  c.optimizer.lr, c.optimizer.warmup_steps = 3e-3, 30
  c.batch_size, c.total_steps = 32, 600
  if arg == "sst2":   # 3e-3 stalls at the unigram level for most of the run (docs/rlhf.md has the losses)
    c.optimizer.lr, c.total_steps = 1e-3, 1000
  c.log_every, c.eval_every, c.checkpoint_every = 50, 200, 200
  c.finetune.best_metric = ""
  if arg == "tiny":
    m.vocab_size = 64                   # letters, digits and the task words: one token per symbol
  return c

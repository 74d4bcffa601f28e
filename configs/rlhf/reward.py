"""Reward model, the second RLHF stage (Ouyang et al. 2022, InstructGPT §3.5 and Appendix C.2: one epoch over the
comparisons, cosine lr decay to a tenth of lr 9e-6, batch of 64 prompts): a scalar head on the last token of
prompt + response, trained with -log sigmoid(r_chosen - r_rejected) on preference pairs
(lm_jax/objectives/reward.py; data format in lm_jax/data/instructions.py; walk-through in docs/rlhf.md).
Start it from the SFT run: --config.init_from=SFT_WORKDIR (the transformer is the SFT model's, the head is new).

Variants: gpt1 (GPT-1 size; --config.init_from and --config.rlhf.files), tiny (the toy preference pairs: the
response with more 'a's is chosen), sst2 (SST-2 pairs: the positive continuation of a prompt is chosen).
"""
from lm_jax import defaults

VARIANTS = ("gpt1", "tiny", "sst2")


def get_config(arg="gpt1"):
  if arg not in VARIANTS:
    raise ValueError(f"configs/rlhf/reward.py: unknown variant {arg!r}; use {', '.join(VARIANTS)}")
  c = defaults.base_config()
  c.objective = "reward"
  m = c.model = defaults.gpt1_model()   # init_from's architecture wins
  m.num_labels = 1                      # the scalar reward head
  m.dropout_rate = m.attention_dropout_rate = 0.0
  c.data.seq_len = 512
  c.data.eval_batches = 0
  c.data.train_split, c.data.eval_split = "train", "dev"
  c.rlhf.margin = 0.0

  c.optimizer.name = "adamw"
  c.optimizer.lr = 9e-6                 # InstructGPT's 6B RM; a one-epoch schedule to avoid overfitting
  c.optimizer.schedule = "cosine"
  c.optimizer.warmup_steps = 50
  c.batch_size = 64                     # pairs (each two sequences)
  c.total_steps = 5_000                 # one epoch of your comparisons at batch 64
  c.log_every, c.eval_every, c.checkpoint_every = 50, 500, 500
  c.finetune.best_metric = "eval_accuracy"
  if arg == "gpt1":
    return c

  defaults.tiny(c)
  m.max_positions = 64
  m.dropout_rate = m.attention_dropout_rate = 0.0
  c.data.tfds_name = ""
  c.data.train_split, c.data.eval_split = "train", "dev"
  c.rlhf.files = f"rlhf_data/{'preferences' if arg == 'tiny' else 'sst2_preferences'}_{{split}}.jsonl"
  c.data.files, c.data.text_field = c.rlhf.files, "text"   # without init_from: a tokenizer from these files
  c.data.seq_len, c.data.eval_batches = 64, 0
  c.optimizer.lr, c.optimizer.warmup_steps = 1e-3, 20
  c.batch_size, c.total_steps = 32, 300
  c.log_every, c.eval_every, c.checkpoint_every = 50, 100, 100
  c.finetune.best_metric = ""
  if arg == "tiny":
    m.vocab_size = 64
  return c

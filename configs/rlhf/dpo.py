"""Direct Preference Optimization (Rafailov et al. 2023, §6 and Appendix B: beta 0.1, lr 1e-6 with 150 warmup
steps, batch 64, no dropout): the policy learns from preference pairs against a frozen copy of the model it
starts from (lm_jax/objectives/dpo.py; data format in lm_jax/data/instructions.py; walk-through in docs/rlhf.md).
Start it from the SFT run: --config.init_from=SFT_WORKDIR (policy and reference both start as the SFT model).

Variants: gpt1 (GPT-1 size; --config.init_from and --config.rlhf.files), tiny (the toy preference pairs), sst2
(SST-2 pairs).
"""
from lm_jax import defaults

VARIANTS = ("gpt1", "tiny", "sst2")


def get_config(arg="gpt1"):
  if arg not in VARIANTS:
    raise ValueError(f"configs/rlhf/dpo.py: unknown variant {arg!r}; use {', '.join(VARIANTS)}")
  c = defaults.base_config()
  c.objective = "dpo"
  m = c.model = defaults.gpt1_model()   # init_from's architecture wins
  m.frozen_reference = True             # the reference model: a frozen copy of init_from's params
  m.dropout_rate = m.attention_dropout_rate = 0.0
  c.data.seq_len = 512
  c.data.eval_batches = 0
  c.data.train_split, c.data.eval_split = "train", "dev"
  c.rlhf.dpo_beta = 0.1

  c.optimizer.name = "adamw"            # the paper uses RMSprop
  c.optimizer.lr = 1e-6
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 150
  c.batch_size = 64
  c.total_steps = 5_000
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
  c.data.files, c.data.text_field = c.rlhf.files, "text"
  c.data.seq_len, c.data.eval_batches = 64, 0
  c.optimizer.lr, c.optimizer.warmup_steps = 1e-4, 10
  c.optimizer.schedule = "constant"
  c.batch_size, c.total_steps = 32, 200
  c.log_every, c.eval_every, c.checkpoint_every = 50, 100, 100
  c.finetune.best_metric = ""
  if arg == "tiny":
    m.vocab_size = 64
  return c

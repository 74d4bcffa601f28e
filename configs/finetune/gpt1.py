"""Fine-tuning GPT-1 on a task (Radford et al. 2018 §3.3, openai/finetune-transformer-lm): the pre-trained GPT
(--init_from=DIR: a run's workdir or a Hugging Face directory; its architecture and tokenizer are used) gets the
start / delimiter / extract tokens appended to its vocabulary and a linear classifier on the extract token's state
(objective gpt_classify, task.format = the paper's input transformation). The paper's recipe: Adam with the
modified L2 0.01, lr 6.25e-5, batch 32, 3 epochs, linear warmup over the first 0.2% of training then linear decay
to 0, dropout 0.1 (classifier included), auxiliary LM loss weight lambda 0.5. Sequence length 128 (the paper's code
takes the longest example, up to 512); evaluation on the whole dev set after each epoch.

Variants: a GLUE task of the paper (cola, sst2: classification; mnli, qnli, rte: entailment; mrpc, qqp: similarity;
TFDS glue/<task>), tiny (the offline SST-2 files, --init_from a configs/gpt1.py:tiny run). Multiple choice (RACE,
Story Cloze): task.format='multiple_choice', task.text_fields=(context,), task.choice_fields=(answers...),
model.num_labels=1. The offline SST-2 is $LM_JAX_DATA/sst2/{train,dev,test}.tsv (sentence<TAB>label, no header).
"""
import math
import os

from lm_jax import defaults

# format, text fields, classes, training examples, dev split
GLUE = {
    "cola": ("classify", ("sentence",), 2, 8_551, "validation"),
    "sst2": ("classify", ("sentence",), 2, 67_349, "validation"),
    "mnli": ("entailment", ("premise", "hypothesis"), 3, 392_702, "validation_matched"),
    "qnli": ("entailment", ("question", "sentence"), 2, 104_743, "validation"),
    "rte": ("entailment", ("sentence1", "sentence2"), 2, 2_490, "validation"),
    "mrpc": ("similarity", ("sentence1", "sentence2"), 2, 3_668, "validation"),
    "qqp": ("similarity", ("question1", "question2"), 2, 363_846, "validation"),
}
LABEL_NAMES = {"mnli": ("entailment", "neutral", "contradiction"), "qnli": ("entailment", "not_entailment"),
               "rte": ("entailment", "not_entailment")}
SST2_TRAIN = 6_920       # examples in the offline SST-2 train.tsv


def _schedule(c, examples: int, epochs: float):
  """total_steps for `epochs` over `examples`, warmup over 0.2% of them, an eval and a checkpoint per epoch."""
  c.total_steps = max(1, math.ceil(epochs * examples / c.batch_size))
  c.optimizer.warmup_steps = round(0.002 * c.total_steps)
  per_epoch = min(c.total_steps, math.ceil(examples / c.batch_size))
  c.eval_every = c.checkpoint_every = per_epoch
  c.log_every = max(1, min(100, per_epoch // 10))


def get_config(arg="sst2"):
  known = (*GLUE, "tiny")
  if arg not in known:
    raise ValueError(f"configs/finetune/gpt1.py: unknown variant {arg!r}; use {', '.join(known)}")
  c = defaults.base_config()
  c.objective = "gpt_classify"
  m = c.model = defaults.gpt1_model()   # init_from's architecture wins
  m.dropout_rate = m.attention_dropout_rate = 0.1       # also the classifier's dropout
  m.num_labels = 2

  c.optimizer.name = "adam_l2"          # Adam + the paper's modified L2 on weights of rank > 1
  c.optimizer.lr = 6.25e-5
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-8
  c.optimizer.weight_decay = 0.01
  c.optimizer.schedule = "linear"       # the code's warmup_linear: lr * step / warmup, then lr * (1 - step / total)
  c.optimizer.clip_norm = 1.0
  c.task.lm_coef = 0.5
  c.batch_size = 32
  c.data.seq_len = 128
  c.data.eval_batches = 0               # the whole dev set (the last batch padded)

  if arg in GLUE:
    c.task.format, c.task.text_fields, m.num_labels, examples, dev = GLUE[arg]
    c.task.tfds_name = f"glue/{arg}"
    c.task.label_names = LABEL_NAMES.get(arg, ())
    c.data.train_split, c.data.eval_split = "train", dev
    c.task.test_split = dev.replace("validation", "test")
    _schedule(c, examples, 3)
    return c

  # tiny: from a configs/gpt1.py:tiny run (its 2-layer model and tokenizer), one epoch of the offline SST-2.
  c.task.files = os.path.join(os.environ.get("LM_JAX_DATA", "data"), "sst2", "{split}.tsv")
  c.task.text_fields, c.task.label_field = ("0",), "1"
  c.data.train_split, c.data.eval_split, c.task.test_split = "train", "dev", "test"
  m.num_layers, m.d_model, m.num_heads, m.d_ff, m.max_positions = 2, 128, 4, 512, 128
  c.data.seq_len = 64
  c.optimizer.lr = 1e-3                 # a small model and a short run
  _schedule(c, SST2_TRAIN, 1)
  return c

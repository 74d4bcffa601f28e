"""Fine-tuning T5 text-to-text on GLUE (Raffel et al. 2020 §3.1.3-3.1.4, Appendix D): the pre-trained model
(--init_from=DIR: a Hugging Face T5 directory or a configs/t5.py run's workdir; its architecture and tokenizer are
used) reads "<task> <field>: <text> ..." and writes the label word; Adafactor, constant lr 1e-3, batch 128 inputs of
512 tokens with targets of up to 128, dropout 0.1, 2^18 steps with a checkpoint (and here an eval of the whole dev
set) every 5,000 steps; the paper reports the best checkpoint (finetune.best_metric keeps it).

Variants: a GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli; TFDS glue/<task>, sst2 the offline
files), tiny (a 2-layer T5 from scratch on the offline SST-2, 1 epoch on a CPU, lr 1e-2). The offline SST-2 is
$LM_JAX_DATA/sst2/{train,dev,test}.tsv (sentence<TAB>label, no header). See docs/text_to_text.md.
"""
import os

from lm_jax import defaults

# Text fields as T5 writes them (sorted by name), classes (1 = regression), label words as TFDS glue names them
# (T5 writes those), the metric the paper reports.
GLUE = {
    "cola": (("sentence",), ("unacceptable", "acceptable"), "eval_matthews"),
    "sst2": (("sentence",), ("negative", "positive"), "eval_accuracy"),
    "mrpc": (("sentence1", "sentence2"), ("not_equivalent", "equivalent"), "eval_f1"),
    "qqp": (("question1", "question2"), ("not_duplicate", "duplicate"), "eval_f1"),
    "stsb": (("sentence1", "sentence2"), (), "eval_pearson"),
    "mnli": (("hypothesis", "premise"), ("entailment", "neutral", "contradiction"), "eval_accuracy"),
    "qnli": (("question", "sentence"), ("entailment", "not_entailment"), "eval_accuracy"),
    "rte": (("sentence1", "sentence2"), ("entailment", "not_entailment"), "eval_accuracy"),
    "wnli": (("sentence1", "sentence2"), ("not_entailment", "entailment"), "eval_accuracy"),
}


def get_config(arg="sst2"):
  known = (*GLUE, "tiny")
  if arg not in known:
    raise ValueError(f"configs/finetune/t5.py: unknown variant {arg!r}; use {', '.join(known)}")
  c = defaults.base_config()
  c.objective = "text_to_text"
  m = c.model = defaults.model_defaults("t5")
  m.d_model, m.d_ff, m.num_heads, m.num_layers, m.head_dim = 768, 3072, 12, 12, 64   # T5-base; init_from's wins
  m.vocab_size, m.layer_norm_eps, m.activation = 32128, 1e-6, "relu"
  m.dropout_rate = m.attention_dropout_rate = 0.1

  c.optimizer.name = "adafactor"
  c.optimizer.lr = 1e-3
  c.optimizer.schedule = "constant"
  c.optimizer.warmup_steps = 0
  c.optimizer.clip_norm = 0.0
  c.batch_size = 128
  c.data.seq_len, c.data.target_len = 512, 128
  c.data.eval_batches = 0               # the whole dev set (the last batch padded)
  c.total_steps = 2**18
  c.log_every, c.eval_every, c.checkpoint_every = 100, 5_000, 5_000

  task = "sst2" if arg == "tiny" else arg
  fields, names, c.finetune.best_metric = GLUE[task]
  m.num_labels = len(names) or 1
  c.task.prefix, c.task.label_names = task, names
  c.task.text_fields = c.task.field_names = fields
  if task != "sst2":
    c.task.tfds_name = f"glue/{task}"
    dev = "validation_matched" if task == "mnli" else "validation"
    c.data.train_split, c.data.eval_split, c.task.test_split = "train", dev, dev.replace("validation", "test")
    return c

  sst2_files = os.path.join(os.environ.get("LM_JAX_DATA", "data"), "sst2", "{split}.tsv")
  if arg == "tiny":   # from scratch: a SentencePiece tokenizer trained on the task's text (data.files)
    defaults.tiny(c)
    m.head_dim = 32
    c.data.tfds_name, c.data.files = "", sst2_files
  c.task.files = sst2_files             # sentence<TAB>label (0 / 1), no header
  c.task.text_fields, c.task.label_field = ("0",), "1"
  c.data.train_split, c.data.eval_split, c.task.test_split = "train", "dev", "test"
  if arg == "tiny":
    c.data.seq_len, c.data.target_len, c.data.eval_batches = 64, 8, 0
    c.total_steps = 216                 # one epoch of the 6,920 training sentences
    c.optimizer.lr = 1e-2               # from scratch: 1e-3 (the paper's, for a pre-trained T5) reaches 0.56
    c.optimizer.warmup_steps = 0
    c.log_every, c.eval_every, c.checkpoint_every = 24, 108, 108
  return c

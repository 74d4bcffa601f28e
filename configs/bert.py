"""BERT (Devlin et al. 2019): masked LM + next-sentence prediction.

Variants: base, large (phase 1: seq 128 for 90% of the 1M steps), base_512 / large_512
(phase 2: seq 512 for the last 10%; run it in the same --workdir after phase 1 to resume at
step 900k with the same schedule and a fresh seq-512 data iterator), tiny / tiny_512 (a CPU model
that trains in a minute or two; the same two phases at seq 64 then 128).

Data (paper §3.1): English Wikipedia and BooksCorpus, mixed in proportion to their sizes (2,500M and 800M words:
BERT drew documents from the two corpora put together). Wikipedia comes from TFDS; BooksCorpus has no public TFDS
build (its books are no longer distributed), so it is read from your files: BOOKS_FILES, documents (books)
separated by blank lines, one sentence per line, as BERT's create_pretraining_data.py reads them. Point it
elsewhere with --config.data.mixture (docs/data.md#data-mixtures).
"""
from lm_jax import defaults

SIZES = {  # layers, d_model, heads, d_ff (paper §3)
    "base": (12, 768, 12, 3072),
    "large": (24, 1024, 16, 4096),
}
BOOKS_FILES = "~/data/bookscorpus/*.txt"   # your copy of BooksCorpus (see above)


def get_config(arg="base"):
  size, _, phase = arg.partition("_")
  if size not in (*SIZES, "tiny") or phase not in ("", "512"):
    raise ValueError(f"configs/bert.py: unknown variant {arg!r}; use base, large, base_512, large_512, tiny, tiny_512")
  c = defaults.base_config()
  c.objective = "mlm"

  m = c.model = defaults.model_defaults("bert")
  if size in SIZES:
    m.num_layers, m.d_model, m.num_heads, m.d_ff = SIZES[size]
  m.vocab_size = 30522
  m.max_positions = 512
  m.type_vocab_size = 2
  m.activation = "gelu_tanh"       # the original TF code; HF checkpoints use exact "gelu"
  m.layer_norm_eps = 1e-12

  c.data.train_split = "train[:99%]"   # every source's; 1% held out for eval
  c.data.eval_split = "train[99%:]"
  c.data.mixture = (dict(name="wikipedia", tfds_name="wikipedia/20230601.en", text_field="text", weight=2500.0),
                    dict(name="books", files=BOOKS_FILES, weight=800.0))
  c.data.nsp = True
  c.data.seq_len = 128
  c.data.max_predictions_per_seq = 20   # create_pretraining_data.py default for 128

  c.optimizer.name = "bert_adamw"       # AdamWeightDecayOptimizer: no bias correction, no decay on LN/bias
  c.optimizer.lr = 1e-4
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  c.optimizer.schedule = "linear"       # linear decay to 0 at total_steps
  c.optimizer.clip_norm = 1.0

  c.batch_size = 256
  c.total_steps = 1_000_000             # the schedule spans both phases
  c.phase_end_step = 900_000            # phase 1 stops here; phase 2 (seq 512) continues to total_steps
  c.log_every = 100
  c.eval_every = 10_000
  c.checkpoint_every = 10_000
  if phase == "512":
    c.data.seq_len = 512
    c.data.max_predictions_per_seq = 77  # round(0.15 * 512); the official value is unverified
    c.phase_end_step = 0                 # to total_steps

  if size == "tiny":  # phase 1 at seq 64 for 90% of 200 steps; tiny_512 finishes at seq 128
    c.data.mixture = ()
    defaults.tiny(c)
    m.max_positions = 128
    c.data.seq_len, c.data.max_predictions_per_seq = (128, 20) if phase else (64, 10)
    c.optimizer.lr = 1e-3
    c.phase_end_step = 0 if phase else 180
  return c

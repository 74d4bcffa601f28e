"""ModernBERT (Warner et al. 2024, arXiv 2412.13663): masked LM at 30% masking, no next-sentence prediction.

Variants: base (22 x 768, 12 heads, GLU expansion 2 x 1,152 = 2,304; 149,655,232 params) and large (28 x 1024, 16
heads, GLU 2 x 2,624 = 5,248; 395,881,664 params), the shapes of the released answerdotai/ModernBERT-base and
-large config.json (docs/reference.md#modernbert); phase 1 at seq 1024. base_8192 / large_8192: the context
extension to 8192, run in the same --workdir after phase 1 (it resumes at phase_end_step with a fresh seq-8192 data
iterator, as BERT's phase 2 does). tiny / tiny_8192: a CPU model with 32-token local windows, phases at seq 128 / 256.

The paper's recipe as far as lm_jax expresses it (paper §2.2 and its training settings):
- MLM at 30% masking, no NSP; a constant learning rate after a warmup of 3B tokens (base, lr 8e-4) or 2B (large,
  lr 5e-4); 1.7T tokens at seq 1024, then 300B at seq 8192.
- Not expressed: StableAdamW (AdamW with gradient clipping here), the batch-size warmup (a fixed 4,096 sequences,
  4M tokens per step at seq 1024), large's restart at 5e-5 and the extension's lower lr and final decay, and the
  global layers' rotary theta of 10,000 during phase 1 (a resume keeps the architecture, so both phases use the
  released 160,000). The paper's 2T-token mixture of web, code and scientific text is not public as one dataset:
  C4 stands in (--config.data.mixture points elsewhere), with a BPE vocabulary of the released size trained on it.
--mode=compile of base for v5e-8 (scanned groups, remat full, 32 microbatches, fsdp 8, eval_every=0): 9.23 GiB per
device (temporaries 8.87; 4.97 GiB at 64 microbatches), 3.943e15 FLOPs per step, 6.25 s at MFU 40%.
lm_jax.plan.memory estimates 6.05 GiB (3.20 at 64): per row 0.356 GiB of activations where the compiled
temporaries grow by 0.533, XLA's backward temporaries (not counted) holding the rest.
"""
from lm_jax import defaults

SIZES = {  # layers, d_model, heads, d_ff (one GLU half), lr, warmup tokens
    "base": (22, 768, 12, 1152, 8e-4, 3e9),
    "large": (28, 1024, 16, 2624, 5e-4, 2e9),
}
BATCH = 4096                       # sequences per step (lm_jax's choice, see above)
PHASE1_TOKENS, PHASE2_TOKENS = 1.7e12, 3e11


def get_config(arg="base"):
  size, _, phase = arg.partition("_")
  if size not in (*SIZES, "tiny") or phase not in ("", "8192"):
    raise ValueError(f"configs/modernbert.py: unknown variant {arg!r}; use base, large, base_8192, large_8192, tiny, "
                     "tiny_8192")
  c = defaults.base_config()
  c.objective = "mlm"

  m = c.model = defaults.model_defaults("modernbert")
  m.vocab_size = 50368
  m.activation = "gelu"            # HF hidden_activation / classifier_activation "gelu" (exact)
  m.gated_ffn = True               # GeGLU
  m.layer_norm_eps = 1e-5
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.classifier_pooling = "mean"    # the released config's, for fine-tuning (model.num_labels > 0); the rest of
  # lm_jax/models/modernbert.py's FIELDS are the released values: max_positions 8192, rotary theta 160,000 global /
  # 10,000 local, global every 3rd layer, 64 positions either side in the others (HF local_attention = 128)
  c.data.tfds_name = "c4/en:3.1.0"
  c.data.tokenizer_type = "bpe"
  c.data.nsp = False
  c.data.mlm_probability = 0.3
  c.optimizer.name = "adamw"
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.98, 1e-6
  c.optimizer.weight_decay = 1e-5
  c.optimizer.schedule = "constant"
  c.optimizer.clip_norm = 1.0
  c.batch_size = BATCH
  c.log_every, c.eval_every, c.checkpoint_every = 100, 10_000, 10_000

  seq_len = 8192 if phase else 1024
  if size in SIZES:
    m.num_layers, m.d_model, m.num_heads, m.d_ff, c.optimizer.lr, warmup = SIZES[size]
    m.scan_layers = True           # layer 0, then groups of (local, local, global): lm_jax/models/modernbert.py
    c.optimizer.warmup_steps = round(warmup / (BATCH * 1024))
    c.phase_end_step = int(round(PHASE1_TOKENS / (BATCH * 1024), -3))
    c.total_steps = c.phase_end_step + int(round(PHASE2_TOKENS / (BATCH * 8192), -3))
  else:   # tiny: phase 1 at seq 128 for 90% of 200 steps, tiny_8192 finishes at seq 256
    defaults.tiny(c)
    m.sliding_window = 16
    c.optimizer.lr = 1e-3
    c.phase_end_step = 180
    seq_len = 256 if phase else 128
  c.data.seq_len = seq_len
  c.data.max_predictions_per_seq = round(c.data.mlm_probability * seq_len)
  if phase:
    c.phase_end_step = 0             # to total_steps
  return c

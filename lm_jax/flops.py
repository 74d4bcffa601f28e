"""FLOP counts: C = 6ND, Kaplan et al. (2020) Table 1, and the exact matmul FLOPs of our own models.

The exact count is what the trainer divides by peak FLOP/s for MFU, so it counts every matmul the
forward pass really runs (2 FLOPs per multiply-add), including the attention score and value matmuls
over the full L x L grid (causal masking does not skip work) and the LM head over the vocabulary.
Training = 3x forward: each matmul has two backward matmuls (input and weight gradients).
Elementwise work (softmax, norms, activations) and embedding gathers are not counted.
"""
from lm_jax.models import layers
from lm_jax.models.t5 import num_decoder_layers

PF_DAY = 1e15 * 24 * 3600  # 8.64e19 FLOP


def flops_6nd(n, d):
  """Training FLOPs ~ 6 N D (Kaplan §2.1, Chinchilla §3.3): 2 forward + 4 backward per param per token."""
  return 6.0 * n * d


def kaplan_params(n_layer, d_model, d_attn=None, d_ff=None):
  """Kaplan's non-embedding N = 2 d_model n_layer (2 d_attn + d_ff) (~12 n_layer d_model^2)."""
  d_attn = d_model if d_attn is None else d_attn
  d_ff = 4 * d_model if d_ff is None else d_ff
  return 2 * d_model * n_layer * (2 * d_attn + d_ff)


def kaplan_forward_flops_per_token(n_layer, d_model, n_ctx, d_attn=None, d_ff=None, n_vocab=0):
  """Kaplan Table 1: C_fwd = 2N + 2 n_layer n_ctx d_attn; n_vocab > 0 adds embed (4 d) and de-embed (2 d V)."""
  d_attn = d_model if d_attn is None else d_attn
  c = 2 * kaplan_params(n_layer, d_model, d_attn, d_ff) + 2 * n_layer * n_ctx * d_attn
  if n_vocab:
    c += 4 * d_model + 2 * d_model * n_vocab
  return float(c)


def attention_width(model_cfg):
  """num_heads * head_dim: the width of the query/key/value projections (Kaplan's d_attn)."""
  return model_cfg.num_heads * layers.head_dim(model_cfg)


def _dims(m):
  return m.d_model, attention_width(m), m.d_ff


def _self_attention(m, length):
  """QKV + output projections and the two L x L attention matmuls."""
  d, d_attn, _ = _dims(m)
  return 2 * length * d * 4 * d_attn + 2 * 2 * length * length * d_attn


def _cross_attention(m, q_len, kv_len):
  d, d_attn, _ = _dims(m)
  proj = 2 * q_len * d * 2 * d_attn + 2 * kv_len * d * 2 * d_attn  # Q, out on queries; K, V on the encoder
  return proj + 2 * 2 * q_len * kv_len * d_attn


def _ffn(m, length):
  d, _, d_ff = _dims(m)
  return 2 * length * d * d_ff * (3 if m.gated_ffn else 2)


def forward_flops_per_sequence(model_cfg, seq_len, target_len=0, num_predictions=0):
  """Matmul FLOPs of one forward pass on one example (see train_flops_per_sequence)."""
  m = model_cfg
  d, v = m.d_model, m.vocab_size
  if m.family == "gpt":
    layer = _self_attention(m, seq_len) + _ffn(m, seq_len)
    return float(m.num_layers * layer + 2 * seq_len * d * v)
  if m.family == "bert":
    layer = _self_attention(m, seq_len) + _ffn(m, seq_len)
    heads = num_predictions or seq_len          # sparse MLM head when positions are given
    mlm = 2 * heads * d * d + 2 * heads * d * v  # transform dense + tied decoder
    pooler_nsp = 2 * d * d + 2 * d * 2           # [CLS] only
    return float(m.num_layers * layer + mlm + pooler_nsp)
  if m.family == "t5":
    if target_len <= 0:
      raise ValueError(f"train_flops: t5 needs target_len > 0, got {target_len}")
    enc = m.num_layers * (_self_attention(m, seq_len) + _ffn(m, seq_len))
    dec_layer = _self_attention(m, target_len) + _cross_attention(m, target_len, seq_len) + _ffn(m, target_len)
    dec = num_decoder_layers(m) * dec_layer
    return float(enc + dec + 2 * target_len * d * v)
  raise ValueError(f"train_flops: unknown model family {m.family!r}; known: bert, gpt, t5")


def train_flops_per_sequence(model_cfg, seq_len, target_len=0, num_predictions=0):
  """Exact training FLOPs for ONE example: 3x the forward matmul FLOPs.

  seq_len: encoder/decoder input length; target_len: T5 decoder length; num_predictions > 0: BERT's
  sparse MLM head runs on that many positions only (max_predictions_per_seq).
  """
  return 3.0 * forward_flops_per_sequence(model_cfg, seq_len, target_len, num_predictions)

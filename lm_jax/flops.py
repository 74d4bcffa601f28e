"""FLOP counts: C = 6ND, Kaplan et al. (2020) Table 1, and the per-layer matmul FLOPs our models are summed from.

Each model family sums its own forward pass from these helpers (`Family.forward_flops`, next to the model) for an
objective's `Lengths`; the trainer divides 3x that by the peak FLOP/s for MFU. The count is every matmul the
forward pass really runs (2 FLOPs per multiply-add): the attention score and value matmuls over the full L x L
grid (causal masking does not skip work), and the vocabulary head only on the `scored` positions (what the loss
reads; jit drops logits nothing reads). Elementwise work (softmax, norms, activations) and embedding gathers are
not counted.

Training = 3x forward: each matmul has two backward matmuls (input and weight gradients). With frozen weights
(a fine-tune's freeze patterns, LoRA's or IA3's base, DPO's reference) a weight-gradient matmul is not run, so
3x forward is an upper bound there: such runs log an MFU that overstates the work by up to a third of the frozen
matmuls' share (and the DPO reference's forward pass is not counted at all).
"""
import dataclasses

PF_DAY = 1e15 * 24 * 3600  # 8.64e19 FLOP


@dataclasses.dataclass(frozen=True)
class Lengths:
  """Per-example sizes the FLOP and memory counts need: encoder (or decoder-only) input tokens, decoder
  target tokens (0 without a decoder), and positions scored by the output head over the vocabulary."""
  inputs: int
  targets: int
  scored: int


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


def attention_width(m):
  """num_heads * head_dim of a model config: the width of the query and output projections (Kaplan's d_attn)."""
  return m.num_heads * (m.head_dim or m.d_model // m.num_heads)


def kv_width(m):
  """num_kv_heads * head_dim: the width of the key and value projections (attention_width without grouped heads;
  num_kv_heads 0 or absent = num_heads)."""
  return (m.get("num_kv_heads", 0) or m.num_heads) * (m.head_dim or m.d_model // m.num_heads)


def dense(tokens, d_in, d_out):
  """A (d_in, d_out) weight applied to `tokens` positions."""
  return 2 * tokens * d_in * d_out


def self_attention(m, length):
  """Q and output projections, K and V projections (kv_width), and the two L x L attention matmuls (every query
  head: a grouped kv head is read by each of its query heads)."""
  d_attn = attention_width(m)
  return (dense(length, m.d_model, 2 * d_attn) + dense(length, m.d_model, 2 * kv_width(m))
          + 2 * 2 * length * length * d_attn)


def cross_attention(m, q_len, kv_len):
  """Q and out projections on the queries, K and V on the encoder output, and the two q x kv matmuls."""
  d_attn = attention_width(m)
  return (dense(q_len, m.d_model, 2 * d_attn) + dense(kv_len, m.d_model, 2 * kv_width(m))
          + 2 * 2 * q_len * kv_len * d_attn)


def ffn(m, length):
  return dense(length, m.d_model, m.d_ff) * (3 if m.gated_ffn else 2)


def encoder_layer(m, length):
  """One self-attention + FFN layer (BERT, GPT, T5's encoder)."""
  return self_attention(m, length) + ffn(m, length)

"""Bytes a model keeps: activations for the backward pass and a decoding KV cache, summed by each family
(`Family.activation_bytes`, `Family.kv_cache_bytes`) from these helpers, as lm_jax/flops.py's are for FLOPs.

activations: analytic, what the backward pass keeps per layer (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", §4 without sequence parallelism), per token, with D = d_model,
  A = heads*head_dim / t, K = kv_heads*head_dim / t (= A without grouped kv heads), F = d_ff / t, H = heads / t,
  t = the mesh size `heads`/`mlp` map to:
    self-attention layer   (4D + 2A + 2K + kF) * c  +  4 H S_kv   k = 2 (4 for a gated FFN), c = bytes of
                           [LN/residual inputs 4D, q and the out-projection input 2A, k v 2K, FFN pre- and
                           post-activation kF, float32 softmax probabilities H S_kv]
    + cross-attention      (2D + 2A) * c + 4 H S_enc per decoder token, + 2K * c per encoder token (k, v)
    + dropout              1-byte masks (2D + F, + H S_kv with attention dropout, which also keeps the
                           dropped probabilities: + 4 H S_kv)
  remat 'minimal' keeps only the weight matmuls' outputs (A + 2K + 2D + F or 2F for gated, + cross A + D, +
  2K per encoder token) plus the layer input D; 'full' keeps the layer input D; both add one layer's full set,
  recomputed during its backward. Outside the layers: embeddings and final norm (3D per token), the loss head
  (float32 logits + log-probabilities, 8 V/t bytes per scored token; a head transform, BERT's, 4D per prediction).
KV cache: keys and values (rows, kv_heads, length, head_dim) in model.dtype per attention layer.
"""
import numpy as np

from lm_jax.models import layers


def kv_heads(cfg) -> int:
  """Key/value heads: model.num_kv_heads where the family has it (0 = num_heads), else num_heads."""
  return cfg.get("num_kv_heads", 0) or cfg.num_heads


def _itemsize(cfg) -> int:
  return np.dtype(layers.dtype(cfg.dtype)).itemsize


def stack(cfg, div: dict, n: int, tokens: int, s_kv: int, enc_tokens: int = 0, s_enc: int = 0) -> int:
  """Bytes one example keeps in `n` layers over `tokens` tokens attending to s_kv keys, and (s_enc > 0) with
  cross-attention to `enc_tokens` encoder tokens; div = devices that split 'heads', 'mlp', 'vocab'."""
  c, D, hd = _itemsize(cfg), cfg.d_model, layers.head_dim(cfg)
  H, KH = -(-cfg.num_heads // div["heads"]), -(-kv_heads(cfg) // div["heads"])
  A, K, F = H * hd, KH * hd, -(-cfg.d_ff // div["mlp"])
  k = 4 if cfg.gated_ffn else 2
  p, pa = cfg.dropout_rate > 0, cfg.attention_dropout_rate > 0

  def layer():
    """(bytes per query token, bytes per encoder token) of one layer without remat."""
    tok = (4 * D + 2 * A + 2 * K + k * F) * c + 4 * H * s_kv + p * (2 * D + F) + pa * 5 * H * s_kv
    enc = 0
    if s_enc:
      tok += (2 * D + 2 * A) * c + 4 * H * s_enc + p * D + pa * 5 * H * s_enc
      enc = 2 * K * c
    return tok, enc

  def saved():
    """Bytes per token (and per encoder token) the remat policy keeps for one layer."""
    if cfg.remat_policy == "full":
      return D * c, 0
    if cfg.remat_policy == "minimal":
      cross = (A + D) * c if s_enc else 0
      return (A + 2 * K + 3 * D + (k // 2) * F) * c + cross, (2 * K * c if s_enc else 0)
    return layer()

  tok, enc = saved()
  total = n * (tok * tokens + enc * enc_tokens)
  if cfg.remat_policy != "none":  # one layer recomputed in full during its backward
    full_tok, full_enc = layer()
    total += full_tok * tokens + full_enc * enc_tokens
  return total


def outside(cfg, lengths, div: dict, head_transform: bool = False) -> int:
  """Bytes one example keeps outside the layers: embeddings and final norm on every input and target token, the
  loss head (and a d_model transform before it) on the scored ones."""
  c, D = _itemsize(cfg), cfg.d_model
  V = -(-cfg.vocab_size // div["vocab"])
  head = 8 * V + (4 * D * c if head_transform else 0)
  return (3 * D * c + (cfg.dropout_rate > 0) * D) * (lengths.inputs + lengths.targets) + head * lengths.scored


def one_stack(cfg, lengths, div: dict, head_transform: bool = False) -> int:
  """Activation bytes of one example of an encoder or a decoder: num_layers self-attention layers over the
  inputs, and what is outside them."""
  return outside(cfg, lengths, div, head_transform) + stack(cfg, div, cfg.num_layers, lengths.inputs,
                                                             lengths.inputs)


def scanned_extra(cfg, div: dict, s_kv: int) -> int:
  """Bytes per token per layer that a scanned stack of pre-RMSNorm SwiGLU / GQA blocks (Llama, Qwen3) keeps beyond
  stack()'s count: scan's autodiff saves its body's residuals as they are (those of jax.linearize of one layer),
  where XLA fuses an unrolled layer's elementwise ones away and keeps one buffer per value. Beyond stack() they
  are each RMSNorm's input normalised before its scale (2D), the residual stream and the norms' outputs in the
  params' dtype (p bytes, where stack() counts c), the (tokens, features) copy of each Dense input (query, key,
  value: 3D, gate and up: 2D, down: F; the out projection's is stack()'s A), the gated FFN's fifth F-sized value
  (gate, up, act(gate), their product), and the probabilities a second time when the attention dot reads another
  view of them: grouped as (K, G, S) (float32), or cast to a narrower model.dtype (c bytes). smollm_135m (float32,
  2048 tokens): 216 KB per token per layer where stack() counts 114; compiled (v5e-8, 30 layers, 2 and 4 rows)
  157 KB, XLA rematerialising under the memory limit; looped (v4-8) 98 KB."""
  if not cfg.scan_layers:
    return 0
  c, p = _itemsize(cfg), np.dtype(layers.dtype(cfg.param_dtype)).itemsize
  D, F, H = cfg.d_model, -(-cfg.d_ff // div["mlp"]), -(-cfg.num_heads // div["heads"])
  view = c if c < 4 else 4 * (kv_heads(cfg) < cfg.num_heads)
  return 2 * D * p + 4 * D * (p - c) + (5 * D + F + (F if cfg.gated_ffn else 0)) * c + view * H * s_kv


def with_scanned(cfg, lengths, div: dict, extra, scanned: int, head_transform: bool = False) -> int:
  """one_stack() plus `extra(cfg, div, s_kv)`, the bytes per token per layer a scanned layer keeps beyond it, for
  each of the `scanned` layers without remat, else for the one recomputed in full during its backward."""
  n = scanned if cfg.remat_policy == "none" else min(1, scanned)
  return one_stack(cfg, lengths, div, head_transform) + n * lengths.inputs * extra(cfg, div, lengths.inputs)


def pre_norm_stack(cfg, lengths, div: dict) -> int:
  """Family.activation_bytes of Llama and Qwen3: with_scanned() of scanned_extra over every layer."""
  return with_scanned(cfg, lengths, div, scanned_extra, cfg.num_layers)


def grouped_extra(cfg, div: dict, s_kv: int) -> int:
  """Bytes per token per layer that ModernBERT's scanned groups keep beyond stack()'s count: scanned_extra's
  values (its LayerNorms' normalised inputs as the RMSNorms'), the probabilities' second copy in model.dtype in
  float32 too (scanned_extra counts it only where narrower), and the float32 statistics of the two LayerNorms
  (mean, variance) and the softmax (max, sum per head). base (float32, 1024 tokens): 89 KB per token per layer
  beyond stack()'s 92; exact against jax.grad's scan residuals (tiny, float32 and bfloat16)."""
  c, H = _itemsize(cfg), -(-cfg.num_heads // div["heads"])
  return scanned_extra(cfg, div, s_kv) + (c == 4) * 4 * H * s_kv + 4 * (4 + 2 * H)


def cache(cfg, rows: int, length: int, n: int) -> int:
  """Bytes of keys and values (rows, kv_heads, length, head_dim) in model.dtype for `n` attention layers."""
  return 2 * n * rows * kv_heads(cfg) * length * layers.head_dim(cfg) * _itemsize(cfg)


def decoder_cache(cfg, rows: int, length: int, inputs: int = 0) -> int:
  """A decoder's KV cache: every layer's keys and values for `length` positions (no encoder: inputs unused)."""
  del inputs
  return cache(cfg, rows, length, cfg.num_layers)

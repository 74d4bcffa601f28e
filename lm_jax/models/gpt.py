"""GPT-1 (Radford et al. 2018; openai/finetune-transformer-lm): post-LN causal decoder.

Token + learned position embeddings, blocks.PostLNBlock with a causal mask, LM head tied to the
token embeddings, N(0, initializer_range) init. A model config with num_labels > 0 adds a linear head
'classifier' on the final hidden state of every position ('scores' (B,T,num_labels)): GPT-1's task head
read at the extract token (paper §3.3), and the scalar reward / value head (num_labels = 1) of RLHF.
Packed rows: segment_ids keep documents apart and positions restart per document. Incremental decoding
uses an explicit KV cache (init_cache/decode).
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lm_jax import flops
from lm_jax.models import attention, blocks, costs, layers, mup, relayout
from lm_jax.models.registry import Family, Tokens

FIELDS = {                 # beyond defaults.model_defaults' shared fields
    "max_positions": 512,  # learned position embeddings
    "mup_base_width": 0,   # µP's base d_model (lm_jax/models/mup.py); 0 = standard parametrization
}

HEADS = ("classifier",)


class Model(nn.Module):
  """batch: input_ids (B,T), optional attention_mask (B,T), segment_ids (B,T) (0 = padding),
  positions (B,T). -> logits (B,T,V) for the next token, hidden (B,T,D), and with cfg.num_labels > 0
  scores (B,T,num_labels) float32.

  With `cache` (see init_cache) the tokens are appended at cache['index'] and attend to everything
  cached before them; positions default to index + arange(T); the output also has the new 'cache'.
  """
  cfg: Any

  @nn.compact
  def __call__(self, batch: dict, train: bool = False, cache: dict | None = None) -> dict:
    cfg = self.cfg
    init = nn.initializers.normal(cfg.initializer_range)
    positions, mask, layer_cache, index, key_mask = causal_inputs(batch, cache)
    x, embed = embed_inputs(cfg, batch["input_ids"], positions, train)
    x, layer_cache = blocks.stack(blocks.PostLNBlock, cfg.num_layers, scan=cfg.scan_layers, remat=cfg.remat_policy,
                                  cfg=cfg, deterministic=not train, kernel_init=init)(x, layer_cache, mask, index)
    out = outputs(cfg, x, embed)
    if cache is not None:
      out["cache"] = {"layers": layer_cache, "mask": key_mask, "index": index + batch["input_ids"].shape[1]}
    return out


def embed_inputs(cfg, ids, positions, train: bool):
  """Token + learned position embeddings and dropout, created in the calling Model (GPT-1's and GPT-2's params)
  -> (x (B,T,D), the token Embed, whose `attend` is the tied LM head)."""
  kw = layers.dtypes(cfg)
  init = nn.initializers.normal(cfg.initializer_range)
  embed = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="word_embeddings", **kw)
  x = embed(ids) + layers.Embed(cfg.max_positions, cfg.d_model, (None, "embed"), embedding_init=init,
                                name="position_embeddings", **kw)(positions)
  x = layers.Dropout(cfg.dropout_rate, deterministic=not train)(x)
  return layers.constrain(x, ("batch", "length", "embed")), embed


def outputs(cfg, x, embed) -> dict:
  """The calling Model's outputs from the last hidden state: logits of the tied LM head, hidden, and with
  num_labels > 0 the 'classifier' head's scores."""
  logits = layers.constrain(embed.attend(mup.readout(cfg, x)), ("batch", "length", "vocab")).astype(jnp.float32)
  out = {"logits": logits, "hidden": x}
  if cfg.get("num_labels", 0):
    init = nn.initializers.normal(cfg.initializer_range)
    out["scores"] = layers.Dense((cfg.num_labels,), ("embed", None), kernel_init=init, name="classifier",
                                 **layers.dtypes(cfg))(mup.readout(cfg, x)).astype(jnp.float32)
  return out


def causal_inputs(batch: dict, cache: dict | None):
  """A causal decoder's view of a batch (see Model): (positions, attention mask, the layers' caches or None,
  write index or None, the cache's filled-slot mask after this step or None)."""
  ids, key_mask = batch["input_ids"], batch.get("attention_mask")
  length = ids.shape[1]
  if cache is None:
    positions = batch.get("positions", jnp.arange(length)[None])
    mask = attention.make_attention_mask(key_mask, causal=True, q_len=length, kv_len=length,
                                      q_segments=batch.get("segment_ids"))
    return positions, mask, None, None, None
  index = cache["index"]
  new = jnp.ones_like(ids, dtype=bool) if key_mask is None else key_mask.astype(bool)
  key_mask = jax.lax.dynamic_update_slice(cache["mask"], new, (0, index))
  q_index = index + jnp.arange(length)[None]
  mask = attention.make_attention_mask(key_mask, causal=True, q_index=q_index,
                                    kv_index=jnp.arange(key_mask.shape[1])[None])
  return batch.get("positions", q_index), mask, cache["layers"], index, key_mask


def check_config(cfg) -> None:
  n = cfg.get("num_labels", 0)
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"model.num_labels must be a non-negative integer (0 = no task head), got {n!r}")
  mup.check(cfg)


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "attention_mask": ids + 1}


def forward_flops(cfg, lengths) -> float:
  """The layers, the tied LM head on the scored positions, a task head (num_labels > 0) on every position."""
  total = cfg.num_layers * flops.encoder_layer(cfg, lengths.inputs) + flops.dense(lengths.scored, cfg.d_model,
                                                                                 cfg.vocab_size)
  return total + flops.dense(lengths.inputs, cfg.d_model, cfg.get("num_labels", 0))


def init_cache(cfg, params: dict, batch: dict, max_length: int) -> dict:
  """Empty cache for batch['input_ids'].shape[0] rows (params unused: the signature is shared with T5):
  'layers', per layer {'k', 'v'} (B, heads, max_length, head_dim) in model.dtype (attention.cache_layout), mask
  (B, max_length) of filled slots, index = next slot."""
  del params
  if max_length > cfg.max_positions:
    raise ValueError(f"cache max_length {max_length} exceeds model.max_positions {cfg.max_positions}")
  batch_size = batch["input_ids"].shape[0]
  shape = (batch_size, cfg.num_heads, max_length, layers.head_dim(cfg))
  zeros = lambda: jnp.zeros(shape, layers.dtype(cfg.dtype))
  return {"layers": tuple({"k": zeros(), "v": zeros()} for _ in range(cfg.num_layers)),
          "mask": jnp.zeros((batch_size, max_length), bool), "index": jnp.zeros((), jnp.int32)}


def decode_step(cfg, params: dict, input_ids: jax.Array, cache: dict, attention_mask: jax.Array | None = None,
                positions: jax.Array | None = None, *, model: type[nn.Module] = Model) -> tuple[jax.Array, dict]:
  """Appends input_ids (B,T) at cache['index'] -> (logits (B,T,V), cache). attention_mask marks padding
  among the new tokens; positions default to index + arange(T). The first call can feed the prompt. `model`: a
  Model of the same inputs and cache (GPT-2's). Scanned params are split into layers (relayout.unscanned) here:
  a decoding loop splits them once before it."""
  batch = {"input_ids": input_ids}
  if attention_mask is not None:
    batch["attention_mask"] = attention_mask
  if positions is not None:
    batch["positions"] = positions
  cfg, params = relayout.unscanned(cfg, params)
  out = model(cfg).apply({"params": params}, batch, cache=cache)
  return out["logits"], out["cache"]



TOKENS = Tokens(spm=dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1), required=("eos_id",))
FAMILY = Family(name="gpt", layout="decoder", Model=Model, example_batch=example_batch, forward_flops=forward_flops,
                tokens=TOKENS, fields=FIELDS, sizes=("max_positions",), check_config=check_config, heads=HEADS,
                learned_positions=True, kv_cache_bytes=costs.decoder_cache, init_cache=init_cache,
                decode_step=decode_step)

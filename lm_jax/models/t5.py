"""T5 encoder-decoder (Raffel et al. 2020), v1.0 and v1.1, layer for layer as HF T5ForConditionalGeneration.

Pre-norm RMS LayerNorm (no mean, no bias), no biases anywhere, unscaled attention logits (the 1/sqrt(d_kv) is
folded into the query init), one relative-position bias table per stack (bidirectional buckets in the encoder,
causal in the decoder) computed once and added in every layer of that stack, cross-attention, a final norm
per stack. v1.0: ReLU FFN and a head tied to the embeddings with the decoder output scaled by d_model**-0.5;
v1.1 (gated_ffn, gelu_tanh, tie_embeddings=False): gated-GELU FFN and a separate lm_head.

Initialisers follow T5X / HF: embeddings N(0, 1), q N(0, (d_model d_kv)^-1/2), k/v N(0, d_model^-1/2),
o N(0, (heads d_kv)^-1/2), wi N(0, d_model^-1/2), wo N(0, d_ff^-1/2), relative bias N(0, d_model^-1/2),
untied lm_head N(0, d_model^-1/2) (T5X's fan-in init; HF's is N(0, 1)).

Incremental decoding: `init_cache` runs the encoder and projects its cross-attention keys/values once, and
allocates the decoder self-attention cache; `decode_step` feeds any number of new decoder tokens and returns
their logits and the updated cache.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from lm_jax import flops
from lm_jax.models import attention, blocks, costs, layers, relayout
from lm_jax.models.registry import Family, Tokens

FIELDS = {                 # model config fields of T5's own, beyond defaults.model_defaults' shared ones
    "num_decoder_layers": 0,  # 0 = num_layers
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "tie_embeddings": True,   # v1.0's head tied to the embeddings; v1.1 has its own lm_head
    "decoder_start_token_id": 0,
}


def num_decoder_layers(cfg) -> int:
  return cfg.num_decoder_layers or cfg.num_layers


def check_config(cfg) -> None:
  """T5-only checks (lm_jax.models.validate runs the generic ones first)."""
  n = cfg.num_decoder_layers
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"model.num_decoder_layers must be a non-negative integer (0 = num_layers), got {n!r}")
  buckets, distance = cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
  if buckets < 4:
    raise ValueError(f"model.relative_attention_num_buckets must be >= 4 (exact buckets per direction), got {buckets}")
  if distance <= buckets // 2:
    raise ValueError(f"model.relative_attention_max_distance {distance} must exceed "
                     f"relative_attention_num_buckets // 2 = {buckets // 2}")


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jax.Array:
  """Bucket of key_pos - query_pos: exact below num_buckets/2 (per direction), log-spaced up to max_distance.

  Mesh TensorFlow's rule (HF T5Attention._relative_position_bucket), including its float32 log.
  """
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = (relative_position > 0).astype(relative_position.dtype) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(relative_position.dtype)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(distance < max_exact, distance, large)


class RelativeBias(nn.Module):
  """(1, heads, T, S) additive attention bias from a learned (buckets, heads) table."""
  cfg: ml_collections.FrozenConfigDict
  bidirectional: bool

  @nn.compact
  def __call__(self, q_pos: jax.Array, kv_pos: jax.Array) -> jax.Array:
    cfg = self.cfg
    table = layers.Embed(cfg.relative_attention_num_buckets, cfg.num_heads, axes=("relpos_buckets", "heads"),
                         embedding_init=nn.initializers.normal(cfg.d_model ** -0.5), name="table",
                         **layers.dtypes(cfg))
    bucket = relative_position_bucket(kv_pos[None, :] - q_pos[:, None], bidirectional=self.bidirectional,
                                      num_buckets=cfg.relative_attention_num_buckets,
                                      max_distance=cfg.relative_attention_max_distance)
    return jnp.transpose(table(bucket), (2, 0, 1))[None]


class Block(nn.Module):
  """One T5 layer: pre-norm self-attention, [pre-norm cross-attention], pre-norm FFN, each + residual.

  cache (decoding): this layer's self-attention 'k'/'v' and the encoder's 'cross_k'/'cross_v' (read only); returns
  it with the self-attention part updated.
  """
  cfg: ml_collections.FrozenConfigDict
  decoder: bool
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, cache, mask, bias, encoded=None, cross_mask=None, cache_index=None):
    cfg = self.cfg
    d, h, dh = cfg.d_model, cfg.num_heads, layers.head_dim(cfg)
    kw = layers.dtypes(cfg)
    norm = lambda name: layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, use_mean=False, name=name, **kw)
    drop = lambda y: layers.Dropout(cfg.dropout_rate, deterministic=self.deterministic)(y)
    attend = lambda name: attention.Attention(
        h, dh, use_bias=False, scale_logits=False, dropout_rate=cfg.attention_dropout_rate,
        deterministic=self.deterministic, kernel_init=nn.initializers.normal(d ** -0.5),
        query_init=nn.initializers.normal((d * dh) ** -0.5), out_init=nn.initializers.normal((h * dh) ** -0.5),
        name=name, **kw)

    self_cache = None if cache is None else {"k": cache["k"], "v": cache["v"]}
    y, self_cache = attend("self_attention")(norm("self_attention_norm")(x), mask=mask, bias=bias,
                                                cache=self_cache, cache_index=cache_index)
    x = x + drop(y)
    if self.decoder:
      y = norm("cross_attention_norm")(x)
      if cache is None:
        y, _ = attend("cross_attention")(y, encoded, mask=cross_mask)
      else:  # decoding: the encoder's keys/values are in the cache
        y, _ = attend("cross_attention")(y, mask=cross_mask, cache={"k": cache["cross_k"], "v": cache["cross_v"]})
      x = x + drop(y)
    y = layers.MLP(cfg.d_ff, cfg.activation, gated=cfg.gated_ffn, use_bias=False, dropout_rate=cfg.dropout_rate,
                   deterministic=self.deterministic, kernel_init=nn.initializers.normal(d ** -0.5),
                   out_init=nn.initializers.normal(cfg.d_ff ** -0.5), name="mlp", **kw)(norm("mlp_norm")(x))
    x = layers.constrain(x + drop(y), ("batch", "length", "embed"))
    return x, None if cache is None else {**cache, **self_cache}


class Stack(nn.Module):
  """Embedded tokens -> layers (sharing one relative bias) -> final RMS norm -> dropout."""
  cfg: ml_collections.FrozenConfigDict
  decoder: bool

  @nn.compact
  def __call__(self, x, mask, q_pos, kv_pos, encoded=None, cross_mask=None, cache=None, cache_index=None, *,
               deterministic: bool = True):
    cfg = self.cfg
    drop = lambda y: layers.Dropout(cfg.dropout_rate, deterministic=deterministic)(y)
    bias = RelativeBias(cfg, bidirectional=not self.decoder, name="relative_bias")(q_pos, kv_pos)
    n = num_decoder_layers(cfg) if self.decoder else cfg.num_layers
    run = blocks.stack(Block, n, scan=cfg.scan_layers, remat=cfg.remat_policy, cfg=cfg, decoder=self.decoder,
                       deterministic=deterministic)
    shared = (mask, bias) + ((encoded, cross_mask, cache_index) if self.decoder else ())
    x, cache = run(drop(x), cache, *shared)
    x = layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, use_mean=False, name="final_norm",
                         **layers.dtypes(cfg))(x)
    return layers.constrain(drop(x), ("batch", "length", "embed")), cache


class Model(nn.Module):
  """Params: shared (vocab, embed), encoder, decoder, and lm_head when the embeddings are untied.

  batch: input_ids, attention_mask (B,L); decoder_input_ids, decoder_attention_mask (B,T) (masks optional) ->
  logits (B,T,V) float32, hidden (B,T,D) (decoder, after its final norm), encoder_hidden (B,L,D).
  """
  cfg: ml_collections.FrozenConfigDict

  def setup(self):
    cfg = self.cfg
    kw = layers.dtypes(cfg)
    self.shared = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(1.0), **kw)
    if not cfg.tie_embeddings:
      self.lm_head = layers.Dense((cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                                  kernel_init=nn.initializers.normal(cfg.d_model ** -0.5), **kw)
    self.encoder = Stack(cfg, decoder=False)
    self.decoder = Stack(cfg, decoder=True)

  def encode(self, input_ids, attention_mask, train: bool = False):
    x = layers.constrain(self.shared(input_ids), ("batch", "length", "embed"))
    pos = jnp.arange(input_ids.shape[1])
    x, _ = self.encoder(x, attention.make_attention_mask(attention_mask), pos, pos, deterministic=not train)
    return x

  def decode(self, decoder_input_ids, decoder_attention_mask, encoded, attention_mask, *, cache=None,
             train: bool = False):
    """-> (logits, hidden, the layers' new caches). With a cache (see init_cache) the queries sit at
    index + arange(T), the keys are all cache slots, decoder_attention_mask (B, slots) marks the filled ones
    and the cross-attention uses the cached encoder keys/values (`encoded` is unused)."""
    t = decoder_input_ids.shape[1]
    x = layers.constrain(self.shared(decoder_input_ids), ("batch", "length", "embed"))
    if cache is None:
      index, kv, q_pos = None, None, jnp.arange(t)
      kv_pos = q_pos
    else:
      index, kv, q_pos = cache["index"], cache["layers"], cache["index"] + jnp.arange(t)
      kv_pos = jnp.arange(cache["mask"].shape[1])
    mask = attention.make_attention_mask(decoder_attention_mask, causal=True, q_index=q_pos[None],
                                      kv_index=kv_pos[None])
    cross_mask = attention.make_attention_mask(attention_mask)
    hidden, kv = self.decoder(x, mask, q_pos, kv_pos, encoded, cross_mask, kv, index, deterministic=not train)
    if self.cfg.tie_embeddings:
      logits = self.shared.attend(hidden * self.cfg.d_model ** -0.5)
    else:
      logits = self.lm_head(hidden)
    return layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32), hidden, kv

  def __call__(self, batch: dict, train: bool = False) -> dict:
    mask = batch.get("attention_mask")
    encoded = self.encode(batch["input_ids"], mask, train)
    logits, hidden, _ = self.decode(batch["decoder_input_ids"], batch.get("decoder_attention_mask"), encoded, mask,
                                    train=train)
    return {"logits": logits, "hidden": hidden, "encoder_hidden": encoded}


def example_batch(cfg) -> dict:
  ids = jnp.zeros((1, 2), jnp.int32)
  return {"input_ids": ids, "attention_mask": ids + 1, "decoder_input_ids": ids, "decoder_attention_mask": ids + 1}


def init_cache(cfg, params: dict, batch: dict, max_length: int) -> dict:
  """Runs the encoder on batch['input_ids'/'attention_mask'] once and projects its keys/values for every
  decoder layer's cross-attention; the decoder self-attention cache starts empty.

  'layers': per decoder layer k/v (B, heads, max_length, head_dim) and cross_k/cross_v (B, heads, L, head_dim)
  in model.dtype (attention.cache_layout), mask (B, max_length) of filled slots, index = next slot, encoder_mask
  (B, L).
  """
  cfg = layers.frozen(cfg)
  enc_mask = batch.get("attention_mask", jnp.ones(batch["input_ids"].shape, jnp.int32))
  encoded = Model(cfg).apply({"params": params}, batch["input_ids"], enc_mask, method=Model.encode)
  dt, n, b = layers.dtype(cfg.dtype), num_decoder_layers(cfg), encoded.shape[0]
  project = lambda p: attention.cache_layout(jnp.einsum("bsd,dhk->bshk", encoded, p["kernel"].astype(dt)))
  zeros = lambda: jnp.zeros((b, cfg.num_heads, max_length, layers.head_dim(cfg)), dt)
  caches = tuple({"k": zeros(), "v": zeros(), "cross_k": project(p["cross_attention"]["key"]),
                  "cross_v": project(p["cross_attention"]["value"])} for p in relayout.get_layers(params["decoder"], n))
  return {"layers": caches, "mask": jnp.zeros((b, max_length), bool), "index": jnp.zeros((), jnp.int32),
          "encoder_mask": jnp.asarray(enc_mask)}


def decode_step(cfg, params: dict, input_ids: jax.Array, cache: dict,
                attention_mask: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """Appends decoder tokens input_ids (B,T) at cache['index'] -> (their logits (B,T,V), updated cache).
  attention_mask (B,T) marks padding among the new tokens. The first call can feed a whole prefix. Scanned params
  are split into layers (relayout.unscanned) here: a decoding loop splits them once before it."""
  cfg, params = relayout.unscanned(cfg, params)
  index = cache["index"]
  new = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
  mask = jax.lax.dynamic_update_slice(cache["mask"], new, (0, index))
  logits, _, kv = Model(cfg).apply(
      {"params": params}, input_ids, mask, None, cache["encoder_mask"], cache=cache, method=Model.decode)
  return logits, dict(cache, layers=kv, mask=mask, index=index + input_ids.shape[1])



def forward_flops(cfg, lengths) -> float:
  """Encoder layers on the inputs; decoder layers (self- and cross-attention) on the targets; the LM head on the
  scored targets."""
  if lengths.targets <= 0:
    raise ValueError(f"train_flops: t5 needs target_len > 0, got {lengths.targets}")
  t = lengths.targets
  decoder_layer = flops.self_attention(cfg, t) + flops.cross_attention(cfg, t, lengths.inputs) + flops.ffn(cfg, t)
  return (cfg.num_layers * flops.encoder_layer(cfg, lengths.inputs) + num_decoder_layers(cfg) * decoder_layer
          + flops.dense(lengths.scored, cfg.d_model, cfg.vocab_size))


def activation_bytes(cfg, lengths, div) -> int:
  """The encoder's layers over the inputs, the decoder's over the targets with cross-attention to the inputs."""
  return costs.one_stack(cfg, lengths, div) + costs.stack(cfg, div, num_decoder_layers(cfg), lengths.targets,
                                                          lengths.targets, lengths.inputs, lengths.inputs)


def kv_cache_bytes(cfg, rows: int, length: int, inputs: int = 0) -> int:
  """Every decoder layer's self-attention keys/values over `length` and cross-attention ones over `inputs`."""
  return costs.cache(cfg, rows, length, num_decoder_layers(cfg)) + costs.cache(cfg, rows, inputs,
                                                                                num_decoder_layers(cfg))


FAMILY = Family(
    name="t5", layout="encoder_decoder", Model=Model, example_batch=example_batch, forward_flops=forward_flops,
    fields=FIELDS, sizes=("relative_attention_num_buckets", "relative_attention_max_distance"),
    check_config=check_config, activation_bytes=activation_bytes, kv_cache_bytes=kv_cache_bytes,
    tokens=Tokens(spm=dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1), required=("pad_id", "eos_id"), sentinels=True,
                  template=("$A", "eos_id")),
    init_cache=init_cache, decode_step=decode_step)

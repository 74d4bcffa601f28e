"""T5 encoder-decoder (Raffel et al. 2020), v1.0 and v1.1, layer for layer as HF T5ForConditionalGeneration.

Pre-norm RMS LayerNorm (no mean, no bias), no biases anywhere, unscaled attention logits (the 1/sqrt(d_kv) is
folded into the query init), one relative-position bias table per stack (bidirectional buckets in the encoder,
causal in the decoder) computed once and added in every layer of that stack, cross-attention, a final norm
per stack. v1.0: ReLU FFN and a head tied to the embeddings with the decoder output scaled by d_model**-0.5;
v1.1 (gated_ffn, gelu_tanh, tie_embeddings=False): gated-GELU FFN and a separate lm_head.

Initialisers follow T5X / HF: embeddings N(0, 1), q N(0, (d_model d_kv)^-1/2), k/v N(0, d_model^-1/2),
o N(0, (heads d_kv)^-1/2), wi N(0, d_model^-1/2), wo N(0, d_ff^-1/2), relative bias N(0, d_model^-1/2),
untied lm_head N(0, d_model^-1/2) (T5X's fan-in init; HF's is N(0, 1)).

Incremental decoding: `init_cache` runs the encoder once and allocates the decoder self-attention cache;
`decode_step` feeds any number of new decoder tokens and returns their logits and the updated cache.
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lm_jax import defaults
from lm_jax.models import layers

_ACTS_TO_HF = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new"}
_ACTS_FROM_HF = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def num_decoder_layers(cfg) -> int:
  return cfg.num_decoder_layers or cfg.num_layers


def check_config(cfg) -> None:
  """One-line ValueError for a config no T5 can have."""
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff"):
    if cfg[field] <= 0:
      raise ValueError(f"model.{field} must be > 0 for t5, got {cfg[field]}")
  if cfg.num_decoder_layers < 0:
    raise ValueError(f"model.num_decoder_layers must be >= 0 (0 = num_layers), got {cfg.num_decoder_layers}")
  if not cfg.head_dim and cfg.d_model % cfg.num_heads:
    raise ValueError(f"model.d_model {cfg.d_model} is not divisible by model.num_heads {cfg.num_heads}; "
                     "set model.head_dim (T5's d_kv)")
  if cfg.relative_attention_num_buckets < 4:
    raise ValueError(f"model.relative_attention_num_buckets must be >= 4, got {cfg.relative_attention_num_buckets}")
  if cfg.relative_attention_max_distance <= cfg.relative_attention_num_buckets // 2:
    raise ValueError(f"model.relative_attention_max_distance {cfg.relative_attention_max_distance} must exceed "
                     f"relative_attention_num_buckets // 2 = {cfg.relative_attention_num_buckets // 2}")
  layers.activation(cfg.activation)
  layers.dtype(cfg.dtype), layers.dtype(cfg.param_dtype)


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
                         dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype),
                         embedding_init=nn.initializers.normal(cfg.d_model ** -0.5), name="table")
    bucket = relative_position_bucket(kv_pos[None, :] - q_pos[:, None], bidirectional=self.bidirectional,
                                      num_buckets=cfg.relative_attention_num_buckets,
                                      max_distance=cfg.relative_attention_max_distance)
    return jnp.transpose(table(bucket), (2, 0, 1))[None]


class Block(nn.Module):
  """One T5 layer: pre-norm self-attention, [pre-norm cross-attention], pre-norm FFN, each + residual."""
  cfg: ml_collections.FrozenConfigDict
  decoder: bool
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, cache, mask, bias, encoded=None, cross_mask=None, cache_index=None):
    cfg = self.cfg
    d, h, dh = cfg.d_model, cfg.num_heads, layers.head_dim(cfg)
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    norm = lambda name: layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, use_mean=False, name=name, **kw)
    drop = lambda y: nn.Dropout(cfg.dropout_rate, deterministic=self.deterministic)(y)
    attention = lambda name: layers.Attention(
        h, dh, use_bias=False, scale_logits=False, dropout_rate=cfg.attention_dropout_rate,
        deterministic=self.deterministic, kernel_init=nn.initializers.normal(d ** -0.5),
        query_init=nn.initializers.normal((d * dh) ** -0.5), out_init=nn.initializers.normal((h * dh) ** -0.5),
        name=name, **kw)

    y, cache = attention("self_attention")(norm("self_attention_norm")(x), mask=mask, bias=bias, cache=cache,
                                           cache_index=cache_index)
    x = x + drop(y)
    if self.decoder:
      y, _ = attention("cross_attention")(norm("cross_attention_norm")(x), encoded, mask=cross_mask)
      x = x + drop(y)
    y = layers.MLP(cfg.d_ff, cfg.activation, gated=cfg.gated_ffn, use_bias=False, dropout_rate=cfg.dropout_rate,
                   deterministic=self.deterministic, kernel_init=nn.initializers.normal(d ** -0.5),
                   out_init=nn.initializers.normal(cfg.d_ff ** -0.5), name="mlp", **kw)(norm("mlp_norm")(x))
    x = layers.constrain(x + drop(y), ("batch", "length", "embed"))
    return x, cache


class Stack(nn.Module):
  """Embedded tokens -> layers (sharing one relative bias) -> final RMS norm -> dropout."""
  cfg: ml_collections.FrozenConfigDict
  decoder: bool

  @nn.compact
  def __call__(self, x, mask, q_pos, kv_pos, encoded=None, cross_mask=None, cache=None, cache_index=None, *,
               deterministic: bool = True):
    cfg = self.cfg
    drop = lambda y: nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(y)
    bias = RelativeBias(cfg, bidirectional=not self.decoder, name="relative_bias")(q_pos, kv_pos)
    n = num_decoder_layers(cfg) if self.decoder else cfg.num_layers
    run = layers.stack(Block, n, scan=cfg.scan_layers, remat=cfg.remat_policy, cfg=cfg, decoder=self.decoder,
                       deterministic=deterministic)
    shared = (mask, bias) + ((encoded, cross_mask, cache_index) if self.decoder else ())
    x, cache = run(drop(x), cache, *shared)
    x = layers.LayerNorm(cfg.layer_norm_eps, use_bias=False, use_mean=False, dtype=layers.dtype(cfg.dtype),
                         param_dtype=layers.dtype(cfg.param_dtype), name="final_norm")(x)
    return layers.constrain(drop(x), ("batch", "length", "embed")), cache


class T5(nn.Module):
  """Params: shared (vocab, embed), encoder, decoder, and lm_head when the embeddings are untied."""
  cfg: ml_collections.FrozenConfigDict

  def setup(self):
    cfg = self.cfg
    kw = dict(dtype=layers.dtype(cfg.dtype), param_dtype=layers.dtype(cfg.param_dtype))
    self.shared = layers.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(1.0), **kw)
    if not cfg.tie_embeddings:
      self.lm_head = layers.Dense((cfg.vocab_size,), ("embed", "vocab"), use_bias=False,
                                  kernel_init=nn.initializers.normal(cfg.d_model ** -0.5), **kw)
    self.encoder = Stack(cfg, decoder=False)
    self.decoder = Stack(cfg, decoder=True)

  def encode(self, input_ids, attention_mask, train: bool = False):
    x = layers.constrain(self.shared(input_ids), ("batch", "length", "embed"))
    pos = jnp.arange(input_ids.shape[1])
    mask = layers.make_attention_mask(attention_mask)
    x, _ = self.encoder(x, mask, pos, pos, deterministic=not train)
    return x

  def decode(self, decoder_input_ids, decoder_attention_mask, encoded, attention_mask, *, cache=None,
             cache_index=None, train: bool = False):
    """Logits (float32) and last hidden; with a cache, keys are its slots and queries start at cache_index."""
    t = decoder_input_ids.shape[1]
    x = layers.constrain(self.shared(decoder_input_ids), ("batch", "length", "embed"))
    if cache is None:
      q_pos = kv_pos = jnp.arange(t)
      mask = layers.make_attention_mask(decoder_attention_mask, causal=True, q_len=t, kv_len=t)
    else:
      q_pos, kv_pos = cache_index + jnp.arange(t), jnp.arange(cache["k"].shape[2])
      mask = layers.make_attention_mask(decoder_attention_mask, causal=True, q_index=q_pos[None],
                                        kv_index=kv_pos[None])
    cross_mask = layers.make_attention_mask(attention_mask)
    hidden, cache = self.decoder(x, mask, q_pos, kv_pos, encoded, cross_mask, cache, cache_index,
                                 deterministic=not train)
    if self.cfg.tie_embeddings:
      logits = self.shared.attend(hidden * self.cfg.d_model ** -0.5)
    else:
      logits = self.lm_head(hidden)
    return layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32), hidden, cache

  def __call__(self, batch, train: bool = False):
    encoded = self.encode(batch["input_ids"], batch["attention_mask"], train)
    logits, hidden, _ = self.decode(batch["decoder_input_ids"], batch["decoder_attention_mask"], encoded,
                                    batch["attention_mask"], train=train)
    return {"logits": logits, "hidden": hidden, "encoder_hidden": encoded}


def model(cfg) -> T5:
  check_config(cfg)
  return T5(layers.frozen(cfg))


def _dummy_batch():
  ones = jnp.ones((1, 1), jnp.int32)
  return {"input_ids": ones, "attention_mask": ones, "decoder_input_ids": ones, "decoder_attention_mask": ones}


def init_boxed(cfg, rng):
  """Params with their nn.LogicallyPartitioned boxes (for abstract_params / logical_axes)."""
  return model(cfg).init({"params": rng}, _dummy_batch())["params"]


def init(cfg, rng):
  return nn.meta.unbox(jax.jit(lambda r: init_boxed(cfg, r))(rng))


def abstract_params(cfg):
  return nn.meta.unbox(jax.eval_shape(lambda r: init_boxed(cfg, r), jax.random.key(0)))


def logical_axes(cfg):
  return nn.get_partition_spec(jax.eval_shape(lambda r: init_boxed(cfg, r), jax.random.key(0)))


def apply(cfg, params, batch, *, rng=None, train=False):
  """Batch: input_ids, attention_mask (B,L); decoder_input_ids, decoder_attention_mask (B,T).

  Returns logits (B,T,V) float32, hidden (B,T,D) (decoder, after its final norm), encoder_hidden (B,L,D).
  """
  rngs = {"dropout": rng} if train else {}
  if train and rng is None:
    raise ValueError("t5 apply(train=True) needs rng for dropout")
  return model(cfg).apply({"params": params}, batch, train=train, rngs=rngs)


def init_cache(cfg, params, batch, max_len: int):
  """Encodes batch['input_ids'/'attention_mask'] once and allocates an empty decoder cache of max_len slots.

  The cache: encoder_hidden (B,L,D), attention_mask (B,L), decoder_mask (B,max_len) (1 = slot holds a real
  token), index () next slot, layers {'k','v'} (decoder_layers, B, max_len, heads, head_dim).
  """
  encoded = model(cfg).apply({"params": params}, batch["input_ids"], batch["attention_mask"], method=T5.encode)
  b = encoded.shape[0]
  shape = (num_decoder_layers(cfg), b, max_len, cfg.num_heads, layers.head_dim(cfg))
  kv = jnp.zeros(shape, layers.dtype(cfg.dtype))
  return {"encoder_hidden": encoded, "attention_mask": jnp.asarray(batch["attention_mask"]),
          "decoder_mask": jnp.zeros((b, max_len), jnp.int32), "index": jnp.zeros((), jnp.int32),
          "layers": {"k": kv, "v": kv}}


def decode_step(cfg, params, decoder_input_ids, cache, decoder_attention_mask=None):
  """Feeds decoder_input_ids (B,T) at cache['index']; returns (logits (B,T,V) float32, updated cache).

  decoder_attention_mask (B,T) marks padding among the new tokens (default: all real).
  """
  b, t = decoder_input_ids.shape
  new_mask = jnp.ones((b, t), jnp.int32) if decoder_attention_mask is None else decoder_attention_mask
  index = cache["index"]
  dec_mask = jax.lax.dynamic_update_slice(cache["decoder_mask"], new_mask.astype(jnp.int32), (0, index))
  logits, _, kv = model(cfg).apply({"params": params}, decoder_input_ids, dec_mask, cache["encoder_hidden"],
                                   cache["attention_mask"], cache=cache["layers"], cache_index=index,
                                   method=T5.decode)
  return logits, dict(cache, decoder_mask=dec_mask, index=index + t, layers=kv)


# ----------------------------------------------------------------------------------------- Hugging Face layout


def hf_config(cfg) -> dict:
  """T5Config fields for config.json (transformers T5ForConditionalGeneration)."""
  act = _ACTS_TO_HF[cfg.activation]
  if cfg.gated_ffn:
    if cfg.activation == "gelu":
      raise ValueError("model.activation 'gelu' (exact) with gated_ffn has no HF T5 equivalent; use 'gelu_tanh'")
    proj = "gated-gelu" if cfg.activation == "gelu_tanh" else f"gated-{act}"
  else:
    proj = act
  return {
      "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True,
      "vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "d_kv": layers.head_dim(cfg), "d_ff": cfg.d_ff,
      "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "num_decoder_layers": num_decoder_layers(cfg),
      "feed_forward_proj": proj, "tie_word_embeddings": bool(cfg.tie_embeddings),
      "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
      "relative_attention_max_distance": cfg.relative_attention_max_distance,
      "dropout_rate": cfg.dropout_rate, "layer_norm_epsilon": cfg.layer_norm_eps, "initializer_factor": 1.0,
      "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id,
      "decoder_start_token_id": cfg.decoder_start_token_id, "use_cache": True,
  }


def config_from_hf(hf: dict) -> ml_collections.ConfigDict:
  """Model config from a T5Config dict (v1.0, v1.1 and the transformers>=5 `scale_decoder_outputs` form)."""
  m = defaults.model_defaults("t5")
  proj = hf.get("feed_forward_proj", "relu")
  parts = proj.split("-")
  act = "gelu_new" if proj == "gated-gelu" else parts[-1]
  if act not in _ACTS_FROM_HF or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
    raise ValueError(f"config.json: unsupported T5 feed_forward_proj {proj!r}")
  m.activation, m.gated_ffn = _ACTS_FROM_HF[act], parts[0] == "gated"
  m.vocab_size, m.d_model, m.d_ff = hf["vocab_size"], hf["d_model"], hf["d_ff"]
  m.num_heads, m.head_dim, m.num_layers = hf["num_heads"], hf["d_kv"], hf["num_layers"]
  m.num_decoder_layers = hf.get("num_decoder_layers") or hf["num_layers"]
  m.relative_attention_num_buckets = hf.get("relative_attention_num_buckets", 32)
  m.relative_attention_max_distance = hf.get("relative_attention_max_distance", 128)
  m.dropout_rate = m.attention_dropout_rate = hf.get("dropout_rate", 0.1)
  m.layer_norm_eps = hf.get("layer_norm_epsilon", 1e-6)
  # transformers>=5 always writes tie_word_embeddings=True and keeps the output scaling in scale_decoder_outputs.
  m.tie_embeddings = bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)))
  m.pad_token_id = hf.get("pad_token_id", 0)
  m.eos_token_id = hf.get("eos_token_id", 1)
  m.decoder_start_token_id = hf.get("decoder_start_token_id", 0)
  return m


def _hf_layer_map(cfg, decoder: bool) -> dict:
  """Our per-layer param path -> (HF suffix, to_hf, from_hf) with torch Linear weights (out, in)."""
  d, h, dh = cfg.d_model, cfg.num_heads, layers.head_dim(cfg)
  qkv = (lambda w: w.reshape(d, h * dh).T, lambda w: w.T.reshape(d, h, dh))
  out = (lambda w: w.reshape(h * dh, d).T, lambda w: w.T.reshape(h, dh, d))
  mat = (lambda w: w.T, lambda w: w.T)
  vec = (lambda w: w, lambda w: w)
  attn = [("self_attention", "layer.0.SelfAttention", "layer.0.layer_norm")]
  if decoder:
    attn.append(("cross_attention", "layer.1.EncDecAttention", "layer.1.layer_norm"))
  ff = f"layer.{len(attn)}"
  table = {}
  for ours, theirs, norm in attn:
    for a, b, fn in (("query", "q", qkv), ("key", "k", qkv), ("value", "v", qkv), ("out", "o", out)):
      table[(ours, a, "kernel")] = (f"{theirs}.{b}.weight",) + fn
    table[(f"{ours}_norm", "scale")] = (f"{norm}.weight",) + vec
  for wi in ("wi_0", "wi_1") if cfg.gated_ffn else ("wi",):
    table[("mlp", wi, "kernel")] = (f"{ff}.DenseReluDense.{wi}.weight",) + mat
  table[("mlp", "wo", "kernel")] = (f"{ff}.DenseReluDense.wo.weight",) + mat
  table[("mlp_norm", "scale")] = (f"{ff}.layer_norm.weight",) + vec
  return table


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _put(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def to_hf(cfg, params) -> dict:
  """Our params -> {HF T5ForConditionalGeneration key: numpy array}; scanned layers are unstacked."""
  params = jax.tree.map(np.asarray, params)
  out = {"shared.weight": params["shared"]["embedding"]}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = params["lm_head"]["kernel"].T
  for stack, n, decoder in (("encoder", cfg.num_layers, False), ("decoder", num_decoder_layers(cfg), True)):
    p = params[stack]
    out[f"{stack}.final_layer_norm.weight"] = p["final_norm"]["scale"]
    out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = p["relative_bias"]["table"][
        "embedding"]
    table = _hf_layer_map(cfg, decoder)
    for i, layer in enumerate(layers.get_layers(p, n)):
      for path, (key, fwd, _) in table.items():
        out[f"{stack}.block.{i}.{key}"] = fwd(_get(layer, path))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_hf(cfg, tensors: dict) -> dict:
  """{HF key: array} -> our params (float `param_dtype`, scanned if cfg.scan_layers); checks every shape."""
  tensors = {k: np.asarray(v) for k, v in tensors.items()}
  used = set()

  def take(key):
    if key not in tensors:
      raise ValueError(f"T5 checkpoint is missing {key!r}")
    used.add(key)
    return tensors[key]

  shared = tensors.get("shared.weight", tensors.get("encoder.embed_tokens.weight"))
  if shared is None:
    raise ValueError("T5 checkpoint is missing 'shared.weight'")
  params = {"shared": {"embedding": shared}}
  used.update(("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
               "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"))
  head = tensors.get("lm_head.weight")
  if cfg.tie_embeddings:
    if head is not None and not np.array_equal(head, shared):
      raise ValueError("T5 checkpoint has an lm_head.weight different from shared.weight, but the config ties "
                       "them (tie_word_embeddings / scale_decoder_outputs)")
    used.add("lm_head.weight")
  else:  # transformers>=5 saves v1.1 with a tied head and no lm_head.weight
    params["lm_head"] = {"kernel": (shared if head is None else take("lm_head.weight")).T}
  for stack, n, decoder in (("encoder", cfg.num_layers, False), ("decoder", num_decoder_layers(cfg), True)):
    table = _hf_layer_map(cfg, decoder)
    per_layer = []
    for i in range(n):
      layer = {}
      for path, (key, _, back) in table.items():
        _put(layer, path, back(take(f"{stack}.block.{i}.{key}")))
      per_layer.append(layer)
    params[stack] = {
        "final_norm": {"scale": take(f"{stack}.final_layer_norm.weight")},
        "relative_bias": {"table": {"embedding": take(
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")}},
        **layers.put_layers(per_layer, cfg.scan_layers),
    }
  unused = sorted(set(tensors) - used)
  if unused:
    raise ValueError(f"T5 checkpoint has tensors this config does not use: {', '.join(unused[:5])}")
  expected = abstract_params(cfg)
  if jax.tree.structure(expected) != jax.tree.structure(params):
    raise ValueError("T5 checkpoint does not match the config's parameter tree")
  dtype = layers.dtype(cfg.param_dtype)

  def convert(path, want, got):
    if want.shape != got.shape:
      raise ValueError(f"T5 checkpoint: {jax.tree_util.keystr(path)} has shape {got.shape}, config needs "
                       f"{want.shape}")
    return jnp.asarray(got, dtype)
  return jax.tree_util.tree_map_with_path(convert, expected, params)

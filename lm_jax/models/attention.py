"""One attention function for every family: padding, causal, segment and sliding-window masks, T5's
relative-position bias, the kernel chosen by config.model.attention (XLA, cuDNN, Pallas splash) for the platform
being compiled for, and the KV cache. Keys and values may have fewer heads than the queries (num_kv_heads:
grouped-query attention, Ainslie et al. 2023, or multi-query with one): query head h reads kv head h // (H / K),
as transformers' repeat_kv does, without repeating the keys and values in memory.

KV cache: an explicit pytree, no flax 'cache' collection. `Attention` takes one layer's {'k', 'v'} (B, K, S_max, Dh), K
the kv heads, and a write index, writes the new keys/values there and attends over the whole buffer (the caller's mask
hides unwritten slots); blocks.stack gives each layer its own cache (a tuple, looped layers), so a decoding loop updates
every buffer in place.
"""
import contextvars
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from lm_jax.models import layers, rope


def make_attention_mask(key_mask: jax.Array | None = None, *, causal: bool = False,
                        q_index: jax.Array | None = None, kv_index: jax.Array | None = None,
                        q_segments: jax.Array | None = None, kv_segments: jax.Array | None = None,
                        q_len: int | None = None, kv_len: int | None = None,
                        window: int | None = None) -> jax.Array | None:
  """Boolean (B|1, 1, T, S) mask, True = may attend, or None when nothing is masked.

  key_mask (B, S): padding, keys with 0 are hidden (queries at padding still see the real keys, as
  in HF). causal: kv_index <= q_index; indices (B|1, T) / (B|1, S) default to arange (give
  q_index = cache_index + arange(T) when decoding). Segment ids (B, T) / (B, S): attend only
  within equal ids, so packed documents never see each other (padding, id 0, sees only padding). window W: keys
  with |q_index - kv_index| > W are hidden too (sliding-window attention; None = off).
  """
  masks = []
  if key_mask is not None:
    masks.append(key_mask.astype(bool)[:, None, None, :])
  if causal or window is not None:
    if q_index is None:
      q_index = jnp.arange(q_len)[None]
    if kv_index is None:
      kv_index = jnp.arange(kv_len)[None]
    distance = q_index[:, None, :, None] - kv_index[:, None, None, :]
    if causal:
      masks.append(distance >= 0)
    if window is not None:
      masks.append(jnp.abs(distance) <= window)
  if q_segments is not None:
    kv_segments = q_segments if kv_segments is None else kv_segments
    masks.append(q_segments[:, None, :, None] == kv_segments[:, None, None, :])
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


@jax.custom_vjp
def add_batch_shared(x: jax.Array, bias: jax.Array) -> jax.Array:
  """x (B, ...) + bias (1, ...). Autodiff would sum the bias gradient over the batch with a reduction that
  XLA:CPU runs far below memory bandwidth; a ones-vector matmul sums it many times faster
  (bench/README.md#measurements-behind-design-choices)."""
  return x + bias


def _add_batch_shared_fwd(x, bias):
  return x + bias, None


def _add_batch_shared_bwd(_, g):
  return g, jnp.tensordot(jnp.ones(g.shape[:1], g.dtype), g, axes=1)[None]


add_batch_shared.defvjp(_add_batch_shared_fwd, _add_batch_shared_bwd)


ATTENTION_KERNELS = ("xla", "cudnn", "splash")
_KERNEL = contextvars.ContextVar("attention_kernel", default=("xla", False))




def attention_kernel(name: str, causal: bool):
  """Inside, dot_product_attention uses kernel `name` (ATTENTION_KERNELS; config.model.attention) for a model whose
  self-attention is `causal`; models.apply sets it from the config."""
  return layers.setting(_KERNEL, (name, causal))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
                          bias: jax.Array | None = None, scale: float | None = None,
                          dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                          window: int | None = None) -> jax.Array:
  """softmax(scale q k^T + bias, masked) v for q (B,T,H,Dh), k/v (B,S,K,Dh) with K dividing H; mask/bias
  (B|1,H|1,T,S). window: the sliding window `mask` already applies (make_attention_mask), which splash's static
  mask needs to know.

  The kernel is the model's (attention_kernel): 'xla' the explicit form below, which materialises the float32
  (B, H, T, S) probabilities (on a CPU, long causal self-attention in blocks of queries: _causal_rows); 'cudnn'
  jax.nn.dot_product_attention, cuDNN's fused flash attention on GPU (XLA's form elsewhere); 'splash' Pallas splash
  attention on TPU (interpreted elsewhere), which never materialises the probabilities. Dropout on the probabilities
  (models.validate refuses it with the fused kernels) and decoding with a cache (T != S) take the explicit form. Logits
  and softmax are float32; a fully masked row gives a uniform average, never NaN (explicit form). With K < H the
  explicit form groups the query heads (B,T,K,H/K,Dh) against the kv heads, cuDNN takes the K heads as they are, and
  splash (whose kernel wants one kv head per query head) reads them repeated.
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  use_dropout = dropout_rng is not None and dropout_rate > 0.0
  kernel, causal = _KERNEL.get()
  platform = layers.platform()
  if kernel == "cudnn" and not use_dropout:
    bias = None if bias is None else bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                        implementation="cudnn" if platform in ("gpu", "cuda") else None)
  if kernel == "splash" and not use_dropout and q.shape[1] == k.shape[1]:
    if bias is not None:
      raise ValueError("model.attention='splash' takes no attention bias (T5's relative positions): use xla or "
                       "cudnn")
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, groups, axis=2) if groups > 1 else t for t in (k, v))
    return _splash(q, k, v, mask, scale, causal, window, interpret=platform != "tpu")
  if causal and platform == "cpu" and not use_dropout and (rows := _causal_rows(q, k, mask, bias)):
    return _causal_blocks(q, k, v, mask, bias, scale, rows)
  return _explicit(q, k, v, mask=mask, bias=bias, scale=scale, dropout_rate=dropout_rate if use_dropout else 0.0,
                   dropout_rng=dropout_rng)


def _causal_rows(q, k, mask, bias) -> int:
  """Query rows per block of causal self-attention on a CPU (0: unblocked). Block i of the queries sees only the
  keys up to its own last row, so computing it against those alone skips the masked upper triangle: at T=256 the
  forward and backward of one layer take 13.5 ms, not 23 (bench/README.md, nanoGPT). At T=64 that pays only for
  logits of 2^20 elements or more (batch 64: 14.4 -> 9.9 ms; batch 12 gains nothing), and below it never; above
  T=512 the blocks grow so that the program stays 16 of them. The mask (causal: the model's) and bias are sliced, so
  they must be whole (T, T) in their last two axes."""
  B, T, H, _ = q.shape
  rows = max(32, T // 16)
  long_enough = T >= 128 or (T >= 64 and B * H * T * T >= 2 ** 20)
  whole = all(x is None or x.shape[-2:] == (T, T) for x in (mask, bias))
  return rows if mask is not None and whole and T == k.shape[1] and long_enough and T % rows == 0 else 0


def _causal_blocks(q, k, v, mask, bias, scale, rows: int):
  """The explicit form over blocks of `rows` queries, each against the keys up to its last row: the same numbers (its
  softmax sums skip only masked terms, exact zeros), with the caller's mask and bias sliced, not rebuilt."""
  out = []
  for end in range(rows, q.shape[1] + 1, rows):
    part = lambda x: None if x is None else x[..., end - rows:end, :end]
    out.append(_explicit(q[:, end - rows:end], k[:, :end], v[:, :end], mask=part(mask), bias=part(bias),
                         scale=scale))
  return jnp.concatenate(out, axis=1)


def _explicit(q, k, v, *, mask, bias, scale, dropout_rate: float = 0.0, dropout_rng=None):
  """softmax(scale q k^T + bias, masked) v with the float32 probabilities materialised."""
  if k.shape[2] != q.shape[2]:
    return _grouped_attention(q, k, v, mask=mask, bias=bias, scale=scale, kv_axis=1, dropout_rate=dropout_rate,
                              dropout_rng=dropout_rng)
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    bias = bias.astype(jnp.float32)
    shared = bias.shape[0] == 1 and logits.shape[0] > 1 and bias.shape[1:] == logits.shape[1:]
    logits = add_batch_shared(logits, bias) if shared else logits + bias
  if mask is not None:
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  probs = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0:
    probs = layers.dropout(probs, dropout_rate, dropout_rng)
  return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)


def _grouped_attention(q, k, v, *, mask, bias, scale, kv_axis: int, dropout_rate: float = 0.0, dropout_rng=None):
  """The explicit form for q (B,T,H,Dh) and k/v with K < H heads, laid out (B,S,K,Dh) (kv_axis 1) or as the cache
  (B,K,S,Dh) (kv_axis 2): q is split into (B,T,K,G,Dh), G = H / K, so each kv head meets its G query heads in one
  dot and is never repeated; the (B,K,G,T,S) logits are viewed as (B,H,T,S) for the mask, bias and softmax."""
  B, T, H, Dh = q.shape
  K = k.shape[2 if kv_axis == 1 else 1]
  kv = "bskd" if kv_axis == 1 else "bksd"
  q = q.reshape(B, T, K, H // K, Dh)
  logits = jnp.einsum(f"btkgd,{kv}->bkgts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
  logits = logits.reshape(B, H, T, -1)
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  probs = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0:
    probs = layers.dropout(probs, dropout_rate, dropout_rng)
  probs = probs.reshape(B, K, H // K, T, -1).astype(v.dtype)
  return jnp.einsum(f"bkgts,{kv}->btkgd", probs, v).reshape(B, T, H, Dh).astype(q.dtype)


def _splash(q, k, v, mask, scale, causal: bool, window: int | None, interpret: bool):
  """Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) per example. Its mask is static (causal,
  full, or a sliding window) plus segment ids: `mask` must be that static mask and/or key padding, which is what
  the models build; a key is valid where any query sees it, a query where it sees any key (a padding query then
  attends padding keys: its output is never read)."""
  B, T = q.shape[:2]
  if T % 128:
    raise ValueError(f"model.attention='splash' needs a sequence length that is a multiple of 128, got {T}")
  block = next(b for b in (512, 256, 128) if T % b == 0)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  if window is not None:
    one = splash_mask.LocalMask((T, T), (window, 0 if causal else window), offset=0)
  else:
    one = splash_mask.CausalMask((T, T)) if causal else splash_mask.FullMask((T, T))
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)
  q, k, v = heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v)
  if mask is None:
    mask = jnp.ones((B, 1, T, T), bool)
  mask = jnp.broadcast_to(mask, (B, mask.shape[1], T, T))
  q_ids, kv_ids = (jnp.any(mask, axis=axes).astype(jnp.int32) for axes in ((1, 3), (1, 2)))

  def run(q, k, v, q_ids, kv_ids):   # q (examples, heads, T, D) of one device
    fn = splash.make_splash_mha(splash_mask.MultiHeadMask([one] * q.shape[1]), block_sizes=sizes, head_shards=1,
                                q_seq_shards=1, interpret=interpret)
    return jax.vmap(fn)(q, k, v, segment_ids=splash.SegmentIds(q=q_ids, kv=kv_ids))

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:   # a Pallas kernel is not partitioned by XLA: each device runs it on its own examples and heads
    spec = nn.logical_to_mesh_axes(("batch", "heads", "length", "kv"))
    ids = nn.logical_to_mesh_axes(("batch", "length"))
    run = jax.shard_map(run, mesh=mesh, in_specs=(spec, spec, spec, ids, ids), out_specs=spec, check_vma=False)
  out = run(q, k, v, q_ids, kv_ids)
  return heads_first(out)


class Attention(nn.Module):
  """Multi-head attention with separate query/key/value/out projections (names match HF's split).

  scale_logits=False leaves logits unscaled (T5 folds 1/sqrt(Dh) into its init). num_kv_heads (0 = num_heads)
  heads of keys and values, dividing num_heads: grouped-query or, with 1, multi-query attention. qk_norm: an
  RMSNorm over each query and key head ('query_norm', 'key_norm', eps qk_norm_eps) before the rotation (Qwen3).
  rope_theta > 0: rotary positions (rope.apply) on queries and keys, at the `positions` the call gives. window:
  the sliding window the caller's mask applies (only the splash kernel needs to know it).
  """
  num_heads: int
  head_dim: int
  num_kv_heads: int = 0
  qk_norm: bool = False
  qk_norm_eps: float = 1e-6
  rope_theta: float = 0.0
  window: int | None = None
  use_bias: bool = True
  scale_logits: bool = True
  logit_scale: float | None = None   # with scale_logits: None = 1/sqrt(head_dim); µP's (mup.attention_scale)
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: layers.Init = nn.initializers.normal(0.02)
  query_init: layers.Init | None = None    # default kernel_init
  out_init: layers.Init | None = None      # default kernel_init

  @nn.compact
  def __call__(self, x: jax.Array, context: jax.Array | None = None, *, mask: jax.Array | None = None,
               bias: jax.Array | None = None, cache: dict | None = None, cache_index: jax.Array | None = None,
               positions: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """x (B,T,D) queries; context (B,S,D) keys/values (None = self-attention); positions (B|1,T) of x's tokens,
    which rope_theta > 0 needs (self-attention: the keys are the same tokens).

    cache {'k','v'} (B,K,S_max,Dh) (decoding, see cached_attention): the new k/v are written at cache_index
    (None: the cache is read only, e.g. the encoder's keys/values for cross-attention, and context is unused)
    and the attention runs over all S_max slots, so mask/bias must be (.., T, S_max). Returns (y (B,T,D), the
    updated cache).
    """
    context = x if context is None else context
    kv_heads = self.num_kv_heads or self.num_heads
    dense = functools.partial(layers.Dense, axes=("embed", "heads", "kv"), use_bias=self.use_bias, dtype=self.dtype,
                              param_dtype=self.param_dtype)
    head_norm = functools.partial(layers.RMSNorm, self.qk_norm_eps, axis="kv", dtype=self.dtype,
                                  param_dtype=self.param_dtype)
    if self.rope_theta and positions is None:
      raise ValueError("rotary attention (rope_theta > 0) needs the tokens' positions")

    def project(inputs, name, heads, init, norm):
      y = dense((heads, self.head_dim), kernel_init=init, name=name)(inputs)
      if self.qk_norm and norm:
        y = head_norm(name=f"{name}_norm")(y)
      if self.rope_theta and norm:
        y = rope.apply(y, positions, self.rope_theta)
      return layers.constrain(y, ("batch", "length", "heads", "kv"))

    q = project(x, "query", self.num_heads, self.query_init or self.kernel_init, True)
    scale = self.logit_scale if self.scale_logits else 1.0
    if cache is not None:
      if cache_index is not None:
        new = {name: project(context, proj, kv_heads, self.kernel_init, name == "k")
               for name, proj in (("k", "key"), ("v", "value"))}
        cache = write_cache(cache, new, cache_index)
      y = cached_attention(q, cache["k"], cache["v"], mask=mask, bias=bias, scale=scale)
    else:
      k = project(context, "key", kv_heads, self.kernel_init, True)
      v = project(context, "value", kv_heads, self.kernel_init, False)
      dropout_rng = None
      if not self.deterministic and self.dropout_rate > 0.0:
        dropout_rng = self.make_rng("dropout")
      y = dot_product_attention(q, k, v, mask=mask, bias=bias, scale=scale, dropout_rate=self.dropout_rate,
                                dropout_rng=dropout_rng, window=self.window)
    y = layers.constrain(y, ("batch", "length", "heads", "kv"))
    out = layers.Dense((x.shape[-1],), ("heads", "kv", "embed"), use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=self.out_init or self.kernel_init, name="out")(y)
    return layers.constrain(out, ("batch", "length", "embed")), cache


def cache_layout(k: jax.Array) -> jax.Array:
  """Keys or values (B,S,K,Dh) -> the cache's layout (B,K,S,Dh): batch and head lead, so the decoding dots read
  the cache as it lies, with no transpose of the whole cache per step."""
  return layers.constrain(jnp.swapaxes(k, 1, 2), ("batch", "heads", "length", "kv"))


def write_cache(cache: dict, new: dict, index: jax.Array) -> dict:
  """cache {'k','v'} (B,K,S_max,Dh) with new {'k','v'} (B,T,K,Dh) written at slot `index`. The update is in
  place when the cache is a loop carry (or a donated argument)."""
  return {name: jax.lax.dynamic_update_slice(cache[name], cache_layout(new[name]).astype(cache[name].dtype),
                                             (0, 0, index, 0)) for name in ("k", "v")}


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
                     bias: jax.Array | None = None, scale: float | None = None) -> jax.Array:
  """softmax(scale q k^T + bias, masked) v for q (B,T,H,Dh) and a cache's k/v (B,K,S,Dh): the decoding form of
  dot_product_attention (same float32 logits and softmax, so the same numbers), whose dots contract the cache
  in its own layout (K < H: grouped, as there)."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  if k.shape[1] != q.shape[2]:
    return _grouped_attention(q, k, v, mask=mask, bias=bias, scale=scale, kv_axis=2)
  logits = jnp.einsum("bthd,bhsd->bhts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhts,bhsd->bthd", probs.astype(v.dtype), v).astype(q.dtype)

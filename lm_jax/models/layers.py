"""Building blocks shared by the model families (BERT, GPT-1, GPT-2, T5).

Every parameter carries logical axis names (nn.with_logical_partitioning) and the main activations a
logical sharding constraint, so lm_jax.sharding maps both onto a mesh by rules. Multi-dimensional
kernels are made with self.param + dot_general rather than nn.DenseGeneral, whose multi-dim kernels
fail under jax.set_mesh (docs/toolchain.md#multi-dimensional-kernels).

Layer stacks (`stack`) are scanned or looped. Scanned params live under `<name>` with a leading
'layers' axis, looped ones under `<name>_0`, `<name>_1`, ...; `get_layers` / `put_layers` convert
between either layout and a list of per-layer trees, `relayout` every stack of a params-shaped tree.

KV cache: an explicit pytree, no flax 'cache' collection. `Attention` takes one layer's
{'k', 'v'} (B, H, S_max, Dh) and a write index, writes the new keys/values there and attends over
the whole buffer (the caller's mask hides unwritten slots); `stack` gives each layer its own cache
(a tuple, looped layers), so a decoding loop updates every buffer in place. Decoding on a CPU reads
the Dense kernels' output-major copies (`output_major`).
"""
import contextlib
import contextvars
import functools
import math
import re
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from lm_jax.models import nf4

Init = Callable[..., jax.Array]
LOOPED = re.compile(r"layers_(\d+)")   # a looped layer's key; scanned layers are all under "layers"

# Variable collections beside 'params' that lm_jax.models.apply fills from the run's params, at the same module
# paths and scanned with their layers: LoRA adapters (lm_jax.peft.lora) and NF4 kernels (QLoRA, Dense reads them).
ADAPTERS, QUANTISED = "lora", "nf4"

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),   # exact erf (HF "gelu")
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # original BERT/GPT TF code
    "relu": jax.nn.relu,
}
REMAT_POLICIES = {
    "none": None,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,  # keep weight matmuls
    "full": jax.checkpoint_policies.nothing_saveable,                      # recompute everything
}


def _fmix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: a bijection in which every input bit flips each output bit with
  probability ~1/2."""
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def dropout(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
  """Inverted dropout: zero each element with probability `rate` (exact to 2^-16), scale the rest.

  jax.random.bernoulli spends a 20-round threefry call per element, a large share of a CPU train step
  (bench/train_step.py runs BERT-base and GPT-1 with and without dropout). Here threefry draws only a 64-bit key; the keep decisions are 16-bit halves of
  a keyed hash of each element's index (two murmur3 finalisers, key-mixed between them), which XLA
  fuses into the consumer. The index is over the global shape, so the mask is the same under any
  sharding, and the same rng gives the same mask.
  """
  *lead, last = x.shape
  words_shape = (*lead, -(-last // 2))
  if math.prod(words_shape) >= 2**32:
    raise ValueError(f"dropout: {x.shape} has too many elements for 32-bit element indices")
  k = jax.random.bits(rng, (2,), jnp.uint32)
  index = jax.lax.iota(jnp.uint32, math.prod(words_shape)).reshape(words_shape)
  bits = jax.lax.bitcast_convert_type(_fmix32(_fmix32(index ^ k[0]) + k[1]), jnp.uint16)
  bits = bits.reshape(*lead, -1)[..., :last]
  threshold = round(rate * 2**16)
  keep = bits >= jnp.uint16(threshold)
  return jnp.where(keep, x / (1 - threshold / 2**16), jnp.zeros((), x.dtype)).astype(x.dtype)


class Dropout(nn.Module):
  """nn.Dropout's interface with `dropout`'s mask; rng stream 'dropout'."""
  rate: float
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    if self.deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng("dropout"))


def dtype(name: str):
  if name not in DTYPES:
    raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
  return DTYPES[name]


def dtypes(cfg) -> dict:
  """The dtype / param_dtype keywords every layer of a model takes, from its config."""
  return dict(dtype=dtype(cfg.dtype), param_dtype=dtype(cfg.param_dtype))


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  if name not in ACTIVATIONS:
    raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")
  return ACTIVATIONS[name]


def head_dim(cfg) -> int:
  """model.head_dim, or d_model // num_heads when it is 0."""
  return cfg.head_dim or cfg.d_model // cfg.num_heads


def frozen(cfg) -> ml_collections.FrozenConfigDict:
  """Modules keep the model config as a hashable FrozenConfigDict."""
  return cfg if isinstance(cfg, ml_collections.FrozenConfigDict) else ml_collections.FrozenConfigDict(cfg)


def replace(cfg, **fields) -> ml_collections.ConfigDict:
  """An unlocked copy of a model config with some fields changed."""
  new = ml_collections.ConfigDict(cfg.to_dict())
  new.update(fields)
  return new


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Logical sharding constraint; a no-op outside a mesh + axis-rules context."""
  return nn.with_logical_constraint(x, tuple(axes))


def _one_cpu() -> bool:
  """True when compiling for one CPU device. There, Dense multiplies 2-D matrices: given x (B, T, D), XLA:CPU
  computes the kernel gradient's contraction over (B, T) by first copying the output gradient transposed, and
  where that gradient is an elementwise fusion (GELU's backward) it recomputes the fusion in the transposed layout,
  the largest cost of a small model's step (bench/README.md, nanoGPT). With (B*T, D) rows it contracts in place."""
  if (_PLATFORM.get() or jax.default_backend()) != "cpu":
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


class Dense(nn.Module):
  """x @ kernel (+ bias) contracting x's trailing dims with the kernel's leading ones.

  `axes` names every kernel dim (inputs then outputs); the number of input dims is
  len(axes) - len(features), so (D,) -> (H, Dh) is features=(H, Dh), axes=('embed','heads','kv').
  A frozen kernel stored as NF4 (QLoRA) comes in the QUANTISED collection and is dequantised inside the matmul.
  """
  features: Sequence[int]
  axes: Sequence[str | None]
  use_bias: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Init = nn.initializers.normal(0.02)
  bias_init: Init = nn.initializers.zeros

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = tuple(self.features)
    n_in = len(self.axes) - len(features)
    shape = x.shape[x.ndim - n_in:] + features
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    if self.has_variable(QUANTISED, "kernel"):
      y = nf4.matmul(x, self.get_variable(QUANTISED, "kernel"), contract, self.dtype)
    elif self.has_variable("params", "kernel_t"):   # decoding's output-major copy (output_major): axes reversed
      # as one (outputs, inputs) matrix contracted on its last axis: XLA would copy a kernel of more axes into the
      # input-major form each step; only x and y (a few rows) are transposed
      lead, n_out = x.ndim - n_in, len(features)
      x = jnp.transpose(x, tuple(range(lead)) + tuple(range(x.ndim - 1, lead - 1, -1)))
      x = x.reshape(x.shape[:lead] + (-1,)).astype(self.dtype)
      kernel = self.get_variable("params", "kernel_t")
      kernel = kernel.reshape(math.prod(features), -1).astype(self.dtype)
      y = jax.lax.dot_general(x, kernel, (((lead,), (1,)), ((), ())))
      y = y.reshape(y.shape[:lead] + features[::-1])
      y = jnp.transpose(y, tuple(range(lead)) + tuple(range(lead + n_out - 1, lead - 1, -1)))
    else:
      kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, tuple(self.axes)),
                          shape, self.param_dtype)
      if _one_cpu():   # one (rows, inputs) x (inputs, outputs) product, see _one_cpu
        lead = x.shape[:x.ndim - n_in]
        y = jnp.dot(x.reshape(-1, math.prod(shape[:n_in])).astype(self.dtype),
                    kernel.reshape(math.prod(shape[:n_in]), -1).astype(self.dtype)).reshape(lead + features)
      else:
        y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), (contract, ((), ())))
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, tuple(self.axes[n_in:])),
                        features, self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y


class Embed(nn.Module):
  """Lookup table; `attend` is the tied output projection x @ table.T."""
  num_embeddings: int
  features: int
  axes: Sequence[str | None] = ("vocab", "embed")
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  embedding_init: Init = nn.initializers.normal(0.02)

  def setup(self):
    self.embedding = self.param("embedding", nn.with_logical_partitioning(self.embedding_init, tuple(self.axes)),
                                (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.embedding.astype(self.dtype))


class LayerNorm(nn.Module):
  """LayerNorm in float32; use_mean=False, use_bias=False is T5's RMS norm."""
  eps: float = 1e-12
  use_bias: bool = True
  use_mean: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    y = x.astype(jnp.float32)
    if self.use_mean:
      y = y - jnp.mean(y, axis=-1, keepdims=True)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (d,), self.param_dtype)
    y = y * scale.astype(jnp.float32)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), (d,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.dtype)


def make_attention_mask(key_mask: jax.Array | None = None, *, causal: bool = False,
                        q_index: jax.Array | None = None, kv_index: jax.Array | None = None,
                        q_segments: jax.Array | None = None, kv_segments: jax.Array | None = None,
                        q_len: int | None = None, kv_len: int | None = None) -> jax.Array | None:
  """Boolean (B|1, 1, T, S) mask, True = may attend, or None when nothing is masked.

  key_mask (B, S): padding, keys with 0 are hidden (queries at padding still see the real keys, as
  in HF). causal: kv_index <= q_index; indices (B|1, T) / (B|1, S) default to arange (give
  q_index = cache_index + arange(T) when decoding). Segment ids (B, T) / (B, S): attend only
  within equal ids, so packed documents never see each other (padding, id 0, sees only padding).
  """
  masks = []
  if key_mask is not None:
    masks.append(key_mask.astype(bool)[:, None, None, :])
  if causal:
    if q_index is None:
      q_index = jnp.arange(q_len)[None]
    if kv_index is None:
      kv_index = jnp.arange(kv_len)[None]
    masks.append(kv_index[:, None, None, :] <= q_index[:, None, :, None])
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
_PLATFORM = contextvars.ContextVar("attention_platform", default=None)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def attention_kernel(name: str, causal: bool):
  """Inside, dot_product_attention uses kernel `name` (ATTENTION_KERNELS; config.model.attention) for a model whose
  self-attention is `causal`; models.apply sets it from the config."""
  return _setting(_KERNEL, (name, causal))


def compiling_for(platform: str):
  """Inside, the kernels are chosen for `platform` ('tpu', 'gpu') rather than the backend this process runs on:
  lm_jax.plan.aot compiles for a topology from a CPU host."""
  return _setting(_PLATFORM, platform)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
                          bias: jax.Array | None = None, scale: float | None = None,
                          dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None) -> jax.Array:
  """softmax(scale q k^T + bias, masked) v for q (B,T,H,Dh), k/v (B,S,H,Dh); mask/bias (B|1,H|1,T,S).

  The kernel is the model's (attention_kernel): 'xla' the explicit form below, which materialises the float32
  (B, H, T, S) probabilities; 'cudnn' jax.nn.dot_product_attention, cuDNN's fused flash attention on GPU (XLA's
  form elsewhere); 'splash' Pallas splash attention on TPU (interpreted elsewhere), which never materialises the
  probabilities. Dropout on the probabilities (models.validate refuses it with the fused kernels) and decoding with
  a cache (T != S) take the explicit form. Logits and softmax are float32; a fully masked row gives a uniform
  average, never NaN (explicit form).
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  use_dropout = dropout_rng is not None and dropout_rate > 0.0
  kernel, causal = _KERNEL.get()
  platform = _PLATFORM.get() or jax.default_backend()
  if kernel == "cudnn" and not use_dropout:
    bias = None if bias is None else bias.astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale,
                                        implementation="cudnn" if platform in ("gpu", "cuda") else None)
  if kernel == "splash" and not use_dropout and q.shape[1] == k.shape[1]:
    if bias is not None:
      raise ValueError("model.attention='splash' takes no attention bias (T5's relative positions): use xla or "
                       "cudnn")
    return _splash(q, k, v, mask, scale, causal, interpret=platform != "tpu")
  logits = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
  if bias is not None:
    bias = bias.astype(jnp.float32)
    shared = bias.shape[0] == 1 and logits.shape[0] > 1 and bias.shape[1:] == logits.shape[1:]
    logits = add_batch_shared(logits, bias) if shared else logits + bias
  if mask is not None:
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  probs = jax.nn.softmax(logits, axis=-1)
  if use_dropout:
    probs = dropout(probs, dropout_rate, dropout_rng)
  return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v)


def _splash(q, k, v, mask, scale, causal: bool, interpret: bool):
  """Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) per example. Its mask is static (causal or
  full) plus segment ids: `mask` must be causal-and/or-key-padding, which is what the models build; a key is
  valid where any query sees it, a query where it sees any key (a padding query then attends padding keys: its
  output is never read)."""
  B, T = q.shape[:2]
  if T % 128:
    raise ValueError(f"model.attention='splash' needs a sequence length that is a multiple of 128, got {T}")
  block = next(b for b in (512, 256, 128) if T % b == 0)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
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

  scale_logits=False leaves logits unscaled (T5 folds 1/sqrt(Dh) into its init).
  """
  num_heads: int
  head_dim: int
  use_bias: bool = True
  scale_logits: bool = True
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Init = nn.initializers.normal(0.02)
  query_init: Init | None = None    # default kernel_init
  out_init: Init | None = None      # default kernel_init

  @nn.compact
  def __call__(self, x: jax.Array, context: jax.Array | None = None, *, mask: jax.Array | None = None,
               bias: jax.Array | None = None, cache: dict | None = None,
               cache_index: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
    """x (B,T,D) queries; context (B,S,D) keys/values (None = self-attention).

    cache {'k','v'} (B,H,S_max,Dh) (decoding, see cached_attention): the new k/v are written at cache_index
    (None: the cache is read only, e.g. the encoder's keys/values for cross-attention, and context is unused)
    and the attention runs over all S_max slots, so mask/bias must be (.., T, S_max). Returns (y (B,T,D), the
    updated cache).
    """
    context = x if context is None else context
    dense = functools.partial(Dense, (self.num_heads, self.head_dim), ("embed", "heads", "kv"),
                              use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
    q = constrain(dense(kernel_init=self.query_init or self.kernel_init, name="query")(x),
                  ("batch", "length", "heads", "kv"))
    scale = None if self.scale_logits else 1.0
    if cache is not None:
      if cache_index is not None:
        new = {name: dense(kernel_init=self.kernel_init, name=proj)(context) for name, proj in (("k", "key"),
                                                                                                 ("v", "value"))}
        cache = write_cache(cache, new, cache_index)
      y = cached_attention(q, cache["k"], cache["v"], mask=mask, bias=bias, scale=scale)
    else:
      k = dense(kernel_init=self.kernel_init, name="key")(context)
      v = dense(kernel_init=self.kernel_init, name="value")(context)
      k, v = (constrain(t, ("batch", "length", "heads", "kv")) for t in (k, v))
      dropout_rng = None
      if not self.deterministic and self.dropout_rate > 0.0:
        dropout_rng = self.make_rng("dropout")
      y = dot_product_attention(q, k, v, mask=mask, bias=bias, scale=scale, dropout_rate=self.dropout_rate,
                                dropout_rng=dropout_rng)
    y = constrain(y, ("batch", "length", "heads", "kv"))
    out = Dense((x.shape[-1],), ("heads", "kv", "embed"), use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=self.out_init or self.kernel_init, name="out")(y)
    return constrain(out, ("batch", "length", "embed")), cache


def cache_layout(k: jax.Array) -> jax.Array:
  """Keys or values (B,S,H,Dh) -> the cache's layout (B,H,S,Dh): batch and head lead, so the decoding dots read
  the cache as it lies, with no transpose of the whole cache per step."""
  return constrain(jnp.swapaxes(k, 1, 2), ("batch", "heads", "length", "kv"))


def write_cache(cache: dict, new: dict, index: jax.Array) -> dict:
  """cache {'k','v'} (B,H,S_max,Dh) with new {'k','v'} (B,T,H,Dh) written at slot `index`. The update is in
  place when the cache is a loop carry (or a donated argument)."""
  return {name: jax.lax.dynamic_update_slice(cache[name], cache_layout(new[name]).astype(cache[name].dtype),
                                             (0, 0, index, 0)) for name in ("k", "v")}


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None = None,
                     bias: jax.Array | None = None, scale: float | None = None) -> jax.Array:
  """softmax(scale q k^T + bias, masked) v for q (B,T,H,Dh) and a cache's k/v (B,H,S,Dh): the decoding form of
  dot_product_attention (same float32 logits and softmax, so the same numbers), whose dots contract the cache
  in its own layout."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  logits = jnp.einsum("bthd,bhsd->bhts", q, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhts,bhsd->bthd", probs.astype(v.dtype), v).astype(q.dtype)


class MLP(nn.Module):
  """wo(act(wi x)) or, gated (T5 v1.1), wo(act(wi_0 x) * wi_1 x); dropout after the activation."""
  d_ff: int
  activation: str = "gelu"
  gated: bool = False
  use_bias: bool = True
  dropout_rate: float = 0.0
  deterministic: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Init = nn.initializers.normal(0.02)
  out_init: Init | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    act = activation(self.activation)
    dense = functools.partial(Dense, (self.d_ff,), ("embed", "mlp"), use_bias=self.use_bias, dtype=self.dtype,
                              param_dtype=self.param_dtype, kernel_init=self.kernel_init)
    if self.gated:
      h = act(dense(name="wi_0")(x)) * dense(name="wi_1")(x)
    else:
      h = act(dense(name="wi")(x))
    h = constrain(h, ("batch", "length", "mlp"))
    h = Dropout(self.dropout_rate, deterministic=self.deterministic)(h)
    out = Dense((x.shape[-1],), ("mlp", "embed"), use_bias=self.use_bias, dtype=self.dtype,
                param_dtype=self.param_dtype, kernel_init=self.out_init or self.kernel_init, name="wo")(h)
    return constrain(out, ("batch", "length", "embed"))


class PostLNBlock(nn.Module):
  """BERT / GPT-1 layer: x = LN(x + Drop(Attn(x))); x = LN(x + Drop(MLP(x))). cfg: the model config."""
  cfg: Any
  deterministic: bool = True
  kernel_init: Init = nn.initializers.normal(0.02)

  @nn.compact
  def __call__(self, x, cache, mask, cache_index=None):
    cfg = self.cfg
    kw = dict(dtype=dtype(cfg.dtype), param_dtype=dtype(cfg.param_dtype))
    drop = Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    a, cache = Attention(cfg.num_heads, head_dim(cfg), dropout_rate=cfg.attention_dropout_rate,
                         deterministic=self.deterministic, kernel_init=self.kernel_init, name="attention",
                         **kw)(x, mask=mask, cache=cache, cache_index=cache_index)
    x = LayerNorm(cfg.layer_norm_eps, name="attention_ln", **kw)(x + drop(a))
    h = MLP(cfg.d_ff, cfg.activation, kernel_init=self.kernel_init, name="mlp", **kw)(x)
    x = LayerNorm(cfg.layer_norm_eps, name="mlp_ln", **kw)(x + drop(h))
    return constrain(x, ("batch", "length", "embed")), cache


class PreLNBlock(nn.Module):
  """GPT-2 layer: x = x + Drop(Attn(LN(x))); x = x + Drop(MLP(LN(x))). out_init: the residual projections' init
  (GPT-2 scales it by 1/sqrt(2 * layers)). cfg: the model config; cfg.use_bias=False drops every bias (nanoGPT)."""
  cfg: Any
  deterministic: bool = True
  kernel_init: Init = nn.initializers.normal(0.02)
  out_init: Init | None = None

  @nn.compact
  def __call__(self, x, cache, mask, cache_index=None):
    cfg = self.cfg
    kw = dict(dtype=dtype(cfg.dtype), param_dtype=dtype(cfg.param_dtype))
    bias = cfg.get("use_bias", True)
    drop = Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    h = LayerNorm(cfg.layer_norm_eps, use_bias=bias, name="attention_ln", **kw)(x)
    a, cache = Attention(cfg.num_heads, head_dim(cfg), use_bias=bias, dropout_rate=cfg.attention_dropout_rate,
                         deterministic=self.deterministic, kernel_init=self.kernel_init, out_init=self.out_init,
                         name="attention", **kw)(h, mask=mask, cache=cache, cache_index=cache_index)
    x = x + drop(a)
    h = LayerNorm(cfg.layer_norm_eps, use_bias=bias, name="mlp_ln", **kw)(x)
    x = x + drop(MLP(cfg.d_ff, cfg.activation, use_bias=bias, kernel_init=self.kernel_init, out_init=self.out_init,
                     name="mlp", **kw)(h))
    return constrain(x, ("batch", "length", "embed")), cache


def stack(block: type[nn.Module], num_layers: int, *, scan: bool, remat: str = "none", name: str = "layers",
          **block_attrs) -> Callable[..., tuple[jax.Array, Any]]:
  """`num_layers` copies of `block`, created in the calling module's compact method.

  The block is called as block(x, cache, *shared) -> (x, cache): `cache` is that layer's own cache (or None),
  `shared` (masks, biases, encoder output, cache index) is the same for every layer. Returns f(x, cache, *shared)
  -> (x, new cache), the cache a tuple with one entry per layer: each layer's buffers stay apart, so a decoding
  loop updates them in place and never slices or restacks a cache of all layers (looped layers only; decoding
  unstacks scanned params first, see unscanned).
  scan=True: nn.scan, params (and the ADAPTERS and QUANTISED collections) under `name` with a leading 'layers'
  axis (compile time independent of depth); False: a python loop over `name_0` ... Remat policy per REMAT_POLICIES.
  """
  if remat not in REMAT_POLICIES:
    raise ValueError(f"unknown remat_policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
  if remat != "none":
    block = nn.remat(block, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
  if scan:
    def scanned(x, cache, *shared):
      if cache is not None:
        raise ValueError("a KV cache needs looped layers: decode with layers.unscanned(cfg, params)")
      layer = nn.scan(block, variable_axes={"params": 0, ADAPTERS: 0, QUANTISED: 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=(0,) + (nn.broadcast,) * len(shared),
                      length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      return layer(name=name, **block_attrs)(x, cache, *shared)
    return scanned

  def looped(x, cache, *shared):
    new = []
    for i in range(num_layers):
      x, layer_cache = block(name=f"{name}_{i}", **block_attrs)(x, None if cache is None else cache[i], *shared)
      new.append(layer_cache)
    return x, None if cache is None else tuple(new)
  return looped


def get_layers(tree: dict, num_layers: int, name: str = "layers") -> list[dict]:
  """Per-layer param trees from either layout: scanned `name` (leading layer axis) or `name_<i>`."""
  if name in tree:
    return [jax.tree.map(lambda a: a[i], tree[name]) for i in range(num_layers)]
  return [tree[f"{name}_{i}"] for i in range(num_layers)]


def put_layers(layers: Sequence[dict], scan: bool, name: str = "layers") -> dict:
  """Inverse of get_layers: {name: stacked} when scan else {name_0: ..., name_1: ...}."""
  if scan:
    return {name: jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *layers)}
  return {f"{name}_{i}": layer for i, layer in enumerate(layers)}


def unscanned(cfg, params: dict) -> tuple[ml_collections.FrozenConfigDict, dict]:
  """(cfg, params) with scanned layer stacks split into looped layers, traceable: what decoding runs, each
  layer's weights and cache its own buffers. Split once outside a decoding loop; a no-op for looped params."""
  cfg = frozen(cfg)
  if not cfg.scan_layers:
    return cfg, params

  def split(tree):
    if not isinstance(tree, dict):
      return tree
    rest = {k: split(v) for k, v in tree.items() if k != "layers"}
    if "layers" not in tree:
      return rest
    n = jax.tree.leaves(tree["layers"])[0].shape[0]
    return {**rest, **put_layers(get_layers(tree, n), scan=False)}
  return frozen(replace(cfg, scan_layers=False)), split(params)


def output_major(params: dict) -> dict:
  """params with each Dense kernel also stored with its axes reversed, outputs first ('kernel_t', which Dense then
  reads; a scanned stack keeps its leading layer axis): a decode step multiplies a few rows by every weight, and on
  a CPU XLA's products read an output-major weight faster than the input-major one it was trained in (GPT-1's
  token step 1.1x faster at 1 and 8 rows, 1.2x at 32: bench/README.md, decode.py). Call it (jitted) outside the
  decoding program: inside, XLA would lay the copy out as the original and copy it back every step."""
  def walk(tree, stacked):
    if not isinstance(tree, dict):
      return tree
    out = {k: walk(v, stacked or k == "layers") for k, v in tree.items()}
    kernel = tree.get("kernel")
    if isinstance(kernel, jax.Array | np.ndarray) and kernel.ndim - stacked >= 2:
      out["kernel_t"] = jnp.transpose(kernel, tuple(range(stacked)) + tuple(range(kernel.ndim - 1, stacked - 1, -1)))
    return out
  return walk(params, False)


def relayout(tree, scan: bool):
  """`tree` (params, or a nested dict shaped like them) on the host with every layer stack scanned (scan=True) or
  looped: what a checkpoint, an HF / PEFT directory or a run with the other scan_layers holds, in the run's layout."""
  if not isinstance(tree, dict):
    return tree
  stack = [k for k in tree if k == "layers" or LOOPED.fullmatch(k)]
  rest = {k: relayout(v, scan) for k, v in tree.items() if k not in stack}
  if not stack:
    return rest
  n = jax.tree.leaves(tree["layers"])[0].shape[0] if "layers" in tree else len(stack)
  return {**rest, **put_layers(get_layers(jax.device_get({k: tree[k] for k in stack}), n), scan)}

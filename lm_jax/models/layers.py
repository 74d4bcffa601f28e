"""Building blocks shared by the model families (BERT, GPT-1, GPT-2, T5).

Every parameter carries logical axis names (nn.with_logical_partitioning) and the main activations a
logical sharding constraint, so lm_jax.sharding maps both onto a mesh by rules. Multi-dimensional
kernels are made with self.param + dot_general rather than nn.DenseGeneral, whose multi-dim kernels
fail under jax.set_mesh (docs/toolchain.md#multi-dimensional-kernels).

The rest of a model lives beside this file by job: attention.py (the attention function, its kernels, the KV
cache), blocks.py (transformer blocks, the scanned or looped layer stack), relayout.py (param trees between
scanned and looped layouts, the output-major copy decoding reads on a CPU).
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

from lm_jax.models import nf4

Init = Callable[..., jax.Array]
LOOPED = re.compile(r"layers_(\d+)")   # a looped layer's key; scanned layers are all under "layers"

# Variable collections beside 'params' that lm_jax.models.apply fills from the run's params, at the same module
# paths and scanned with their layers: an adapter method's adapters (LoRA's matrices, IA³'s vectors: lm_jax.peft)
# and NF4 kernels (QLoRA, Dense reads them).
ADAPTERS, QUANTISED = "adapters", "nf4"


def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, x Phi(x), with Phi from erf as torch and HF compute it. jax.nn.gelu's exact form goes through erfc,
  which XLA:CPU evaluates at about a third of erf's speed (bench/README.md, the nanoGPT grid)."""
  return 0.5 * x * (1 + jax.lax.erf(x * (1 / math.sqrt(2))))


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ACTIVATIONS = {
    "gelu": gelu,   # exact (HF "gelu")
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # original BERT/GPT TF code
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,   # SwiGLU's (Llama, Qwen3: HF "silu") with gated_ffn
}
NORMS = ("layernorm", "rmsnorm")   # model.norm (layers.norm)
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


_PLATFORM = contextvars.ContextVar("compile_platform", default=None)


@contextlib.contextmanager
def setting(var: contextvars.ContextVar, value):
  """Inside, the context variable `var` holds `value` (the compile target here, the attention kernel there)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


def compiling_for(platform: str):
  """Inside, layers and kernels are chosen for `platform` ('tpu', 'gpu') rather than the backend this process runs
  on: lm_jax.plan.aot compiles for a topology from a CPU host."""
  return setting(_PLATFORM, platform)


def platform() -> str:
  """The platform being compiled for: compiling_for's, else this process's backend."""
  return _PLATFORM.get() or jax.default_backend()


def _one_cpu() -> bool:
  """True when compiling for one CPU device. There, Dense multiplies 2-D matrices: given x (B, T, D), XLA:CPU
  computes the kernel gradient's contraction over (B, T) by first copying the output gradient transposed, and
  where that gradient is an elementwise fusion (GELU's backward) it recomputes the fusion in the transposed layout,
  the largest cost of a small model's step (bench/README.md, nanoGPT). With (B*T, D) rows it contracts in place."""
  if platform() != "cpu":
    return False
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


@jax.custom_vjp
def _rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x (rows, inputs) @ w (inputs, outputs) whose kernel gradient x^T g is a plain (inputs, rows) x (rows, outputs)
  product: autodiff's contraction over dimension 0 of both operands runs in XLA:CPU's Eigen dot, below the YNNPACK
  dot that a materialised x^T reaches (up to 6% of a small model's step, bench/README.md, the nanoGPT grid)."""
  return jnp.dot(x, w)


def _rows_matmul_fwd(x, w):
  return jnp.dot(x, w), (x, w)


def _rows_matmul_bwd(residuals, g):
  x, w = residuals
  x_t = jax.lax.optimization_barrier(x.T)   # else XLA folds the transpose back into the dot's dimensions
  return jnp.dot(g, w.T), jnp.dot(x_t, g)


_rows_matmul.defvjp(_rows_matmul_fwd, _rows_matmul_bwd)


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
        y = _rows_matmul(x.reshape(-1, math.prod(shape[:n_in])).astype(self.dtype),
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
  """LayerNorm in float32 over the last axis, whose logical name is `axis` ('kv' for a norm per head); use_mean=False,
  use_bias=False is T5's RMS norm (RMSNorm)."""
  eps: float = 1e-12
  use_bias: bool = True
  use_mean: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  axis: str = "embed"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    y = x.astype(jnp.float32)
    if self.use_mean:
      y = y - jnp.mean(y, axis=-1, keepdims=True)
    y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)), (d,),
                       self.param_dtype)
    y = y * scale.astype(jnp.float32)
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axis,)), (d,),
                        self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.dtype)


class RMSNorm(LayerNorm):
  """x / rms(x) * scale (Zhang & Sennrich 2019; T5's, Llama's, Qwen3's), no mean, no bias."""
  eps: float = 1e-6
  use_bias: bool = False
  use_mean: bool = False


def norm(cfg, **kw) -> LayerNorm:
  """The norm a model config names: model.norm 'layernorm' (default; with model.use_bias) or 'rmsnorm', eps
  model.layer_norm_eps."""
  kind = cfg.get("norm", "layernorm")
  if kind not in NORMS:
    raise ValueError(f"unknown model.norm {kind!r}; known: {', '.join(NORMS)}")
  if kind == "rmsnorm":
    return RMSNorm(cfg.layer_norm_eps, **kw)
  return LayerNorm(cfg.layer_norm_eps, use_bias=cfg.get("use_bias", True), **kw)


class MLP(nn.Module):
  """wo(act(wi x)) or, gated, wo(act(wi_0 x) * wi_1 x) (T5 v1.1's GeGLU with gelu, Llama's SwiGLU with silu: HF's
  gate_proj = wi_0, up_proj = wi_1, down_proj = wo); dropout after the activation."""
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

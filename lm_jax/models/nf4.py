"""NF4 weights with double quantisation (QLoRA, Dettmers et al. 2023), laid out as bitsandbytes' quantize_4bit
(quant_type "nf4", compress_statistics=True) stores them, in pure JAX.

The weight is flattened (row-major) and cut into blocks of `blocksize` (64) values; each block keeps its absmax
and each value the index of the nearest of the 16 NF4 values (NF4_VALUES) to value / absmax, two indices per
byte, the first in the high nibble (the last byte of an odd count is padded with index 7, NF4's 0). Double
quantisation stores the float32 absmax values minus their mean as 8 bits in blocks of 256: the index into
bitsandbytes' signed dynamic 8-bit code (DYNAMIC_VALUES, Dettmers 2016) nearest to value / (the block's absmax),
plus that float32 absmax per 256-block and the float32 mean. Storage per weight: 4 + 8/64 + 32/(64*256) bits
(~4.127) plus 32 bits per tensor.

The rounding follows bitsandbytes 0.50's CPU kernels value for value: 4-bit: value * (1/absmax) (value / absmax
in the trailing partial block), clipped to [-1, 1], then the first index whose midpoint to the next NF4 value
is >= it; 8-bit: value * (1/absmax) mapped to one of 65536 bins over [-1, 1] by ((v + 1) / 2) * 65535 + 0.5
truncated, each bin holding the code nearest its left edge. Only the mean can differ from bitsandbytes' (in its
last bit: float32 sums depend on the summation order); dequantisation uses whatever mean is stored.

`quantize` returns an NF4, a frozen dataclass registered as a pytree: its arrays are the leaves (what orbax
checkpoints and what jit traces), the original shape and dtype and the block sizes are static metadata in the
treedef, so a checkpoint restores onto the abstract tree jax.eval_shape of quantize_tree builds, and dequantize
is jittable. quantize is traceable too (jax.eval_shape, jit). A scanned stack of layers is quantised layer by
layer, as bitsandbytes quantises each Linear (`stacked` of quantize_tree): its NF4's arrays get a leading layer
axis that nn.scan slices, and shape stays one layer's. `matmul` dequantises inside the matmul and recomputes that
in the backward pass, so a train step never holds more than one float copy of a kernel at a time.
"""
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# bitsandbytes' get_4bit_type("nf4"): quantiles of N(0, 1) normalised to [-1, 1], with an exact 0 (QLoRA §3).
NF4_VALUES = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)


def _linspace(steps: int) -> np.ndarray:
  """torch.linspace(0.1, 1, steps) in float32, value for value: float32 step, each value rounded once."""
  start, end = np.float32(0.1), np.float32(1.0)
  step = np.float64((end - start) / np.float32(steps - 1))
  i = np.arange(steps, dtype=np.float64)
  return np.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i)).astype(np.float32)


def _dynamic_values() -> np.ndarray:
  """bitsandbytes' create_dynamic_map(signed=True): 7 decades of linearly spaced fractions, both signs, 0 and 1."""
  values = [np.array([0.0, 1.0], np.float32)]
  for i in range(7):
    edges = _linspace(2**i + 1)
    means = (edges[:-1] + edges[1:]) / np.float32(2)
    scale = np.float32(10.0 ** (i - 6))
    values += [scale * means, -scale * means]
  return np.sort(np.concatenate(values))


DYNAMIC_VALUES = _dynamic_values()
_NF4_MIDPOINTS = (NF4_VALUES[:-1] + NF4_VALUES[1:]) / np.float32(2)
_BINS = 65536


def _dynamic_lut() -> np.ndarray:
  """Code index of each of the 65536 bins: the first code whose midpoint to the next is >= the bin's left edge."""
  midpoints = np.float32(0.5) * (DYNAMIC_VALUES[:-1] + DYNAMIC_VALUES[1:])
  edges = np.float32(-1) + np.float32(2) * np.arange(_BINS, dtype=np.float32) / np.float32(_BINS - 1)
  return np.searchsorted(midpoints, edges, side="left").astype(np.uint8)


_DYNAMIC_LUT = _dynamic_lut()


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "absmax", "absmax_scale", "absmax_mean"],
                   meta_fields=["shape", "dtype", "blocksize", "double_blocksize"])
@dataclasses.dataclass(frozen=True)
class NF4:
  """A quantised weight. codes: uint8 (ceil(n/2),), two NF4 indices per byte. absmax: float32 (blocks,), or with
  double quantisation uint8 (blocks,) indices into DYNAMIC_VALUES, absmax_scale float32 (ceil(blocks/256),) and
  absmax_mean float32 () (None without). shape, dtype: the original weight's; static."""
  codes: jax.Array
  absmax: jax.Array
  absmax_scale: jax.Array | None
  absmax_mean: jax.Array | None
  shape: tuple[int, ...]
  dtype: str
  blocksize: int
  double_blocksize: int | None


def _blocks(x: jax.Array, blocksize: int) -> tuple[jax.Array, jax.Array, bool]:
  """(x padded with zeros to whole blocks, as (blocks, blocksize); each block's absmax; whether the last is partial)."""
  n = x.size
  blocks = x.reshape(-1)
  blocks = jnp.pad(blocks, (0, -n % blocksize)).reshape(-1, blocksize)
  return blocks, jnp.max(jnp.abs(blocks), axis=1), n % blocksize != 0


@functools.partial(jax.jit, static_argnames="blocksize")
def quantize_dynamic(x: jax.Array, blocksize: int = 256) -> tuple[jax.Array, jax.Array]:
  """bitsandbytes' quantize_blockwise (8 bits, dynamic code) of float32 x: (uint8 indices into DYNAMIC_VALUES,
  float32 absmax per block)."""
  blocks, absmax, _ = _blocks(x.astype(jnp.float32), blocksize)
  inv = jnp.where(absmax == 0, 0, 1 / jnp.where(absmax == 0, 1, absmax))
  v = jnp.clip(blocks * inv[:, None], -1, 1)
  bins = ((v + 1) * np.float32(0.5) * np.float32(_BINS - 1) + np.float32(0.5)).astype(jnp.int32)
  codes = jnp.where(absmax[:, None] == 0, 0, jnp.asarray(_DYNAMIC_LUT)[bins])
  return codes.reshape(-1)[:x.size], absmax


@functools.partial(jax.jit, static_argnames=("blocksize", "double_quant", "double_blocksize"))
def quantize(w: jax.Array, *, blocksize: int = 64, double_quant: bool = True, double_blocksize: int = 256) -> NF4:
  """NF4 codes of w (any float dtype, computed in float32) with per-block absmax, double-quantised by default."""
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"NF4 quantises floating-point weights, got {w.dtype} of shape {tuple(w.shape)}")
  if blocksize < 1 or double_blocksize < 1:
    raise ValueError(f"NF4 needs blocksize and double_blocksize >= 1, got {blocksize}, {double_blocksize}")
  n = math.prod(w.shape)
  blocks, absmax, partial = _blocks(w.astype(jnp.float32), blocksize)
  # bitsandbytes scales whole blocks by the reciprocal, the trailing partial block by division, and keeps an
  # all-zero trailing block's absmax at 1e-38, a float32 subnormal: XLA flushes those in arithmetic (so zero
  # blocks are handled apart) and, on CPU, even in a select when the weight is that one block (absmax 0 then;
  # both dequantise to zeros).
  zero = absmax == 0
  safe = jnp.where(zero, 1, absmax)
  scaled = blocks * (1 / safe)[:, None]
  if partial:
    absmax = absmax.at[-1].set(jnp.where(zero[-1], np.float32(1e-38), absmax[-1]))
    scaled = scaled.at[-1].set(blocks[-1] / safe[-1])
  scaled = jnp.clip(jnp.where(zero[:, None], 0, scaled), -1, 1).reshape(-1)[:n]
  idx = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), scaled, side="left", method="compare_all").astype(jnp.uint8)
  idx = jnp.pad(idx, (0, n % 2), constant_values=7)
  codes = (idx[0::2] << 4) | idx[1::2]
  dtype = jnp.dtype(w.dtype).name
  if not double_quant:
    return NF4(codes, absmax, None, None, tuple(w.shape), dtype, blocksize, None)
  mean = jnp.mean(absmax)
  qabsmax, scale = quantize_dynamic(absmax - mean, double_blocksize)
  return NF4(codes, qabsmax, scale, mean, tuple(w.shape), dtype, blocksize, double_blocksize)


def absmax_values(q: NF4) -> jax.Array:
  """The float32 per-block absmax of q (dequantising the double-quantised statistics)."""
  if q.absmax_scale is None:
    return q.absmax
  blocks = -(-q.absmax.size // q.double_blocksize) * q.double_blocksize
  codes = jnp.pad(q.absmax, (0, blocks - q.absmax.size)).reshape(-1, q.double_blocksize)
  values = jnp.asarray(DYNAMIC_VALUES)[codes] * q.absmax_scale[:, None]
  return values.reshape(-1)[:q.absmax.size] + q.absmax_mean


def layers(q: NF4) -> tuple[int, ...]:
  """The leading (layer) axes of a stacked NF4, () for one weight."""
  return q.codes.shape[:-1]


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(q: NF4, dtype=jnp.float32) -> jax.Array:
  """The weight of q in its original shape (with its leading layer axes), computed in float32 and cast to `dtype`.
  Jittable."""
  if layers(q):
    return jax.vmap(functools.partial(dequantize, dtype=dtype))(q)
  n = math.prod(q.shape)
  idx = jnp.stack([q.codes >> 4, q.codes & 15], axis=1).reshape(-1)
  values = jnp.asarray(NF4_VALUES)[idx[:n]]
  values = jnp.pad(values, (0, q.absmax.size * q.blocksize - n)).reshape(-1, q.blocksize)
  w = (values * absmax_values(q)[:, None]).reshape(-1)[:n]
  return w.reshape(q.shape).astype(dtype)


def _path(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def quantize_tree(params, patterns, stacked=(), **kw):
  """params with every leaf whose '/'-joined path matches (re.search) one of the regexes `patterns` replaced by
  quantize(leaf, **kw); a leaf matching one of `stacked` too holds a layer per index of its first axis, each
  quantised apart."""
  compiled, layered = [re.compile(p) for p in patterns], [re.compile(p) for p in stacked]

  def leaf(path, x):
    name = _path(path)
    if not any(p.search(name) for p in compiled):
      return x
    one = functools.partial(quantize, **kw)
    return jax.vmap(one)(x) if any(p.search(name) for p in layered) else one(x)
  return jax.tree_util.tree_map_with_path(leaf, params)


def matmul(x: jax.Array, q: NF4, contract, dtype) -> jax.Array:
  """dot_general(x, dequantize(q)) over `contract` in `dtype`, rematerialised: the backward pass keeps x and the
  NF4 parts and dequantises again, instead of keeping the float kernel."""
  @jax.checkpoint
  def f(x, q):
    return jax.lax.dot_general(x.astype(dtype), dequantize(q, dtype), (contract, ((), ())))
  return f(x, q)


def is_nf4(x) -> bool:
  return isinstance(x, NF4)


def logical_axes(q: NF4, spec):
  """Logical specs (PartitionSpecs) of q's parts, given `spec`, the float kernel's: the 4-bit codes and 8-bit
  absmax, flat in row-major order, split as the kernel's first input axis is (whole rows per shard, as the float
  kernel's would be); the few statistics left replicated. A scanned stack's leading layer axis stays one."""
  lead = tuple(spec[:len(layers(q))])
  first = spec[len(lead)]
  return dataclasses.replace(q, codes=P(*lead, first), absmax=P(*lead, first),
                             absmax_scale=None if q.absmax_scale is None else P(*lead, None),
                             absmax_mean=None if q.absmax_mean is None else P(*lead))


def dequantize_tree(tree, dtype=None):
  """tree with every NF4 dequantised to `dtype` (None: each weight's original dtype); other leaves as they are."""
  return jax.tree.map(lambda x: dequantize(x, dtype or x.dtype) if is_nf4(x) else x, tree, is_leaf=is_nf4)


def _bytes(x) -> int:
  return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def storage(tree) -> tuple[int, int]:
  """(bytes stored, parameters represented) of a tree of arrays, ShapeDtypeStructs and NF4s. A double-quantised
  NF4 weight of a size a multiple of 64 * 256 stores 4 + 8/64 + 32/(64*256) bits per parameter, plus 32 / size."""
  nbytes = params = 0
  for x in jax.tree.leaves(tree, is_leaf=is_nf4):
    nbytes += sum(_bytes(a) for a in jax.tree.leaves(x))
    params += math.prod(x.shape) * (math.prod(layers(x)) if is_nf4(x) else 1)
  return nbytes, params

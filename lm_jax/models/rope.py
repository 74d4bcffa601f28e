"""Rotary position embeddings (Su et al. 2021, RoFormer), in Hugging Face's rotate-half layout: the pair rotated by
position * theta^(-2i/Dh) is (x[i], x[i + Dh/2]), the first and second halves of the head (transformers'
modeling_llama.rotate_half), not the interleaved pairs of the paper. Checkpoints converted from HF need no
permutation of their query / key weights.
"""
import jax
import jax.numpy as jnp


def frequencies(head_dim: int, theta: float) -> jax.Array:
  """theta^(-2i/head_dim) for i < head_dim / 2, float32."""
  return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """x (B, T, H, Dh) rotated by positions (B|1, T): x cos + rotate_half(x) sin, float32 inside, x's dtype out."""
  angles = positions.astype(jnp.float32)[..., None] * frequencies(x.shape[-1], theta)   # (B|1, T, Dh/2)
  cos, sin = (jnp.concatenate([f, f], axis=-1)[:, :, None, :] for f in (jnp.cos(angles), jnp.sin(angles)))
  y = x.astype(jnp.float32)
  first, second = jnp.split(y, 2, axis=-1)
  return (y * cos + jnp.concatenate([-second, first], axis=-1) * sin).astype(x.dtype)

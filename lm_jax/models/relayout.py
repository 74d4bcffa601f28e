"""Param trees between layouts: scanned stacks (`<name>` with a leading 'layers' axis) and looped ones (`<name>_0`,
`<name>_1`, ...), and the output-major copy of the Dense kernels that decoding on a CPU reads.
"""
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from lm_jax.models import layers


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
  cfg = layers.frozen(cfg)
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
  return layers.frozen(layers.replace(cfg, scan_layers=False)), split(params)


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
  stack = [k for k in tree if k == "layers" or layers.LOOPED.fullmatch(k)]
  rest = {k: relayout(v, scan) for k, v in tree.items() if k not in stack}
  if not stack:
    return rest
  n = jax.tree.leaves(tree["layers"])[0].shape[0] if "layers" in tree else len(stack)
  return {**rest, **put_layers(get_layers(jax.device_get({k: tree[k] for k in stack}), n), scan)}

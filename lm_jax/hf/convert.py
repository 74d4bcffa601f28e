"""Table-driven mapping between our param trees and Hugging Face tensors, shared by the families.

A table row (hf_name, path, kind) ties one HF tensor to the param at `path` (a tuple of keys). kind: 'same'
(as is), 'flat' (HF keeps it 1-D, e.g. a (H, Dh) bias), 'T<n>' a torch Linear weight (out, in) for a kernel
with n input dims, 'C<n>' the same stored (in, out) (GPT's Conv1D). Every tensor read is checked against the
shape the config implies, so a checkpoint that does not fit fails with a TensorError naming the tensor.
"""
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.models import layers, relayout


class TensorError(ValueError):
  """A checkpoint tensor that is missing or does not fit the config; `tensor` is its HF name."""

  def __init__(self, tensor: str, problem: str):
    super().__init__(f"tensor {tensor!r} {problem}")
    self.tensor = tensor


def get_path(tree, path: Sequence):
  for k in path:
    tree = tree[k]
  return tree


def set_path(tree: dict, path: Sequence, value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def hf_shape(shape: Sequence[int], kind: str) -> tuple[int, ...]:
  """The shape HF stores a param of `shape` in."""
  if kind == "same":
    return tuple(shape)
  if kind == "flat":
    return (math.prod(shape),)
  n_in = int(kind[1:])
  rows, cols = math.prod(shape[:n_in]), math.prod(shape[n_in:])
  return (cols, rows) if kind[0] == "T" else (rows, cols)


def to_hf_array(a, kind: str) -> np.ndarray:
  a = np.asarray(a, np.float32)
  if kind in ("same", "flat"):
    return a.reshape(hf_shape(a.shape, kind))
  w = a.reshape(math.prod(a.shape[:int(kind[1:])]), -1)
  return np.ascontiguousarray(w.T if kind[0] == "T" else w)


def checked_tensor(tensors: dict, name: str, shape: Sequence[int]) -> np.ndarray:
  """tensors[name] as float32, or a TensorError when it is missing or not of `shape`."""
  if name not in tensors:
    raise TensorError(name, "is missing")
  if tuple(tensors[name].shape) != tuple(shape):
    raise TensorError(name, f"has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
  return np.asarray(tensors[name], np.float32)


def param_from_hf(tensors: dict, name: str, kind: str, shape: Sequence[int]) -> np.ndarray:
  """The param of `shape` stored as HF tensor `name` of `kind`."""
  t = checked_tensor(tensors, name, hf_shape(shape, kind))
  return (t.T if kind[0] == "T" else t).reshape(shape)


def tree_to_hf(tree: dict, table, prefix: str = "") -> dict[str, np.ndarray]:
  return {prefix + hf: to_hf_array(get_path(tree, path), kind) for hf, path, kind in table}


def tree_from_hf(tensors: dict, table, shapes: dict, prefix: str = "") -> dict:
  """Nested param tree for `table` from HF tensors; `shapes` is a tree of (Abstract) arrays."""
  out = {}
  for hf, path, kind in table:
    set_path(out, path, param_from_hf(tensors, prefix + hf, kind, get_path(shapes, path).shape))
  return out


def stack_to_hf(params: dict, num_layers: int, table, prefix: str) -> dict[str, np.ndarray]:
  """HF tensors of a layer stack in either layout; `prefix` formats the layer index i, e.g. 'h.{i}.'."""
  out = {}
  for i, layer in enumerate(relayout.get_layers(params, num_layers)):
    out |= tree_to_hf(layer, table, prefix.format(i=i))
  return out


def stack_from_hf(tensors: dict, table, shapes: dict, num_layers: int, prefix: str, scan: bool) -> dict:
  """Inverse of stack_to_hf; `shapes` in the looped layout (looped_shapes), the result in the scan layout."""
  per_layer = [tree_from_hf(tensors, table, shapes[f"layers_{i}"], prefix.format(i=i)) for i in range(num_layers)]
  return relayout.put_layers(per_layer, scan)


def looped_shapes(cfg) -> dict:
  """Abstract params of `cfg` with its layers looped (`layers_<i>`), whatever cfg.scan_layers says."""
  return models.abstract_params(layers.replace(cfg, scan_layers=False))


def as_params(cfg, tree: dict) -> dict:
  """A converted tree as device arrays in model.param_dtype."""
  pdt = layers.dtype(cfg.param_dtype)
  return jax.tree.map(lambda a: jnp.asarray(a, pdt), tree)

"""Device mesh (data, fsdp, tensor) and the logical-axis rules that place params and batches on it.

Models name their axes ('batch', 'embed', 'heads', ...); RULES maps those names to mesh axes, so a new
layout is a config change. Rules are applied in order and a mesh axis is used at most once per array:
activations ('batch', 'length', 'embed') put batch on data+fsdp and leave embed unsharded, while the
weights ('embed', 'mlp') are split over fsdp and tensor.
"""
import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
RULES = (
    ("batch", BATCH_AXES),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("relpos_buckets", None),
)


def rules(config):
  """config.logical_axis_rules, or RULES when empty."""
  return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in config.logical_axis_rules) or RULES


def mesh_shape(config, num_devices: int) -> tuple[int, int, int]:
  """config.mesh sizes with the (at most one) -1 filled in; one-line errors name the field."""
  sizes = [config.mesh[a] for a in AXES]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"config.mesh (data, fsdp, tensor) = {tuple(sizes)}: sizes must be >= 1, at most one -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"config.mesh {tuple(sizes)}: {num_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(f"config.mesh data*fsdp*tensor = {'*'.join(map(str, sizes))} = {int(np.prod(sizes))}, "
                     f"but there are {num_devices} devices")
  return tuple(sizes)


def make_mesh(config, devices=None) -> Mesh:
  """Mesh over all devices (or `devices`), Auto axis types so logical constraints work
  (docs/toolchain.md#mesh-axis-types). TPU devices are laid out along the physical torus
  (mesh_utils.create_device_mesh); several slices get a hybrid mesh whose `data` axis spans the slices, so only
  the data-parallel gradient reduction crosses the slower data-center network."""
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(config, len(devices))
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
  if devices[0].platform == "tpu" and slices > 1:
    if shape[0] % slices:
      raise ValueError(f"config.mesh.data={shape[0]} must be a multiple of the {slices} TPU slices")
    ici = (shape[0] // slices, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices, 1, 1), devices, allow_split_physical_axes=True)
  elif devices[0].platform == "tpu":
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
  elif len(devices) == jax.device_count():  # topology-aware device order on GPU
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)
  else:
    grid = np.array(devices).reshape(shape)
  return Mesh(grid, AXES)


def _is_spec(x):
  return isinstance(x, P)


def logical_to_sharding(logical, mesh: Mesh, rules_):
  """Tree of logical PartitionSpecs -> tree of NamedShardings."""
  return jax.tree.map(lambda s: NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(s), rules_)), logical,
                      is_leaf=_is_spec)


def check_divisible(abstract_params, logical, sizes: dict, rules_):
  """One-line error when a parameter dimension cannot be split evenly over its mesh axes
  (sizes: mesh axis name -> size)."""
  specs = jax.tree.leaves(logical, is_leaf=_is_spec)
  for (path, a), spec in zip(jax.tree_util.tree_leaves_with_path(abstract_params), specs):
    for dim, axes in zip(a.shape, nn.logical_to_mesh_axes(tuple(spec), rules_)):
      axes = (axes,) if isinstance(axes, str) else axes or ()
      n = int(np.prod([sizes[x] for x in axes]))
      if dim % n:
        raise ValueError(f"param {jax.tree_util.keystr(path)} {a.shape}: dim {dim} is not divisible by mesh "
                         f"axes {axes} of size {n}; change config.mesh or config.logical_axis_rules")


def opt_state_sharding(abstract_opt_state, abstract_params, param_sharding, mesh: Mesh):
  """Optimizer state leaves that mirror a param (same path suffix and shape) get its sharding; the rest
  (counts, Adafactor's factored row/column statistics) are replicated."""
  by_path = {}
  for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_sharding)):
    by_path[tuple(path)] = (a.shape, s)
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    for i in range(len(path)):
      shape_sharding = by_path.get(tuple(path[i:]))
      if shape_sharding and shape_sharding[0] == leaf.shape:
        return shape_sharding[1]
    return replicated
  return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (example) dimension over data x fsdp; features replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(local_batch: dict, sharding: NamedSharding) -> dict:
  """Process-local numpy rows -> one global jax.Array per feature (multi-host safe). With one process the rows are
  the global batch: one device_put of the dict costs a third of make_array_from_process_local_data's per-feature
  path, host time a small model's CPU step pays every step (bench/README.md, nanoGPT)."""
  if jax.process_count() == 1:
    return jax.device_put({k: np.asarray(v) for k, v in local_batch.items()}, sharding)
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}

"""A run's layout: what its config and mesh fix before any array exists, built by one function for every caller.

The trainer (lm_jax.setup), --mode=compile and --plan (plan/aot) and the memory estimate (plan/memory) all call
`build`, so what is planned is what trains: the optimizer, the abstract train state (params, optimizer state,
step) and where each of its arrays lives on the mesh. It reads no file and allocates nothing, so `mesh` may be an
AbstractMesh of a slice this host does not have.
"""
import dataclasses
from typing import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import objectives, optim, params as params_lib, sharding, step


@dataclasses.dataclass(frozen=True)
class Layout:
  """The run's params policy, optimizer and abstract train state on its mesh (built once per run by `build`)."""
  config: object
  policy: params_lib.Policy  # what the params are and what of them trains, resolved once
  objective: objectives.Objective
  mesh: object               # jax.sharding.Mesh, or an AbstractMesh to plan without the devices
  rules: tuple               # logical axis -> mesh axes
  tx: object                 # optax.GradientTransformation
  lr_schedule: Callable
  abstract_state: dict       # ShapeDtypeStructs of {params, opt_state, step}
  state_sharding: dict       # their NamedShardings on `mesh`


def build(config, mesh, rules=None) -> Layout:
  """The layout of `config` on `mesh` (rules: default config's own, sharding.rules)."""
  rules = sharding.rules(config) if rules is None else rules
  policy = params_lib.resolve(config)
  logical = params_lib.logical_axes(policy)   # the model's, plus the adapters of an adapter method
  tx, lr = optim.make(policy, logical)
  abstract_params = params_lib.abstract(policy)
  params_sh = sharding.logical_to_sharding(logical, mesh, rules)
  abstract = jax.eval_shape(lambda p: step.init_state(p, tx, policy.trainable), abstract_params)
  opt_sh = sharding.opt_state_sharding(abstract["opt_state"], abstract_params, params_sh, mesh)
  state_sh = {"params": params_sh, "opt_state": opt_sh, "step": NamedSharding(mesh, P())}
  return Layout(config, policy, objectives.get(config.objective), mesh, rules, tx, lr, abstract, state_sh)

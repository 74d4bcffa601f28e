"""The one train step and the eval step, for every objective.

Train state is a plain dict {params, opt_state, step}. Randomness is fold_in(seed, step), so a resumed
run replays the same dropout masks. Objectives return sums divided by denominators of the FULL batch,
so summing loss, metrics and gradients over microbatches gives exactly the full-batch values.
"""
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import params as params_lib, sharding


def init_state(params, tx, trainable=None) -> dict:
  """trainable: the params Policy's trainable mask (None = every param trains); frozen params get no optimizer
  state."""
  return {"params": params, "opt_state": tx.init(params_lib.split(params, trainable)[0]),
          "step": jnp.zeros((), jnp.int32)}


def fresh_state(policy, tx, state_sharding) -> dict:
  """Fresh train state, initialised directly into its shardings (policy: the run's params.Policy; a config is
  resolved)."""
  policy = params_lib.resolve(policy)
  key = jax.random.fold_in(jax.random.key(policy.config.seed), 0)
  init = lambda k: init_state(params_lib.init(policy, k), tx, policy.trainable)
  return jax.jit(init, out_shardings=state_sharding)(key)


def _split(batch, n, mesh):
  """(B, ...) -> (n, B/n, ...) with microbatch i = rows i, i+n, ...: every device keeps its own rows, so
  each microbatch stays spread over all data-parallel devices and no data moves."""
  def split(x):
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, sharding.BATCH_AXES)))
  return jax.tree.map(split, batch)


def make_train_step(policy, objective, tx, lr_schedule, state_sharding, mesh):
  """Jitted (state, batch) -> (state, metrics); state donated, metrics replicated float32 scalars. policy: the run's
  params.Policy (a config is resolved). Only the trainable params (policy.trainable) are differentiated and
  updated; frozen ones pass through as they are. Adapters run unmerged beside their frozen kernels
  (params.running), NF4 kernels dequantised inside their matmuls."""
  policy = params_lib.resolve(policy)
  config, trainable_mask = policy.config, policy.trainable
  n = config.microbatches
  seed_key = jax.random.key(config.seed)

  def loss_fn(params, frozen, batch, den, rng):
    full = params_lib.join(params, frozen)
    with params_lib.running(policy, train=True):
      return objective.loss(config, full, batch, den, rng=rng, train=True)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(state, batch):
    params, frozen = params_lib.split(state["params"], trainable_mask)
    den = objective.denominators(batch)
    rng = jax.random.fold_in(seed_key, state["step"])
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
    if n == 1:
      (_, metrics), grads = grad_fn(params, frozen, batch, den, rng)
      grads, metrics = f32(grads), f32(metrics)
    else:
      def body(acc, i_mb):
        i, mb = i_mb
        (_, m), g = grad_fn(params, frozen, mb, den, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, acc, (f32(g), f32(m))), None
      mbs = _split(batch, n, mesh)
      metrics_shape = jax.eval_shape(loss_fn, params, frozen, jax.tree.map(lambda x: x[0], mbs), den, rng)[1]
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, metrics_shape))
      (grads, metrics), _ = jax.lax.scan(body, zeros, (jnp.arange(n), mbs))
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = jnp.asarray(lr_schedule(state["step"]), jnp.float32)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = params_lib.join(optax.apply_updates(params, updates), frozen)
    new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
    return new_state, metrics

  replicated = NamedSharding(mesh, P())
  return jax.jit(step, in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
                 out_shardings=(state_sharding, replicated), donate_argnums=0)


def make_eval_step(policy, objective, params_sharding, mesh):
  """Jitted (params, batch) -> (metrics of that batch (loss, token_loss, accuracies), its denominators,
  per-example outputs of objective.predict ({} without)), no dropout; lm_jax.evals.evaluate turns them into
  corpus-level totals. policy: the run's params.Policy (a config is resolved). Over config.microbatches
  microbatches as the train step, one at a time: the metrics are their sums (each divided by the whole batch's
  denominators), the outputs back in the batch's row order, so only one microbatch's activations are live."""
  policy = params_lib.resolve(policy)
  config = policy.config
  n = config.microbatches

  def one(params, batch, den):
    with params_lib.running(policy, train=False):   # as in training: an adapter DPO run's reference is its base
      _, metrics = objective.loss(config, params, batch, den, rng=None, train=False)
      outputs = objective.predict(config, params, batch) if objective.predict else {}
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics), outputs

  def step(params, batch):
    den = objective.denominators(batch)
    if n == 1:
      metrics, outputs = one(params, batch, den)
    else:
      def body(acc, mb):
        metrics, outputs = one(params, mb, den)
        return jax.tree.map(jnp.add, acc, metrics), outputs
      mbs = _split(batch, n, mesh)
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                           jax.eval_shape(one, params, jax.tree.map(lambda x: x[0], mbs), den)[0])
      metrics, outputs = jax.lax.scan(body, zeros, mbs)
      outputs = jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), outputs)   # _split's inverse
    return metrics, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), den), outputs

  return jax.jit(step, in_shardings=(params_sharding, sharding.batch_sharding(mesh)),
                 out_shardings=NamedSharding(mesh, P()))

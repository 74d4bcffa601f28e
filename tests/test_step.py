"""Train step and optimizers: microbatch accumulation equals the full batch, dropout from fold_in(seed, step),
paper schedules, weight-decay masks, the written-out Adam against optax and BERT's update rule."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn

from lm_jax import defaults, layout, models, objectives, optim, sharding, step

FAMILY = {"clm": "gpt", "mlm": "bert", "span_corruption": "t5"}


def _config(objective, **overrides):
  c = defaults.base_config()
  c.objective = objective
  c.model = defaults.model_defaults(FAMILY[objective])
  c.model.update(vocab_size=256, d_model=32, num_layers=1, num_heads=2, d_ff=64, max_positions=32,
                 dropout_rate=0.0, attention_dropout_rate=0.0)
  c.data.update(seq_len=32, max_predictions_per_seq=5, nsp=objective == "mlm")
  c.optimizer.update(name="adamw", lr=1e-3, weight_decay=0.01, warmup_steps=0, schedule="constant")
  c.batch_size, c.total_steps = 8, 10
  c.update(overrides)
  return c


def _batch(config, seed=0):
  """A random batch with every feature the objective declares (weights / masks all ones)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (shape, dtype) in objectives.get(config.objective).features(config).items():
    shape = (config.batch_size, *shape)
    if dtype == np.float32 or "mask" in name or name == "segment_ids":
      out[name] = np.ones(shape, dtype)
    elif name == "positions":
      out[name] = np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
    elif name == "mlm_positions":
      out[name] = np.sort(rng.permutation(config.data.seq_len)[:shape[-1]]).astype(dtype)[None].repeat(shape[0], 0)
    else:
      out[name] = rng.integers(0, 2 if name in ("nsp_labels", "token_type_ids") else 150, shape).astype(dtype)
  return out


def _run(config, steps=3):
  """Metrics of `steps` train steps from the same init on the same batch sequence, and the final state."""
  objective = objectives.get(config.objective)
  mesh = sharding.make_mesh(config)
  lay = layout.build(config, mesh, sharding.RULES)
  tx, lr, state_sh = lay.tx, lay.lr_schedule, lay.state_sharding
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    state = jax.device_put(step.init_state(models.init(config.model, jax.random.key(0)), tx), state_sh)
    train_step = step.make_train_step(config, objective, tx, lr, state_sh, mesh)
    history = []
    for i in range(steps):
      state, metrics = train_step(state, _batch(config, seed=i))
      history.append(jax.device_get(metrics))
  return history, jax.device_get(state)


@pytest.mark.parametrize("objective", ["clm", "mlm", "span_corruption"])
def test_microbatches_give_the_full_batch_update(objective):
  # Adam with eps=1 updates by ~lr*g: param differences then measure gradient differences, not Adam's
  # sign-like normalisation of near-zero gradients (which amplifies float rounding of g ~ 1e-9).
  config = lambda n: _config(objective, microbatches=n, optimizer=dict(_config(objective).optimizer, eps=1.0, lr=0.1))
  one, state_one = _run(config(1))
  four, state_four = _run(config(4))
  for a, b in zip(one, four):
    assert a.keys() == b.keys() and np.isfinite(a["loss"])
    for k in a:
      np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
  leaves = zip(jax.tree.leaves(state_one["params"]), jax.tree.leaves(state_four["params"]))
  assert max(float(np.max(np.abs(a - b))) for a, b in leaves) < 1e-6
  assert int(state_four["step"]) == 3 and all(m["grad_norm"] > 0 for m in one)


@pytest.mark.parametrize("objective", ["clm", "mlm"])
def test_microbatched_eval_step_gives_the_full_batch_metrics(objective):
  """The eval step runs config.microbatches microbatches one at a time: the same metrics and denominators, and the
  per-example outputs in the batch's row order (a predict that returns each row's first token)."""
  predict = lambda config, params, batch: {"first": batch["input_ids"][:, 0]}
  obj = dataclasses.replace(objectives.get(objective), predict=predict)
  batch, out = _batch(_config(objective), seed=3), []
  rng = np.random.default_rng(0)   # drawn in numpy: no init to compile
  params = jax.tree.map(lambda a: 0.1 * rng.standard_normal(a.shape).astype(a.dtype),
                        models.abstract_params(_config(objective).model))
  for n in (1, 4):
    config = _config(objective, microbatches=n)
    mesh = sharding.make_mesh(config)
    params_sh = layout.build(config, mesh, sharding.RULES).state_sharding["params"]
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
      eval_step = step.make_eval_step(config, obj, params_sh, mesh)
      out.append(jax.device_get(eval_step(jax.device_put(params, params_sh), batch)))
  (m1, d1, o1), (m4, d4, o4) = out
  assert m1.keys() == m4.keys() and d1 == d4 and np.isfinite(m1["loss"])
  for k in m1:
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-6, atol=1e-7, err_msg=k)
  np.testing.assert_array_equal(o4["first"], batch["input_ids"][:, 0])
  np.testing.assert_array_equal(o1["first"], o4["first"])


def test_dropout_depends_on_step_not_on_host_state():
  config = _config("clm")
  config.model.dropout_rate = 0.5
  a, _ = _run(config, steps=2)
  b, _ = _run(config, steps=2)
  assert [m["loss"] for m in a] == [m["loss"] for m in b]  # replayable: same seed, same steps
  config.seed = 1
  c, _ = _run(config, steps=1)
  assert c[0]["loss"] != a[0]["loss"]


def _opt(**kw):
  c = defaults.base_config()
  c.optimizer.update(kw)
  return c.optimizer


def test_bert_linear_schedule():
  lr = optim.schedule(_opt(lr=1e-4, warmup_steps=10_000, schedule="linear"), 1_000_000)
  np.testing.assert_allclose([lr(0), lr(5_000), lr(10_000), lr(500_000), lr(1_000_000)],
                             [0.0, 5e-5, 1e-4 * 0.99, 5e-5, 0.0], rtol=1e-5, atol=1e-12)


def test_gpt1_cosine_schedule():
  lr = optim.schedule(_opt(lr=2.5e-4, warmup_steps=2000, schedule="cosine"), 102_000)
  np.testing.assert_allclose([lr(0), lr(1000), lr(2000), lr(52_000), lr(102_000)],
                             [0.0, 1.25e-4, 2.5e-4, 1.25e-4, 0.0], rtol=1e-5, atol=1e-12)


def test_t5_rsqrt_schedule():
  lr = optim.schedule(_opt(lr=0.01, warmup_steps=10_000, schedule="rsqrt"), 2**19)
  np.testing.assert_allclose([lr(0), lr(10_000), lr(40_000), lr(1_000_000)], [0.01, 0.01, 0.005, 0.001], rtol=1e-6)


@pytest.mark.parametrize("scan", [False, True])
def test_weight_decay_skips_layer_norm_and_biases(scan):
  config = _config("mlm")
  config.model.update(scan_layers=scan, num_layers=2)
  mask = optim.decay_mask(models.logical_axes(config.model))
  decayed = {jax.tree_util.keystr(p): on for p, on in jax.tree_util.tree_leaves_with_path(mask)}
  for path, on in decayed.items():
    assert on == (path.endswith("['kernel']") or path.endswith("['embedding']")), path
  # q k v out wi wo per layer (stacked once when scanned); mlm dense, nsp, pooler; 3 embeddings
  assert sum(decayed.values()) == (6 if scan else 12) + 3 + 3


@pytest.mark.parametrize("name", ["bert_adamw", "adam_l2", "adafactor", "adamw"])
def test_every_optimizer_steps(name):
  config = _config("clm")
  config.optimizer.name = name
  config.optimizer.schedule = "rsqrt" if name == "adafactor" else "linear"
  history, _ = _run(config, steps=2)
  assert np.isfinite(history[-1]["loss"]) and history[-1]["lr"] > 0


def test_unknown_optimizer_and_schedule():
  config = _config("clm")
  config.optimizer.name = "sgdx"
  with pytest.raises(ValueError, match="config.optimizer.name='sgdx'"):
    optim.make(config, models.logical_axes(config.model))
  config.optimizer.name, config.optimizer.schedule = "adamw", "step"
  with pytest.raises(ValueError, match="config.optimizer.schedule='step'"):
    optim.make(config, models.logical_axes(config.model))


def _adam_trajectory(tx, params, steps=4):
  state, out = tx.init(params), []
  for i in range(steps):
    grads = jax.tree.map(lambda p: np.random.default_rng(i).normal(size=p.shape).astype(np.float32) * 3, params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    out.append(params)
  return out


@pytest.mark.parametrize("clip_norm", [0.0, 1.0, 1e3])
def test_adam_equals_optax_chain(clip_norm):
  params = {"w": np.ones((4, 3), np.float32), "b": np.full((3,), 0.5, np.float32)}
  mask = {"w": True, "b": False}
  lr = optax.linear_schedule(1e-3, 1e-2, 4)
  ours = optim.adam(lr, 0.9, 0.98, 1e-6, 0.1, mask, clip_norm)
  ref = optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.1, mask=mask)
  if clip_norm:
    ref = optax.chain(optax.clip_by_global_norm(clip_norm), ref)
  for a, b in zip(_adam_trajectory(ours, params), _adam_trajectory(ref, params)):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def test_bert_adam_has_no_bias_correction():
  """google-research/bert AdamWeightDecayOptimizer, written out in numpy: m, v without bias correction,
  update m / (sqrt(v) + eps) + wd * p on decayed weights, times lr."""
  params = {"w": np.ones((4, 3), np.float32), "b": np.full((3,), 0.5, np.float32)}
  mask = {"w": True, "b": False}
  got = _adam_trajectory(optim.adam(1e-2, 0.9, 0.999, 1e-6, 0.01, mask, 0.0, bias_correction=False), params)
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: 0 * v for k, v in p.items()}
  v2 = {k: 0 * v for k, v in p.items()}
  for i in range(4):
    for k in p:
      g = np.random.default_rng(i).normal(size=p[k].shape).astype(np.float32) * 3
      m[k] = 0.9 * m[k] + 0.1 * g
      v2[k] = 0.999 * v2[k] + 0.001 * g * g
      p[k] = p[k] - 1e-2 * (m[k] / (np.sqrt(v2[k]) + 1e-6) + (0.01 * p[k] if mask[k] else 0))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5), got[i], p)

"""Muon, Lion, schedule-free AdamW and the WSD schedule (lm_jax/optim.py) against optax and hand computations:
WSD's rate at the warmup, stable, cooldown-start and end steps of each cooldown shape; a cooldown branched from a
stable-phase checkpoint continuing that run exactly; one Muon step on a scanned GPT-2 and on a BERT equal to
optax.contrib.muon on the same matrices unrolled to 2-D, the other leaves to optax.adamw; schedule-free evaluation
at the averaged params, not the iterate; each new optimizer on 8 simulated devices, after kill -9, with LoRA and
with microbatches."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from lm_jax import checks, config_lib, optim, params as params_lib, train
from conftest import load_config, records, run_tokenizer

NEW = ("muon", "lion", "schedule_free_adamw")


# ------------------------------------------------------------------------------------------------------------- WSD
@pytest.mark.parametrize("shape,half", [("linear", 0.5), ("1-sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)])
def test_wsd_equals_a_hand_computation(shape, half):
  """lr 1e-3 to 1e-4 (min_lr_ratio 0.1), warmup 10, 100 steps, 20% cooldown: it starts at step 80."""
  opt = config_lib.load("configs/gpt1.py:tiny", {
      "optimizer.lr": 1e-3, "optimizer.min_lr_ratio": 0.1, "optimizer.warmup_steps": 10, "optimizer.schedule": "wsd",
      "optimizer.cooldown_shape": shape}).optimizer
  lr = optim.schedule(opt, 100)
  hand = {0: 0.0, 4: 4e-4, 10: 1e-3, 50: 1e-3, 79: 1e-3, 80: 1e-3, 90: 1e-4 + 9e-4 * half, 100: 1e-4}
  assert {s: float(lr(s)) for s in hand} == pytest.approx(hand, rel=1e-6, abs=1e-12)
  assert float(lr(81)) < 1e-3
  branch = optim.schedule(config_lib.replaced(opt, {"cooldown_start": 30}), 50)   # 30 .. 50: the same shape
  assert [float(branch(s)) for s in (29, 30, 40, 50)] == pytest.approx([1e-3, 1e-3, 1e-4 + 9e-4 * half, 1e-4])


@pytest.mark.parametrize("field,value,choices", [
    ("optimizer.name", "sgd", "bert_adamw, adam_l2, adafactor, adamw, muon, lion, schedule_free_adamw"),
    ("optimizer.cooldown_shape", "exp", "linear, 1-sqrt, cosine")])
def test_unknown_choice_is_one_line_naming_the_choices(field, value, choices, shared_data):
  with pytest.raises(config_lib.ConfigError) as e:
    checks.validate(load_config("clm", shared_data, **{field: value}), 1)
  assert str(e.value) == f"config.{field}={value!r} unknown; use {choices}"


def test_cooldown_start_outside_the_run_is_one_line(shared_data):
  with pytest.raises(config_lib.ConfigError, match=r"cooldown_start=120 must be in \[warmup_steps=0, total_steps=8"):
    checks.validate(load_config("clm", shared_data, total_steps=8, **{
        "optimizer.schedule": "wsd", "optimizer.cooldown_start": 120, "optimizer.warmup_steps": 0}), 1)


def _run(data, workdir, **overrides):
  config = load_config("clm", data, log_every=1, checkpoint_every=100, eval_every=0, **{
      "optimizer.lr": 1e-2, "optimizer.schedule": "wsd", "optimizer.warmup_steps": 2, **overrides})
  return train.train(config, str(workdir))


def _same_params(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_branched_cooldown_continues_the_stable_run_exactly(shared_data, tmp_path):
  """A long WSD run stopped in its stable phase at step 6; a cooldown 6 -> 9 branched from it (init_from) equals a
  run that was 9 steps with its cooldown at 6 from the start: steps, rates, losses, params."""
  run_tokenizer(load_config("clm", shared_data), str(tmp_path / "tok"))   # one tokenizer: one data stream
  tok = {"data.tokenizer": str(next((tmp_path / "tok").glob("*.model")))}
  _run(shared_data, tmp_path / "stable", total_steps=40, phase_end_step=6, **tok)
  whole = _run(shared_data, tmp_path / "whole", total_steps=9, **{"optimizer.cooldown_start": 6, **tok})
  branch = _run(shared_data, tmp_path / "branch", total_steps=9, init_from=str(tmp_path / "stable"),
                **{"optimizer.cooldown_start": 6, **tok})
  drop = lambda recs: [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in recs]
  expected = drop(records(tmp_path / "whole"))
  assert [r["step"] for r in records(tmp_path / "branch")] == [7, 8, 9]
  assert drop(records(tmp_path / "branch")) == expected[6:]
  assert drop(records(tmp_path / "stable")) == expected[:6]
  assert expected[5]["lr"] == expected[6]["lr"] == pytest.approx(1e-2) and 1e-2 > expected[7]["lr"] > expected[8]["lr"]
  _same_params(branch["state"]["params"], whole["state"]["params"])


# ------------------------------------------------------------------------------------------------------------ Muon
def _matrix(path: str, x, scanned: bool):
  """A Dense kernel unrolled to the 2-D (inputs, outputs) matrices of its layers: attention 'out' and MLP 'wo' take
  their inputs on the leading axes, the rest on the first one."""
  per_layer = list(x) if scanned else [x]
  out_last = path.endswith(("out/kernel", "wo/kernel"))
  return [m.reshape(-1, m.shape[-1]) if out_last else m.reshape(m.shape[0], -1) for m in per_layer]


@pytest.mark.parametrize("name,overrides", [("gpt2", {"model.scan_layers": True}), ("bert", {})])
def test_one_muon_step_equals_optax_on_the_unrolled_matrices(name, overrides):
  opt = {"optimizer.name": "muon", "optimizer.lr": 0.02, "optimizer.adam_lr": 3e-3, "optimizer.weight_decay": 0.1,
         "optimizer.clip_norm": 0.0, "optimizer.schedule": "constant", "optimizer.warmup_steps": 0}
  small = {"model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64, "model.vocab_size": 128}
  policy = params_lib.resolve(config_lib.load(f"configs/{name}.py:tiny", {**small, **overrides, **opt}))
  tx, _ = optim.make(policy, params_lib.logical_axes(policy))
  rng = np.random.default_rng(0)   # numpy: no model init or per-shape random programs to compile
  params = jax.tree.map(lambda a: 0.02 * rng.standard_normal(a.shape, np.float32), params_lib.abstract(policy))
  # |g| >= 0.1: Adam's first step g / (|g| + eps) rounds differently between two programs as |g| nears eps
  grads = jax.tree.map(lambda p: rng.uniform(0.1, 1, p.shape).astype(np.float32) * rng.choice([-1, 1], p.shape),
                       params)
  updates = jax.jit(lambda g, p: tx.update(g, tx.init(p), p)[0])(grads, params)

  flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in
                       jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))}
  spec = {k: tuple(v) for k, v in flat(params_lib.logical_axes(policy)).items()}
  p, g, u = flat(params), flat(grads), flat(updates)
  hidden = {k for k in p if k.endswith("kernel") and None not in spec[k] and "vocab" not in spec[k]}
  scanned = {k for k in hidden if spec[k][0] == "layers"}
  assert hidden and (scanned if overrides else not scanned)
  assert {"word_embeddings/embedding", "final_ln/scale" if name == "gpt2" else "nsp/kernel"} <= set(p) - hidden
  unroll = lambda t: {f"{k}/{i}": m for k in hidden for i, m in enumerate(_matrix(k, t[k], k in scanned))}
  muon = optax.contrib.muon(0.02, beta=0.95, weight_decay=0.1)   # every leaf 2-D: all Muon
  expected = jax.jit(lambda g, p: muon.update(g, muon.init(p), p)[0])(unroll(g), unroll(p))
  got = unroll(u)
  for k in expected:
    np.testing.assert_allclose(got[k], expected[k], atol=1e-6, err_msg=k)
  rest = {k: p[k] for k in p if k not in hidden}
  decay = {k: not k.endswith("bias") and sum(a != "layers" for a in spec[k]) > 1 for k in rest}
  adamw = optax.adamw(3e-3, 0.9, 0.999, 1e-8, weight_decay=0.1, mask=decay)
  expected = jax.jit(lambda g, p: adamw.update(g, adamw.init(p), p)[0])({k: g[k] for k in rest}, rest)
  for k in rest:
    np.testing.assert_allclose(u[k], expected[k], atol=1e-6, err_msg=k)

"""Muon, Lion, schedule-free AdamW and the WSD schedule (lm_jax/optim.py) against optax and hand computations:
WSD's rate at the warmup, stable, cooldown-start and end steps of each cooldown shape; a cooldown branched from a
stable-phase checkpoint continuing that run exactly; one Muon step on a scanned GPT-2 and on a BERT equal to
optax.contrib.muon on the same matrices unrolled to 2-D, the other leaves to optax.adamw; schedule-free evaluation
at the averaged params, not the iterate; each new optimizer on 8 simulated devices, after kill -9, with LoRA and
with microbatches."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from flax import linen as nn

from lm_jax import checks, config_lib, optim, params as params_lib, train
from lm_jax.evals import evaluators, run_eval
from lm_jax.plan import memory
from conftest import REPO, load_config, records, run_tokenizer
from test_mesh import XLA_FLAGS

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
  _run(shared_data, tmp_path / "stable", total_steps=40, phase_end_step=6)   # trains its tokenizer, as a run does
  tok = {"data.tokenizer": str(next((tmp_path / "stable").glob("tokenizer_*.model")))}
  whole = _run(shared_data, tmp_path / "whole", total_steps=9, **{"optimizer.cooldown_start": 6, **tok})
  branch = _run(shared_data, tmp_path / "branch", total_steps=9, init_from=str(tmp_path / "stable"),
                **{"optimizer.cooldown_start": 6})
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


# ------------------------------------------------------------------------------ Lion and schedule-free AdamW
def _two_steps(tx, params, grads):
  """params after two updates of tx, the same grads each time (schedule-free's weights move by the second)."""
  def run(p, g):
    state = tx.init(p)
    for _ in range(2):
      u, state = tx.update(g, state, p)
      p = optax.apply_updates(p, u)
    return p
  return jax.jit(run)(params, grads)


@pytest.mark.parametrize("name,reference", [
    ("lion", lambda mask: optax.lion(1e-3, 0.9, 0.99, weight_decay=0.1, mask=mask)),
    ("schedule_free_adamw", lambda mask: optax.contrib.schedule_free_adamw(1e-3, warmup_steps=1, weight_decay=0.1))])
def test_lion_and_schedule_free_equal_optax_with_the_decay_mask(name, reference):
  """Decay on GPT-1's weights of rank > 1 that are not biases, as every AdamW here: optax's schedule_free_adamw
  decays every leaf, so it is the reference on the decayed leaves."""
  policy = params_lib.resolve(config_lib.load("configs/gpt1.py:tiny", {
      "optimizer.name": name, "optimizer.clip_norm": 0.0, "optimizer.schedule": "constant", "optimizer.lr": 1e-3,
      "optimizer.weight_decay": 0.1, "optimizer.b2": 0.99 if name == "lion" else 0.999,
      "optimizer.warmup_steps": 0 if name == "lion" else 1}))
  tx, _ = optim.make(policy, params_lib.logical_axes(policy))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda a: 0.02 * rng.standard_normal(a.shape, np.float32), params_lib.abstract(policy))
  grads = jax.tree.map(lambda p: rng.uniform(0.1, 1, p.shape).astype(np.float32) * rng.choice([-1, 1], p.shape),
                       params)
  decay = jax.tree_util.tree_map_with_path(lambda p, x: p[-1].key != "bias" and x.ndim > 1, params)
  got, expected = _two_steps(tx, params, grads), _two_steps(reference(decay), params, grads)
  checked = 0
  for u, e, d in zip(jax.tree.leaves(got), jax.tree.leaves(expected), jax.tree.leaves(decay)):
    if d or name == "lion":
      np.testing.assert_allclose(u, e, rtol=1e-6, atol=1e-9)
      checked += 1
  assert checked >= 4


def test_schedule_free_evaluates_exports_and_decodes_its_average(shared_data, tmp_path):
  """Evaluation in the trainer, --mode=eval and the params export / generate read back (run_eval.restore_params)
  are at x = (y - (1 - b1) z) / b1 (Defazio et al. 2024, eq. 1, written out here), not at the iterate y: the losses
  at the two differ, so reading y fails."""
  config = load_config("clm", shared_data, total_steps=4, eval_every=4, log_every=4, **{
      "optimizer.name": "schedule_free_adamw", "optimizer.lr": 3e-2, "optimizer.warmup_steps": 0})
  result = train.train(config, str(tmp_path))
  sf = [s for s in jax.tree.leaves(result["state"]["opt_state"], is_leaf=lambda x: isinstance(x, optim.SF_STATE))
        if isinstance(s, optim.SF_STATE)][0]
  y = result["state"]["params"]
  x = jax.tree.map(lambda yi, zi: (yi - (1 - sf.b1) * zi) / sf.b1, y, sf.z)
  s, restored, step = run_eval.restore_params(config, str(tmp_path))
  assert step == 4
  _same_params(jax.device_get(restored), jax.device_get(x))
  evaluate = evaluators.make(s)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    at_x, at_y = evaluate(x)["eval_loss"], evaluate(y)["eval_loss"]
  assert abs(at_x - at_y) > 1e-3
  assert result["eval"]["eval_loss"] == pytest.approx(at_x, rel=1e-6)
  assert run_eval.evaluate_checkpoint(config, str(tmp_path))["eval_loss"] == pytest.approx(at_x, rel=1e-6)


# -------------------------------------------------------------------------------- meshes, kill -9, LoRA, microbatches
def _flags(name, tok, **more):
  return {"total_steps": 6, "log_every": 1, "eval_every": 0, "checkpoint_every": 2, "batch_size": 16,
          "data.tokenizer": tok, "optimizer.name": name, "optimizer.lr": 1e-2, "optimizer.warmup_steps": 1, **more}


@pytest.fixture(scope="module")
def tokenizer(shared_data, tmp_path_factory):
  work = tmp_path_factory.mktemp("tok")
  run_tokenizer(load_config("clm", shared_data), str(work))
  return str(next(work.glob("*.model")))


MESH_SCRIPT = textwrap.dedent("""
    import json, pathlib, sys
    import jax, numpy as np
    sys.path.insert(0, {tests!r})
    from conftest import load_config, records
    from lm_jax import train
    out = {{}}
    for name, flags in {runs!r}.items():
      for mesh in [(1, 1, 1), (2, 2, 2)]:
        work = f"{work}/{{name}}-{{mesh}}"
        axes = dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), mesh))
        config = load_config("clm", pathlib.Path({data!r}), **flags, **axes)
        train.train(config, work, devices=jax.devices()[:int(np.prod(mesh))])
        out[f"{{name}} {{mesh}}"] = [[r["loss"], r["grad_norm"]] for r in records(work)]
    print("RESULT" + json.dumps(out))
""")


def test_new_optimizers_on_8_devices_match_one(shared_data, tokenizer, tmp_path):
  """Muon, Lion and schedule-free AdamW: loss and grad norm at each step on a (data 2, fsdp 2, tensor 2) mesh of 8
  simulated devices equal one device's."""
  runs = {name: _flags(name, tokenizer, **{"model.d_model": 64, "model.d_ff": 256}) for name in NEW}
  script = MESH_SCRIPT.format(tests=str(REPO / "tests"), runs=runs, work=str(tmp_path), data=str(shared_data))
  run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": XLA_FLAGS})
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  for name in NEW:
    one, eight = out[f"{name} (1, 1, 1)"], out[f"{name} (2, 2, 2)"]
    assert len(one) == 6 and one[-1][0] < one[0][0], (name, one)
    assert sum(eight, []) == pytest.approx(sum(one, []), rel=1e-5), (name, eight, one)


KILL_SCRIPT = textwrap.dedent("""
    import os, pathlib, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import load_config
    from lm_jax import train
    from lm_jax.data import pipeline
    class Killing:   # the run's iterator, kill -9 before step 5's batch: after checkpoints 2 and 4 were started
      def __init__(self, it):
        self.it, self.taken = it, 0
      def __getattr__(self, name):
        return getattr(self.it, name)
      def __iter__(self):
        return self
      def __next__(self):
        self.taken += 1
        if self.taken == 5:
          os.kill(os.getpid(), signal.SIGKILL)
        return next(self.it)
    make = pipeline.make_train_iterator
    pipeline.make_train_iterator = lambda *args, **kwargs: Killing(make(*args, **kwargs))
    train.train(load_config("clm", pathlib.Path({data!r}), **{flags!r}), {work!r})
""")


@pytest.mark.parametrize("name", NEW)
def test_kill_9_resumes_exactly(name, shared_data, tokenizer, tmp_path, capfd):
  flags = _flags(name, tokenizer)
  whole = train.train(load_config("clm", shared_data, **flags), str(tmp_path / "whole"))
  script = KILL_SCRIPT.format(tests=str(REPO / "tests"), data=str(shared_data), flags=flags, work=str(tmp_path / "b"))
  run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
  capfd.readouterr()
  resumed = train.train(load_config("clm", shared_data, **flags), str(tmp_path / "b"))
  assert re.search(r"resumed step [24] from", capfd.readouterr().out)   # 4 unless its async save was cut short
  keep = lambda recs: [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in recs]
  assert keep(records(tmp_path / "b"))[-2:] == keep(records(tmp_path / "whole"))[-2:]
  _same_params(resumed["state"]["params"], whole["state"]["params"])
  _same_params(resumed["state"]["opt_state"], whole["state"]["opt_state"])


@pytest.mark.parametrize("name", NEW)
def test_lora_adapters_and_microbatches_train(name, shared_data, tokenizer, tmp_path):
  """Adapters only (the optimizer state holds nothing else) with 2 microbatches: the same steps as 1 microbatch."""
  flags = _flags(name, tokenizer, total_steps=3, checkpoint_every=10, **{"lora.rank": 4})
  one = train.train(load_config("clm", shared_data, **flags), str(tmp_path / "one"))
  train.train(load_config("clm", shared_data, microbatches=2, **flags), str(tmp_path / "two"))
  sizes = {x.size for x in jax.tree.leaves(one["state"]["opt_state"]) if x.size > 1}
  assert sizes and max(sizes) <= 32 * 4 * 2, sizes   # a (32, rank) adapter's state, never a kernel's
  loss = lambda tmp: [r["loss"] for r in records(tmp)]
  assert loss(tmp_path / "two") == pytest.approx(loss(tmp_path / "one"), rel=1e-5)
  assert loss(tmp_path / "one")[-1] < loss(tmp_path / "one")[0]


def test_memory_estimate_counts_each_optimizer_state():
  """lm_jax.plan.memory (--mode=summary, plan) from the optimizer's real state: Lion keeps one moment, schedule-free
  two (z and the second moment), Muon one for the matrices and Adam's two for the rest."""
  est = {n: memory.estimate(config_lib.load("configs/gpt2.py:tiny", {"optimizer.name": n}), num_devices=1)
         for n in ("adamw", *NEW)}
  params = est["adamw"].params
  assert est["lion"].opt_state == pytest.approx(params, abs=64)
  assert est["schedule_free_adamw"].opt_state == pytest.approx(2 * params, abs=64)
  assert params < est["muon"].opt_state < est["adamw"].opt_state == pytest.approx(2 * params, abs=64)

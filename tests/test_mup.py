"""µP (model.mup_base_width, lm_jax/models/mup.py) against the `mup` package (microsoft/mup: set_base_shapes,
mup.init, MuReadout, MuAdam) on the same GPT-2 and ModernBERT shapes; base width = width is the standard model
exactly; the coordinate checks; bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from lm_jax import config_lib, models, optim, params as params_lib
from lm_jax.models import attention, mup
from lm_jax.scaling import __main__ as scaling_cli
from lm_jax.scaling import coord_check

BASE, WIDTH, HEADS, VOCAB, POSITIONS = 64, 256, 4, 512, 128


def _config(spec="configs/gpt2.py:tiny", **model):
  return config_lib.load(spec, {"model.vocab_size": VOCAB, **{f"model.{k}": v for k, v in model.items()}})


def _flat(tree):
  return {"/".join(k.key for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}


def _torch_gpt2(width):
  """A GPT-2 of our layout in torch with mup's readout (tied, as GPT-2's), named like our params."""
  nn = pytest.importorskip("torch.nn")
  mup_pkg = pytest.importorskip("mup")

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.attention_ln, self.mlp_ln = nn.LayerNorm(width), nn.LayerNorm(width)
      self.query, self.key, self.value, self.out = (nn.Linear(width, width) for _ in range(4))
      self.wi, self.wo = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

  class GPT2(nn.Module):
    def __init__(self):
      super().__init__()
      self.word_embeddings, self.position_embeddings = nn.Embedding(VOCAB, width), nn.Embedding(POSITIONS, width)
      self.layers_0, self.layers_1 = Block(), Block()
      self.final_ln = nn.LayerNorm(width)
      self.readout = mup_pkg.MuSharedReadout(self.word_embeddings.weight, bias=False)

  return GPT2()


def _torch_modernbert(width):
  """ModernBERT's layout (GeGLU wi_0 / wi_1 of d_ff = 2 x width, no biases, the head's dense + LN, the tied decoder
  with its bias) in torch with mup's readout, named like our params."""
  torch = pytest.importorskip("torch")
  nn, mup_pkg = torch.nn, pytest.importorskip("mup")
  linear = lambda i, o: nn.Linear(i, o, bias=False)
  norm = lambda: nn.LayerNorm(width, bias=False)

  class Block(nn.Module):
    def __init__(self, first):
      super().__init__()
      if not first:
        self.attention_ln = norm()
      self.mlp_ln = norm()
      self.query, self.key, self.value, self.out = (linear(width, width) for _ in range(4))
      self.wi_0, self.wi_1, self.wo = linear(width, 2 * width), linear(width, 2 * width), linear(2 * width, width)

  class Head(nn.Module):
    def __init__(self):
      super().__init__()
      self.dense, self.ln = linear(width, width), norm()

  class ModernBert(nn.Module):
    def __init__(self):
      super().__init__()
      self.word_embeddings, self.embeddings_ln = nn.Embedding(VOCAB, width), norm()
      self.layers_0, self.layers_1 = Block(True), Block(False)
      self.final_ln, self.head = norm(), Head()
      self.readout = mup_pkg.MuSharedReadout(self.word_embeddings.weight, bias=False)
      self.decoder = nn.Parameter(torch.zeros(VOCAB))   # the logits' bias

  return ModernBert()


OURS = {"weight": "kernel", "bias": "bias"}


def _our_name(torch_name: str) -> str:
  """layers_0.query.weight -> layers_0/attention/query/kernel, the LayerNorms' weight -> scale."""
  if torch_name == "decoder":
    return torch_name
  parts = torch_name.split(".")
  *path, leaf = parts
  if path[-1] in ("query", "key", "value", "out"):
    path.insert(-1, "attention")
  elif path[-1] in ("wi", "wi_0", "wi_1", "wo"):
    path.insert(-1, "mlp")
  if path[-1].endswith("_ln") or path[-1] == "ln":
    return "/".join(path + [{"weight": "scale", "bias": "bias"}[leaf]])
  if path[-1].endswith("embeddings"):
    return "/".join(path + ["embedding"])
  return "/".join(path + [OURS[leaf]])


def _mup_reference(make):
  """The mup package's µP for the width-256 model make(256) on the width-64 base: per-param init factor
  (mup.init.normal_'s draws over torch's at std 1), Adam lr factor (MuAdam's groups at lr 1), readout multiplier."""
  torch = pytest.importorskip("torch")
  mup_pkg = pytest.importorskip("mup")
  torch.manual_seed(0)
  model = make(WIDTH)
  mup_pkg.set_base_shapes(model, make(BASE), rescale_params=False)
  named = dict(model.named_parameters())
  init = {}
  for name, p in named.items():
    drawn = torch.empty(p.shape)
    drawn.infshape = p.infshape
    torch.manual_seed(1)
    mup_pkg.init.normal_(drawn, std=1.0)
    torch.manual_seed(1)
    init[name] = float((drawn / torch.empty(p.shape).normal_()).mean())   # the same draws: the factor exactly
  groups = mup_pkg.MuAdam(model.parameters(), lr=1.0).param_groups
  lr = {name: next(g["lr"] for g in groups if any(q is p for q in g["params"])) for name, p in named.items()}
  x = torch.randn(3, WIDTH)
  readout = float((model.readout(x) / (x @ model.word_embeddings.weight.T)).mean().detach())
  return init, lr, readout


@pytest.fixture(scope="module")
def torch_mup():
  return _mup_reference(_torch_gpt2)


def _assert_factors_equal(cfg, torch_mup):
  init, lr, readout = torch_mup
  axes = _flat(models.logical_axes(cfg.model))
  ours_init, ours_lr = _flat(mup.init_scales(cfg.model, axes)), _flat(mup.lr_scales(cfg.model, axes))
  assert set(map(_our_name, lr)) == set(axes)   # every param compared, none left out
  for name in lr:
    ours = _our_name(name)
    assert ours_lr[ours] == pytest.approx(lr[name], rel=1e-6), name
    assert ours_init[ours] == pytest.approx(init[name], rel=1e-5), name
  assert {round(v, 6) for v in ours_lr.values()} == {0.25, 1.0}   # the test sees both kinds
  x = jnp.ones((1, WIDTH))
  assert float(mup.readout(cfg.model, x)[0, 0]) == pytest.approx(readout, rel=1e-6)


def test_init_and_lr_factors_equal_the_mup_package(torch_mup):
  _assert_factors_equal(_config(d_model=WIDTH, d_ff=4 * WIDTH, mup_base_width=BASE), torch_mup)


def test_modernbert_factors_equal_the_mup_package():
  """GeGLU's wi_0, wi_1 (d_model -> d_ff) and wo, and the head's dense, are hidden matrices as in mup; the norms,
  embeddings and the decoder bias are not."""
  cfg = _config("configs/modernbert.py:tiny", d_model=WIDTH, d_ff=2 * WIDTH, mup_base_width=BASE)
  _assert_factors_equal(cfg, _mup_reference(_torch_modernbert))


def test_init_applies_the_factors():
  """params.init under µP is the SP init (same rng) times init_scales."""
  sp, mu = (_config(num_layers=1, d_model=2 * BASE, d_ff=8 * BASE, mup_base_width=b) for b in (0, BASE))
  p_sp, p_mu = (_flat(params_lib.init(c, jax.random.key(0))) for c in (sp, mu))
  scales = _flat(mup.init_scales(mu.model, models.logical_axes(mu.model)))
  for name, value in p_mu.items():
    np.testing.assert_allclose(value, p_sp[name] * scales[name], rtol=1e-6, err_msg=name)


def test_attention_scale_is_one_over_d():
  """mutransformers' attn_mult / d with attn_mult = sqrt(base head_dim), and Attention applies it to q.k."""
  cfg = _config(d_model=WIDTH, d_ff=4 * WIDTH, mup_base_width=BASE)
  dh, dh_base = WIDTH // HEADS, BASE // HEADS
  scale = mup.attention_scale(cfg.model)
  assert scale == pytest.approx(np.sqrt(dh_base) / dh)
  x = jax.random.normal(jax.random.key(1), (1, 5, 16))
  ours = attention.Attention(2, 8, logit_scale=scale)
  p = ours.init(jax.random.key(0), x)["params"]
  # the default 1/sqrt(8) with the query kernel times scale * sqrt(8) gives the same logits
  q = jax.tree.map(lambda k: k * scale * np.sqrt(8), p["query"])
  expect = attention.Attention(2, 8).apply({"params": {**p, "query": q}}, x)[0]
  np.testing.assert_allclose(ours.apply({"params": p}, x)[0], expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["configs/gpt2.py:tiny", "configs/llama.py:tiny", "configs/modernbert.py:tiny"])
def test_base_width_equal_to_the_width_is_the_standard_model(spec):
  """Params, logits and one Adam step (with weight decay) are bitwise those of model.mup_base_width = 0."""
  out = []
  for base in (0, 64):
    config = _config(spec, num_layers=1, d_model=64, d_ff=128, mup_base_width=base)
    config.optimizer.weight_decay = 0.1
    p = params_lib.init(config, jax.random.key(0))
    batch = {"input_ids": jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % VOCAB}
    logits = models.apply(config.model, p, batch)["logits"]
    tx, _ = optim.make(config, models.logical_axes(config.model))
    grads = jax.grad(lambda p: models.apply(config.model, p, batch)["logits"].std())(p)
    updates, _ = tx.update(grads, tx.init(p), p)
    out.append((p, logits, updates))
  for a, b in zip(*out):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_coord_check_under_mup_flat_under_sp_growing():
  """Two widths, 4x apart (the full 64..512 check: docs/mup.md): every µP layer within 2x, SP's logits grow."""
  config = _config(num_layers=1)
  results = coord_check.run(config, [64, 256], steps=3, batch_size=2, length=32)
  assert set(results) == {"mup", "sp"} and results["mup"]["widths"] == [64, 256]
  layers = results["mup"]["layers"]
  assert {"word_embeddings", "position_embeddings", "layers_0/attention", "layers_0/mlp", "logits"} <= set(layers)
  for name, (narrow, wide) in layers.items():
    assert 0.5 <= wide / narrow <= 2, (name, narrow, wide)
  sp = results["sp"]["layers"]["logits"]
  assert sp[1] / sp[0] >= 2, sp


def test_modernbert_coord_check_flat_with_adam_eps_scaled_like_the_gradients():
  """ModernBERT's µP gradients shrink as 1/m, down to the size of its recipe's Adam eps (1e-6) at width 256, which
  then damps the GeGLU MLP's updates (docs/mup.md); with eps / m as well every layer stays within 2x."""
  config = _config("configs/modernbert.py:tiny", num_layers=1)
  tokens = coord_check.batch(config.model, 2, 32, 0)

  def record(width, eps):
    run = config.copy_and_resolve_references()
    run.optimizer.eps = eps
    return coord_check.record(run, coord_check.widen(config.model, width, 64), tokens, steps=3, lr=3e-3)

  narrow, wide, wide_scaled = record(64, 1e-6), record(256, 1e-6), record(256, 1e-6 / 4)
  for name in narrow:
    assert 0.5 <= wide_scaled[name] / narrow[name] <= 2, (name, narrow[name], wide_scaled[name])
  mlp = "layers_0/mlp"
  assert wide_scaled[mlp] / narrow[mlp] >= wide[mlp] / narrow[mlp] + 0.1, (narrow[mlp], wide[mlp], wide_scaled[mlp])


@pytest.mark.parametrize("field, value, message", [
    ("mup_base_width", -1, "model.mup_base_width must be a non-negative integer"),
    ("mup_base_width", 66, "model.mup_base_width=66 is not divisible by model.num_heads=4"),
])
def test_bad_base_width_is_one_line(field, value, message):
  cfg = _config()
  cfg.model[field] = value
  with pytest.raises(ValueError, match=message):
    models.validate(cfg.model)


def test_mup_export_to_hugging_face_is_refused(tmp_path):
  from lm_jax.hf import export
  config = _config(mup_base_width=64)
  with pytest.raises(ValueError, match="model.mup_base_width=64: a µP model's readout"):
    export.save_hf(config.model, {}, str(tmp_path))
  assert not list(tmp_path.iterdir())


def test_mup_with_adafactor_is_refused():
  config = _config(mup_base_width=64)
  config.optimizer.name = "adafactor"
  with pytest.raises(ValueError, match="needs an Adam-family optimizer"):
    optim.make(config, models.logical_axes(config.model))


@pytest.mark.parametrize("flags, message", [
    (["--widths=64,130"], "--widths: 130 is not divisible by model.num_heads=4"),
    (["--widths=64"], "--widths needs two or more increasing positive integers"),
    (["--widths=64,x"], "invalid literal"),
    (["--config=configs/nope.py"], "config file 'configs/nope.py' not found"),
])
def test_coord_check_bad_flags_are_one_line(flags, message, tmp_path, capsys):
  argv = ["coord_check", "--config=configs/gpt2.py:tiny", f"--out={tmp_path}", *flags]
  with pytest.raises(SystemExit) as e:
    scaling_cli.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err and err.count("\n") == 1, err
  assert not list(tmp_path.iterdir())

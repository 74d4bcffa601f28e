"""Scaling laws: constants vs docs/reference.md#scaling-laws, allocation, FLOP counts, fitting, CLI, sweep."""
import ml_collections
import numpy as np
import pytest

from lm_jax import scaling
from lm_jax.flops import PF_DAY


def _model(family, **kw):
  m = ml_collections.ConfigDict(dict(family=family, vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                                     head_dim=0, d_ff=256, gated_ffn=False, num_decoder_layers=0))
  m.update(kw)
  return m


# ---------------------------------------------------------------- constants (docs/reference.md#scaling-laws)

def test_constants_match_reference():
  c, e = scaling.CHINCHILLA, scaling.EPOCH
  assert (c.E, c.A, c.B, c.alpha, c.beta) == (1.69, 406.4, 410.7, 0.34, 0.28)
  assert (e.E, e.A, e.B, e.alpha, e.beta) == (1.817, 482.01, 2085.43, 0.3478, 0.3658)
  assert scaling.KAPLAN_N == dict(alpha=0.076, n_c=8.8e13)
  assert scaling.KAPLAN_D == dict(alpha=0.095, d_c=5.4e13)
  assert scaling.KAPLAN_ND == dict(alpha_n=0.076, alpha_d=0.103, n_c=6.4e13, d_c=1.8e13)
  assert scaling.KAPLAN_C_MIN["alpha"] == 0.050 and scaling.KAPLAN_C_MIN["c_c"] == pytest.approx(3.1e8 * 8.64e19)
  assert PF_DAY == 8.64e19
  # Misquoted constants (docs/reference.md#scaling-laws) must not be what we ship.
  assert c.A != 4.06e8 and c.B != 1.69e9 and c.E != 1.46


def test_kaplan_laws():
  assert scaling.kaplan_loss_n(8.8e13) == pytest.approx(1.0)
  assert scaling.kaplan_loss_n(8.8e13 / 2**(1 / 0.076)) == pytest.approx(2.0)
  assert scaling.kaplan_loss_d(5.4e13) == pytest.approx(1.0)
  assert scaling.kaplan_loss_c_min(3.1e8 * PF_DAY) == pytest.approx(1.0)
  # L(N, D) tends to L(N) with the Table-2 constants when D -> infinity.
  assert scaling.kaplan_loss_nd(1e9, 1e30) == pytest.approx((6.4e13 / 1e9) ** 0.076)
  assert scaling.kaplan_loss_nd(1e9, 1e10) > scaling.kaplan_loss_nd(1e9, 1e11)


# ---------------------------------------------------------------- allocation

@pytest.mark.parametrize("law", [scaling.CHINCHILLA, scaling.EPOCH])
@pytest.mark.parametrize("c", [1e19, 5.76e23, 1e26])
def test_closed_form_allocation_is_the_isoflop_minimum(law, c):
  n, d = law.allocate(c)
  assert 6 * n * d == pytest.approx(c)
  n_num, d_num = scaling.isoflop_minimum(law, c)
  assert n_num == pytest.approx(n, rel=1e-5) and d_num == pytest.approx(d, rel=1e-5)
  # Exponents: N_opt ~ C^a, D_opt ~ C^b.
  n10, d10 = law.allocate(10 * c)
  assert np.log10(n10 / n) == pytest.approx(law.beta / (law.alpha + law.beta))
  assert np.log10(d10 / d) == pytest.approx(law.alpha / (law.alpha + law.beta))
  assert law.a + law.b == pytest.approx(1.0)


def test_allocation_gives_the_papers_numbers():
  c, e = scaling.CHINCHILLA, scaling.EPOCH
  assert c.a == pytest.approx(0.46, abs=0.01) and c.b == pytest.approx(0.54, abs=0.01)  # Chinchilla Table 2 (A3)
  assert e.a == pytest.approx(0.513, abs=5e-4)                                        # Epoch: a = 0.513
  # Tokens per parameter implied by each fit (docs/reference.md#scaling-laws).
  for flops, ratio_c, ratio_e in [(1e21, 50, 21.6), (1e23, 78, 19.2), (5.88e23, 93, 18.4), (1e25, 122, 17.1)]:
    assert scaling.allocate(flops)["tokens_per_param"] == pytest.approx(ratio_c, abs=0.6)
    assert scaling.allocate(flops, "epoch")["tokens_per_param"] == pytest.approx(ratio_e, abs=0.06)
  # Not N = D = sqrt(C/6) (a misquote).
  out = scaling.allocate(5.76e23)
  assert out["D_opt"] / out["N_opt"] > 10
  assert out["loss"] == pytest.approx(c.loss(out["N_opt"], out["D_opt"]))


def test_kaplan_allocation():
  out = scaling.allocate(PF_DAY, "kaplan")
  assert out["N_opt"] == pytest.approx(1.3e9)
  n1, _ = scaling.kaplan_allocate(PF_DAY)
  n2, d2 = scaling.kaplan_allocate(10 * PF_DAY)
  assert np.log10(n2 / n1) == pytest.approx(0.73)
  assert 6 * n2 * d2 == pytest.approx(10 * PF_DAY)
  with pytest.raises(ValueError, match="unknown scaling law 'gopher'"):
    scaling.allocate(1e20, "gopher")


# ---------------------------------------------------------------- FLOPs

def test_kaplan_table1_flops():
  assert scaling.kaplan_params(12, 768) == 12 * 12 * 768**2
  n = scaling.kaplan_params(2, 64, 64, 256)
  assert scaling.kaplan_forward_flops_per_token(2, 64, 128, 64, 256) == 2 * n + 2 * 2 * 128 * 64
  assert scaling.kaplan_forward_flops_per_token(2, 64, 128, 64, 256, n_vocab=512) == (
      2 * n + 2 * 2 * 128 * 64 + 4 * 64 + 2 * 64 * 512)
  assert scaling.flops_6nd(1e9, 2e10) == 1.2e20


def test_gpt_train_flops_by_hand():
  m = _model("gpt")
  seq = 128
  n = scaling.kaplan_params(2, 64, 64, 256) + 64 * 512      # non-embedding + LM head
  want = 6 * n * seq + 3 * 2 * 2 * 2 * seq * seq * 64        # + QK^T and AV over the full L x L grid
  assert scaling.train_flops_per_sequence(m, seq) == want
  # A GPT-2-small step (batch 8 x 128): 6 N T + 12 L d T^2 per sequence ~ 774 GFLOP (docs/reference.md#flop-counts).
  g = _model("gpt", vocab_size=50304, d_model=768, num_layers=12, num_heads=12, d_ff=3072)
  assert 8 * scaling.train_flops_per_sequence(g, 128) == pytest.approx(774.4e9, rel=2e-3)


def test_bert_sparse_head_and_gated_ffn():
  m = _model("bert")
  dense, sparse = scaling.train_flops_per_sequence(m, 128), scaling.train_flops_per_sequence(m, 128, num_predictions=20)
  assert dense - sparse == 3 * 2 * (128 - 20) * (64 * 64 + 64 * 512)
  gated = _model("bert", gated_ffn=True)
  assert scaling.train_flops_per_sequence(gated, 128) - dense == 3 * 2 * 2 * 128 * 64 * 256


def test_t5_train_flops_by_hand():
  m = _model("t5", num_heads=2, head_dim=16, num_decoder_layers=3)  # d_attn 32 != d_model
  L, T, d, a, f, v = 128, 29, 64, 32, 256, 512
  self_attn = lambda n: 2 * n * d * 4 * a + 4 * n * n * a
  ffn = lambda n: 4 * n * d * f
  cross = 2 * T * d * 2 * a + 2 * L * d * 2 * a + 4 * T * L * a
  want = 2 * (self_attn(L) + ffn(L)) + 3 * (self_attn(T) + cross + ffn(T)) + 2 * T * d * v
  assert scaling.train_flops_per_sequence(m, L, target_len=T) == 3 * want
  with pytest.raises(ValueError, match="target_len"):
    scaling.train_flops_per_sequence(m, L)


def _matmul_flops(jaxpr):
  """2 * MACs of every dot_general in a jaxpr, recursing into sub-jaxprs (scan bodies times their length)."""
  from jax.extend import core
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs[i] for i in contract])
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else [value]:
        if isinstance(sub, (core.ClosedJaxpr, core.Jaxpr)):
          total += times * _matmul_flops(getattr(sub, "jaxpr", sub))
  return total


@pytest.mark.parametrize("name,overrides,length,target_len,preds", [
    ("gpt1", {}, 128, 0, 0),
    ("bert", {}, 128, 0, 20),
    ("t5", dict(gated_ffn=True, tie_embeddings=False, num_decoder_layers=3), 64, 29, 0),
])
def test_train_flops_match_the_real_models(name, overrides, length, target_len, preds):
  """Our count = every matmul in the real forward pass (jaxpr), ~ XLA's cost analysis (which also counts
  elementwise ops), and the gradient adds exactly 2x (BERT: less the unused pooler/NSP backward). Traced as for a
  TPU: on a CPU, long causal attention skips its masked triangle (attention._causal_rows), fewer FLOPs than the
  count, which follows the MFU convention of the whole attention."""
  import jax
  import jax.numpy as jnp
  from lm_jax import config_lib, models
  from lm_jax.models import layers
  m = config_lib.load(f"configs/{name}.py:tiny").model
  m.update(overrides)
  ids = jax.ShapeDtypeStruct((2, length), jnp.int32)
  batch = dict(input_ids=ids, attention_mask=ids)
  if name == "bert":
    batch.update(token_type_ids=ids, mlm_positions=jax.ShapeDtypeStruct((2, preds), jnp.int32))
  if name == "t5":
    tgt = jax.ShapeDtypeStruct((2, target_len), jnp.int32)
    batch.update(decoder_input_ids=tgt, decoder_attention_mask=tgt)
  params = models.abstract_params(m)

  def forward(p, b):
    with layers.compiling_for("tpu"):
      return models.apply(m, p, b)["logits"]

  ours = 2 * scaling.forward_flops_per_sequence(m, length, target_len, preds)
  assert _matmul_flops(jax.make_jaxpr(forward)(params, batch).jaxpr) == ours
  xla = jax.jit(forward).lower(params, batch).compile().cost_analysis()["flops"]
  assert ours <= xla <= 1.04 * ours
  loss = lambda p, b: jnp.sum(jax.nn.log_softmax(forward(p, b))[..., 0])
  grad = _matmul_flops(jax.make_jaxpr(jax.grad(loss))(params, batch).jaxpr)
  assert grad == pytest.approx(2 * scaling.train_flops_per_sequence(m, length, target_len, preds), rel=1e-3)


# ---------------------------------------------------------------- fitting

def _synthetic(seed=1, noise=0.005):
  """IsoFLOP-style grid of 48 runs drawn from the Chinchilla law with 0.5% multiplicative noise."""
  rng = np.random.default_rng(seed)
  n = np.repeat(np.geomspace(1e7, 1e10, 8), 6)
  c = np.tile(np.geomspace(1e17, 1e21, 6), 8)
  d = c / (6 * n)
  return n, d, scaling.CHINCHILLA.loss(n, d) * np.exp(rng.normal(0, noise, n.size))


@pytest.fixture(scope="module")
def synthetic_fit():
  from lm_jax.scaling import fit
  n, d, loss = _synthetic()
  law, huber = fit.fit_approach3(n, d, loss)
  return (n, d, loss), law, huber


def test_fit_recovers_the_law_and_cis_cover_it(synthetic_fit):
  from lm_jax.scaling import fit
  (n, d, loss), law, _ = synthetic_fit
  truth = scaling.CHINCHILLA
  assert law.E == pytest.approx(truth.E, abs=0.05)
  assert law.alpha == pytest.approx(truth.alpha, abs=0.02) and law.beta == pytest.approx(truth.beta, abs=0.01)
  assert law.a == pytest.approx(truth.a, abs=0.01)
  assert law.A == pytest.approx(truth.A, rel=0.25) and law.B == pytest.approx(truth.B, rel=0.1)
  ci, fits = fit.bootstrap(n, d, loss, num=64, law=law)
  assert fits.shape == (64, 7)
  for k in fit.PARAMS:
    lo, hi = ci[k]
    assert lo <= getattr(truth, k) <= hi, (k, ci[k])
    assert lo <= getattr(law, k) <= hi and lo < hi
  # Noise-free data: the fit is exact.
  exact, huber = fit.fit_approach3(n, d, scaling.CHINCHILLA.loss(n, d))
  assert huber < 1e-12
  assert (exact.E, exact.alpha, exact.beta) == pytest.approx((truth.E, truth.alpha, truth.beta), rel=1e-4)


def test_batched_lbfgs_reaches_scipys_optimum(synthetic_fit):
  """Our optimizer against scipy's L-BFGS-B (float64, jax gradients) on the same objective."""
  import jax
  import jax.numpy as jnp
  from scipy import optimize
  from lm_jax.scaling import fit
  (n, d, loss), law, huber = synthetic_fit
  x = np.stack([np.log(n), np.log(d), np.log(loss)])
  with jax.enable_x64(True):
    f = jax.jit(jax.value_and_grad(lambda p: fit._objective(p, jnp.asarray(x), jnp.ones(n.size))))
    res = optimize.minimize(lambda p: tuple(np.asarray(v, float) for v in f(p)), np.array([6.0, 6.0, 0.5, 0.3, 0.3]),
                            jac=True, method="L-BFGS-B", options=dict(maxiter=1000, ftol=1e-15, gtol=1e-12))
  assert huber <= res.fun * (1 + 1e-6)
  assert np.array([np.log(law.A), np.log(law.B), np.log(law.E), law.alpha, law.beta]) == pytest.approx(res.x, abs=1e-3)


def test_grid_is_hoffmanns():
  from lm_jax.scaling import fit
  grid = fit.init_grid()
  assert grid.shape == (4500, 5)
  assert sorted(set(grid[:, 0])) == [0, 5, 10, 15, 20, 25] and sorted(set(grid[:, 2])) == [-1, -0.5, 0, 0.5, 1]
  assert sorted(set(grid[:, 3])) == [0, 0.5, 1, 1.5, 2]


def test_approach2_isoflop_parabolas():
  from lm_jax.scaling import fit
  law = scaling.CHINCHILLA
  rows = []
  for c in np.geomspace(1e18, 1e22, 5):
    n_opt, _ = law.allocate(c)
    for n in n_opt * np.geomspace(0.25, 4, 9):
      rows.append((n, c / (6 * n), law.loss(n, c / (6 * n))))
  n, d, loss = map(np.array, zip(*rows))
  out = fit.fit_approach2(n, d, loss)
  assert len(out["budgets"]) == 5
  assert out["a"] == pytest.approx(law.a, abs=0.01) and out["b"] == pytest.approx(law.b, abs=0.01)
  for row in out["budgets"]:
    assert row["N_opt"] == pytest.approx(law.allocate(row["C"])[0], rel=0.05)
  assert fit.fit_approach2(n[:9], d[:9], loss[:9]) is None   # one budget: no exponent


# ---------------------------------------------------------------- CLI

def _cli(capsys, *argv):
  import json
  from lm_jax.scaling.__main__ import main
  main(list(argv))
  return json.loads(capsys.readouterr().out)


def test_cli_allocate_and_predict(capsys):
  out = _cli(capsys, "allocate", "--flops", "5.88e23")
  assert out["D_opt"] / out["N_opt"] == pytest.approx(92.8, abs=0.1)
  assert _cli(capsys, "allocate", "--flops", "5.88e23", "--law", "epoch")["tokens_per_param"] == pytest.approx(18.4, abs=0.05)
  assert _cli(capsys, "allocate", "--flops", str(PF_DAY), "--law", "kaplan")["N_opt"] == pytest.approx(1.3e9)
  out = _cli(capsys, "predict", "--params", "7e10", "--tokens", "1.4e12")
  assert out["loss"] == pytest.approx(1.69 + 406.4 / 7e10**0.34 + 410.7 / 1.4e12**0.28)
  assert _cli(capsys, "predict", "--params", "1e9", "--tokens", "1e10", "--law", "kaplan")["loss"] == pytest.approx(
      scaling.kaplan_loss_nd(1e9, 1e10))


def test_cli_fit_csv(tmp_path, capsys, synthetic_fit):
  (n, d, loss), law, _ = synthetic_fit
  path = tmp_path / "runs.csv"
  path.write_text("N,C,loss\n" + "".join(f"{a},{6 * a * b},{c}\n" for a, b, c in zip(n, d, loss)))
  out = _cli(capsys, "fit", "--runs", str(path), "--plot", str(tmp_path / "fit.png"), "--bootstrap", "8")
  assert out["alpha"] == pytest.approx(law.alpha, rel=1e-4) and out["beta"] == pytest.approx(law.beta, rel=1e-4)
  assert out["a"] == pytest.approx(out["beta"] / (out["alpha"] + out["beta"]))
  assert set(out["ci"]) == {"E", "A", "B", "alpha", "beta", "a", "b"} and out["runs"] == 48
  assert out["approach2"]["a"] == pytest.approx(law.a, abs=0.05)
  assert (tmp_path / "fit.png").stat().st_size > 10_000
  bad = tmp_path / "bad.csv"
  bad.write_text("N,loss\n1,2\n")
  with pytest.raises(ValueError, match="missing column.*D or C"):
    _cli(capsys, "fit", "--runs", str(bad))


# ---------------------------------------------------------------- sweep (the trainer end to end)

def test_sweep_toy_two_budgets_two_sizes(tmp_path, capsys, shared_data):
  """The smallest IsoFLOP sweep: 2 budgets x 2 sizes of tiny decoders trained by lm_jax.train."""
  import csv
  work = tmp_path / "sweep"
  work.mkdir()
  (tmp_path / "precious").write_text("mine")   # links placed where the sweep writes: replaced, never written through
  for name in ("runs.csv", "fit.json"):
    (work / name).symlink_to(tmp_path / "precious")
  out = _cli(capsys, "sweep", "--workdir", str(work), "--budgets", "3e8,6e8", "--sizes", "1x16,1x32",
             "--data", str(shared_data / "tiny_shakespeare" / "input.txt"), "--train_split", "train[:90%]",
             "--eval_split", "train[90%:]", "--vocab", "256", "--seq_len", "32", "--batch", "4",
             "--eval_batches", "2", "--min_steps", "10")
  rows = list(csv.DictReader(open(work / "runs.csv")))
  assert len(rows) == 4 and {r["budget"] for r in rows} == {"300000000.0", "600000000.0"}
  for r in rows:
    n, d, c, steps = float(r["N"]), float(r["D"]), float(r["C"]), int(r["steps"])
    assert d == steps * 4 * 32 and c == pytest.approx(6 * n * d)
    assert c == pytest.approx(float(r["budget"]), rel=0.05)       # D = C / 6N up to whole steps
    assert 3.0 < float(r["loss"]) < np.log(256) + 0.5              # trained a little, from ~log V
    assert float(r["flops"]) > c                                   # the exact count adds attention
  small = {r["budget"]: float(r["loss"]) for r in rows if r["d_model"] == "16"}
  assert small["600000000.0"] < small["300000000.0"]               # twice the tokens: lower loss
  assert out["runs"] == 4 and {"E", "A", "B", "alpha", "beta", "a", "b"} <= set(out)
  assert (work / "fit.png").exists() and (work / "fit.json").exists()
  assert (tmp_path / "precious").read_text() == "mine" and not (work / "runs.csv").is_symlink()

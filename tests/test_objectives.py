"""Objectives: loss values, weights, z-loss / label smoothing, microbatch additivity, registry and config checks,
and the three objectives end to end on tiny real models (packing included)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_jax import defaults, models, objectives
from lm_jax.data.corruption import corrupt_spans, span_lengths
from lm_jax.data.masking import mask_tokens
from lm_jax.objectives import losses

V = 97


def _config(objective, family, seq_len=32, **data):
  c = defaults.base_config()
  c.objective = objective
  c.model = defaults.model_defaults(family)
  c.model.update(vocab_size=V if family != "t5" else 256, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                 max_positions=64, dropout_rate=0.0, attention_dropout_rate=0.0)
  c.data.seq_len = seq_len
  c.data.max_predictions_per_seq = 6
  c.data.update(data)
  return c


# ---------------------------------------------------------------- batches, as the pipeline builds them

def _mlm_batch(config, rows, rng):
  length = config.data.seq_len
  ids = rng.integers(5, config.model.vocab_size, (rows, length))
  ids[:, 0], ids[:, length // 2], ids[:, -1] = 2, 3, 3
  out = mask_tokens(ids, rng=rng, vocab_size=config.model.vocab_size, mask_id=4, special_ids=[0, 1, 2, 3],
                    max_predictions=config.data.max_predictions_per_seq)
  out.update(token_type_ids=(np.arange(length) > length // 2)[None].repeat(rows, 0).astype(np.int32),
             attention_mask=np.ones((rows, length), np.int32))
  if config.data.nsp:
    out["nsp_labels"] = rng.integers(0, 2, rows).astype(np.int32)
  return out


def _pack(docs, length):
  """One packed GPT row: documents back to back, segment ids from 1, positions restarting, 0-padded; a token's
  target is the next token of its own document (weight 0 on each document's last token and on padding)."""
  row = {k: np.zeros(length, np.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
  row["weights"] = np.zeros(length, np.float32)
  start = 0
  for seg, doc in enumerate(docs, 1):
    sl = slice(start, start + len(doc))
    row["input_ids"][sl], row["segment_ids"][sl], row["positions"][sl] = doc, seg, np.arange(len(doc))
    row["targets"][sl][:-1], row["weights"][sl][:-1] = doc[1:], 1.0
    start += len(doc)
  return row


def _clm_batch(config, rows, rng):
  length = config.data.seq_len
  packed = []
  for _ in range(rows):
    sizes = rng.integers(3, length // 4, 3)  # leaves padding at the end
    packed.append(_pack([rng.integers(1, config.model.vocab_size, n) for n in sizes], length))
  return {k: np.stack([p[k] for p in packed]) for k in packed[0]}


def _span_batch(config, rows, rng):
  raw, targets = span_lengths(config.data.seq_len)
  tokens = rng.integers(2, config.model.vocab_size - 100, (rows, raw))
  out = corrupt_spans(tokens, rng=rng, vocab_size=config.model.vocab_size, eos_id=1, noise_density=0.15,
                      mean_span=3.0, inputs_length=config.data.seq_len, targets_length=targets)
  tgt = out["decoder_target_ids"]
  out.update(attention_mask=(out["input_ids"] != 0).astype(np.int32),
             decoder_input_ids=np.pad(tgt[:, :-1], ((0, 0), (1, 0))).astype(np.int32),
             decoder_attention_mask=(tgt != 0).astype(np.int32), weights=(tgt != 0).astype(np.float32))
  return out


CASES = {"mlm": ("bert", _mlm_batch), "clm": ("gpt", _clm_batch), "span_corruption": ("t5", _span_batch)}


def _fake_apply(model_cfg, params, batch, *, rng=None, train=False):
  """A bag-of-embeddings 'model' with the models API's outputs, for testing the losses alone."""
  emb = params["emb"]
  if "decoder_input_ids" in batch:
    h = emb[batch["decoder_input_ids"]] + emb[batch["input_ids"]].mean(1, keepdims=True)
    return {"logits": h @ emb.T}
  h = emb[batch["input_ids"]] * params["scale"]
  if "mlm_positions" in batch:
    return {"logits": jnp.take_along_axis(h, batch["mlm_positions"][..., None], 1) @ emb.T,
            "nsp_logits": h.mean(1) @ params["nsp"]}
  return {"logits": h @ emb.T}


def _fake_params(vocab, rng):
  k1, k2 = jax.random.split(rng)
  return {"emb": jax.random.normal(k1, (vocab, 8)), "scale": jnp.ones(8), "nsp": jax.random.normal(k2, (8, 2))}


# ---------------------------------------------------------------- losses

def _reference_ce(logits, targets, z_loss, ls):
  logits = np.asarray(logits, np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  logp = logits - log_z[..., None]
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return (1 - ls) * nll + ls * -logp.mean(-1) + z_loss * log_z**2, nll


@pytest.mark.parametrize("z_loss,ls", [(0.0, 0.0), (1e-2, 0.0), (0.0, 0.1), (1e-4, 0.2)])
def test_cross_entropy_against_hand_computation(z_loss, ls):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)) * 3 + 2
  targets = rng.integers(0, 11, (3, 5))
  weights = (rng.random((3, 5)) < 0.7) * rng.random((3, 5)) * 2
  out = losses.cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(weights),
                             z_loss=z_loss, label_smoothing=ls)
  loss, nll = _reference_ce(logits, targets, z_loss, ls)
  np.testing.assert_allclose(out["loss"], (loss * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(out["nll"], (nll * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(out["correct"], ((logits.argmax(-1) == targets) * weights).sum(), rtol=1e-6)
  assert all(v.dtype == jnp.float32 for v in out.values())


def test_cross_entropy_matches_torch_label_smoothing():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(1)
  logits, targets = rng.normal(size=(20, 13)).astype(np.float32), rng.integers(0, 13, 20)
  want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(targets), label_smoothing=0.1,
                                           reduction="sum")
  got = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.ones(20), label_smoothing=0.1)
  np.testing.assert_allclose(got["loss"], want.item(), rtol=1e-5)


def test_bf16_logits_are_scored_in_float32():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(4, 300)) * 20, jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, 300, 4))
  got = losses.cross_entropy(logits, targets, jnp.ones(4))
  want = losses.cross_entropy(logits.astype(jnp.float32), targets, jnp.ones(4))
  assert got["loss"].dtype == jnp.float32
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


def test_zero_weight_positions_change_nothing():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.normal(size=(2, 6, 9)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 9, (2, 6)))
  weights = jnp.asarray([[1, 1, 0, 1, 0, 1], [0, 1, 1, 1, 1, 0]], jnp.float32)
  f = lambda x: losses.cross_entropy(x, targets, weights, z_loss=1e-3, label_smoothing=0.1)["loss"]
  changed = logits.at[0, 2].set(1e4).at[1, 5].set(-3e3)
  assert f(changed) == f(logits)
  grad = jax.grad(f)(logits)
  np.testing.assert_array_equal(grad, jax.grad(f)(changed))
  assert not grad[0, 2].any() and grad[0, 0].any()


# ---------------------------------------------------------------- objectives with a fake model

@pytest.mark.parametrize("name", list(CASES))
def test_features_match_the_host_transforms(name):
  family, make = CASES[name]
  config = _config(name, family, nsp=name == "mlm")
  batch = make(config, 3, np.random.default_rng(0))
  want = objectives.get(name).features(config)
  assert {k: (v.shape[1:], v.dtype) for k, v in batch.items()} == {k: (s, np.dtype(d)) for k, (s, d) in want.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_microbatches_add_up_to_the_full_batch(name, monkeypatch):
  monkeypatch.setattr(models, "apply", _fake_apply, raising=False)
  family, make = CASES[name]
  config = _config(name, family, nsp=name == "mlm")
  config.z_loss, config.label_smoothing = 1e-3, 0.1
  objective = objectives.get(name)
  batch = jax.tree.map(jnp.asarray, make(config, 8, np.random.default_rng(0)))
  params = _fake_params(config.model.vocab_size, jax.random.key(0))
  den = objective.denominators(batch)
  loss_fn = jax.jit(lambda b: objective.loss(config, params, b, den, rng=None, train=False))
  full_loss, full = loss_fn(batch)
  parts = [loss_fn(jax.tree.map(lambda x: x[i:i + 2], batch))[1] for i in range(0, 8, 2)]
  assert set(full) >= {"loss", "token_loss"} | {"mlm": {"mlm_accuracy", "nsp_accuracy"}}.get(name, {"accuracy"})
  for k in full:
    np.testing.assert_allclose(sum(p[k] for p in parts), full[k], rtol=1e-5, err_msg=k)
  assert full_loss == full["loss"] and np.isfinite(full_loss)
  # The options reach the loss: without z-loss and smoothing the loss is the plain token NLL (+ NSP).
  plain_config = config.copy_and_resolve_references()
  plain_config.z_loss, plain_config.label_smoothing = 0.0, 0.0
  plain = objective.loss(plain_config, params, batch, den, rng=None, train=False)[1]
  np.testing.assert_allclose(plain["token_loss"], full["token_loss"], rtol=1e-6)
  assert plain["loss"] < full["loss"]


def test_mlm_loss_is_mean_mlm_plus_mean_nsp(monkeypatch):
  monkeypatch.setattr(models, "apply", _fake_apply, raising=False)
  config = _config("mlm", "bert", nsp=True)
  batch = jax.tree.map(jnp.asarray, _mlm_batch(config, 4, np.random.default_rng(5)))
  params = _fake_params(V, jax.random.key(1))
  objective = objectives.get("mlm")
  loss, m = objective.loss(config, params, batch, objective.denominators(batch), rng=None, train=False)
  out = _fake_apply(None, params, batch)
  w = np.asarray(batch["mlm_weights"])
  nll = _reference_ce(out["logits"], np.asarray(batch["mlm_ids"]), 0, 0)[1]
  nsp = _reference_ce(out["nsp_logits"], np.asarray(batch["nsp_labels"]), 0, 0)[1]
  np.testing.assert_allclose(loss, (nll * w).sum() / w.sum() + nsp.mean(), rtol=1e-5)
  np.testing.assert_allclose(m["token_loss"], (nll * w).sum() / w.sum(), rtol=1e-5)


def test_clm_never_scores_padding(monkeypatch):
  monkeypatch.setattr(models, "apply", _fake_apply, raising=False)
  config = _config("clm", "gpt")
  batch = _clm_batch(config, 2, np.random.default_rng(6))
  batch["weights"][batch["segment_ids"] == 0] = 1.0   # even if the pipeline forgot to zero them
  objective = objectives.get("clm")
  params = _fake_params(V, jax.random.key(2))
  den = objective.denominators(batch)
  assert den["tokens"] == ((batch["weights"] > 0) & (batch["segment_ids"] > 0)).sum()
  base = objective.loss(config, params, batch, den, rng=None, train=False)[0]
  batch["input_ids"][batch["segment_ids"] == 0] = 7
  batch["targets"][batch["segment_ids"] == 0] = 5
  assert objective.loss(config, params, batch, den, rng=None, train=False)[0] == base


# ---------------------------------------------------------------- registry and config checks

def test_registry():
  assert {n: objectives.get(n).layouts for n in ("mlm", "clm", "span_corruption")} == {
      "mlm": ("encoder",), "clm": ("decoder",), "span_corruption": ("encoder_decoder",)}
  known = "classify, clm, dpo, gpt_classify, mlm, ppo, reward, sft, span_corruption, text_to_text"
  with pytest.raises(ValueError, match=f"config.objective='prefix_lm' is unknown; known: {known}$"):
    objectives.get("prefix_lm")


def test_span_target_len_auto():
  config = _config("span_corruption", "t5", seq_len=512)
  assert objectives.get("span_corruption").features(config)["decoder_target_ids"][0] == (114,)
  config.data.target_len = 120
  assert objectives.get("span_corruption").features(config)["weights"][0] == (120,)


@pytest.mark.parametrize("name,change,message", [
    ("mlm", {"model.family": "gpt"}, "config.model.family='bert' or config.model.family='modernbert', got 'gpt'"),
    ("mlm", {"data.max_predictions_per_seq": 0}, "config.data.max_predictions_per_seq"),
    ("mlm", {"data.max_predictions_per_seq": 33}, "config.data.max_predictions_per_seq"),
    ("mlm", {"data.mlm_probability": 1.5}, "config.data.mlm_probability"),
    ("clm", {"data.seq_len": 65}, "config.data.seq_len=65 exceeds config.model.max_positions=64"),
    ("span_corruption", {"model.vocab_size": 103}, "config.model.vocab_size=103"),
    ("span_corruption", {"data.target_len": 4}, "config.data.target_len=4"),
    ("span_corruption", {"data.noise_density": 0.0}, "config.data.noise_density"),
    ("clm", {"label_smoothing": 1.0}, "config.label_smoothing"),
])
def test_check_names_the_field(name, change, message):
  family = CASES[name][0]
  objectives.check(_config(name, family))
  config = _config(name, family)
  for path, value in change.items():
    *parents, leaf = path.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
    objectives.check(config)


# ---------------------------------------------------------------- tiny real models

@pytest.mark.parametrize("name", list(CASES))
def test_end_to_end_on_tiny_real_models(name):
  family, make = CASES[name]
  config = _config(name, family, nsp=name == "mlm")
  objectives.check(config)
  objective = objectives.get(name)
  params = models.init(config.model, jax.random.key(0))
  batch = jax.tree.map(jnp.asarray, make(config, 4, np.random.default_rng(0)))
  den = objective.denominators(batch)
  loss_fn = lambda p: objective.loss(config, p, batch, den, rng=jax.random.key(1), train=True)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
  assert all(np.isfinite(v) for v in metrics.values()), metrics
  assert abs(metrics["token_loss"] - np.log(config.model.vocab_size)) < 1.0  # ~uniform at init
  zero = [jax.tree_util.keystr(p) for p, g in jax.tree_util.tree_leaves_with_path(grads) if not np.any(g)]
  assert not zero, f"parameters without gradient: {zero}"


def test_packed_gpt_row_equals_documents_alone():
  """Row 0 packs three documents; rows 1-3 hold each document alone (all in one batch: one compile)."""
  config = _config("clm", "gpt")
  length = config.data.seq_len
  params = models.init(config.model, jax.random.key(0))
  rng = np.random.default_rng(7)
  docs = [rng.integers(1, V, n) for n in (9, 5, 11)]
  rows = [_pack(docs, length)] + [_pack([doc], length) for doc in docs]
  batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
  logits = models.apply(config.model, params, dict(
      input_ids=batch["input_ids"], segment_ids=batch["segment_ids"], positions=batch["positions"],
      attention_mask=(batch["segment_ids"] > 0).astype(jnp.int32)))["logits"]
  start = 0
  for i, doc in enumerate(docs, 1):
    np.testing.assert_allclose(logits[0, start:start + len(doc)], logits[i, :len(doc)], atol=1e-5, rtol=1e-5)
    start += len(doc)

  # Through the objective: the packed row's loss is exactly its documents' losses; padding is never counted.
  objective = objectives.get("clm")
  nll = jax.jit(lambda b: objective.loss(config, params, b, {"tokens": 1.0}, rng=None, train=False)[1][
      "token_loss"])
  only = lambda b, keep: dict(b, weights=b["weights"] * jnp.asarray(keep, jnp.float32)[:, None])
  packed_nll = nll(only(batch, [1, 0, 0, 0]))
  np.testing.assert_allclose(packed_nll, nll(only(batch, [0, 1, 1, 1])), rtol=1e-5)
  pad = np.arange(length) >= start
  junk = dict(batch, input_ids=batch["input_ids"].at[0, pad].set(3), targets=batch["targets"].at[0, pad].set(4),
              weights=batch["weights"].at[0, pad].set(1.0))
  np.testing.assert_allclose(nll(only(junk, [1, 0, 0, 0])), packed_nll, rtol=1e-6)

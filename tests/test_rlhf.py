"""SFT, reward model and DPO (lm_jax/objectives/{sft,reward,dpo}.py) on the toy tasks of lm_jax/data/toy_tasks.py:
masks and losses against hand computations, and tiny runs that learn, chained through workdirs like the stages."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lm_jax import checks, config_lib, decoding, models, setup as setup_lib, train
from lm_jax.data import instructions, toy_tasks
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.evals import run_eval
from lm_jax.objectives import dpo, reward, sft
from lm_jax.peft import lora

MODEL = {"model.d_model": 64, "model.num_layers": 2, "model.num_heads": 4, "model.d_ff": 256}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """The toy files (fixed-length reverse instructions, letter-count preferences) and one tokenizer for all."""
  out = tmp_path_factory.mktemp("toy")
  paths = toy_tasks.write_toy(str(out), train=1000, dev=100, tasks=("reverse",), length=(4, 4))
  lines = [json.loads(l)["text"] for name in os.listdir(out) for l in open(out / name)]
  (out / "toy.model").write_bytes(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=64))
  tok = tokenizer_lib.load(str(out / "toy.model"), models.family("gpt"))
  return dict(paths, dir=out, tokenizer=str(out / "toy.model"), tok=tok)


def _config(stage, toy, **overrides):
  kind = "instruction" if stage == "sft" else "preference"
  values = {**MODEL, "rlhf.files": toy[kind], "data.tokenizer": toy["tokenizer"], "data.files": "",
            "data.seq_len": 48, "batch_size": 16, "log_every": 1000, "checkpoint_every": 1000}
  return config_lib.load(f"configs/rlhf/{stage}.py:tiny", {**values, **overrides})


def _examples(config, tok, split, kind):
  found = instructions.examples(config, split, tok, kind)
  return [e for e in found.tokens(list(range(len(found)))) if e is not None], found


# ----------------------------------------------------------------------------------------------------- data
def test_bad_records_are_counted_and_skipped(toy, tmp_path):
  lines = ['{"prompt": "reverse : a", "response": "a"}', "not json", '{"prompt": "reverse : b"}',
           '{"prompt": 3, "response": "b"}', '{"prompt": "reverse : c", "response": "  "}',
           '{"question": "reverse : d", "answer": "d"}']
  (tmp_path / "x_train.jsonl").write_text("\n".join(lines) + "\n")
  c = _config("sft", toy, **{"rlhf.files": str(tmp_path / "x_{split}.jsonl"), "rlhf.template": "write : {prompt}"})
  good, found = _examples(c, toy["tok"], "train", "instruction")
  assert found.stats == dict(documents=6, empty=1, malformed=4)
  assert len(good) == 1 and toy["tok"].decode(good[0].prompt) == "write : reverse : a"
  assert good[0].responses[0][-1] == toy["tok"].eos_id
  c = config_lib.override(c, {"rlhf.prompt_field": "question", "rlhf.response_field": "answer"})
  assert len(_examples(c, toy["tok"], "train", "instruction")[0]) == 1
  with pytest.raises(ValueError, match="config.rlhf.template"):
    instructions.check(config_lib.override(c, {"rlhf.template": "no placeholder"}))
  assert instructions.fit(10, 3, 8) == (5, 3) and instructions.fit(10, 20, 8) == (1, 7)


def test_sft_rows_weight_exactly_the_response_and_keep_examples_apart(toy):
  c = _config("sft", toy)
  examples, _ = _examples(c, toy["tok"], "train", "instruction")
  examples = examples[:12]
  rows = sft.pack_causal(examples, 48, toy["tok"].pad_id)
  assert len(rows["input_ids"]) < len(examples)              # several examples per row
  seen = 0
  for r in range(len(rows["input_ids"])):
    for s in range(1, rows["segment_ids"][r].max() + 1):
      at = rows["segment_ids"][r] == s
      ex = examples[seen]
      np.testing.assert_array_equal(rows["input_ids"][r][at], np.concatenate([ex.prompt, ex.responses[0][:-1]]))
      np.testing.assert_array_equal(rows["positions"][r][at], np.arange(at.sum()))
      np.testing.assert_array_equal(rows["targets"][r][at & (rows["weights"][r] == 1)], ex.responses[0])
      assert rows["weights"][r][at].sum() == len(ex.responses[0])
      seen += 1
  assert seen == len(examples) and not rows["weights"][rows["segment_ids"] == 0].any()


@pytest.fixture(scope="module")
def tiny_gpt(toy):
  c = _config("sft", toy)
  return c, models.init(c.model, jax.random.key(0))


def test_sft_prompt_tokens_never_reach_loss_or_gradient(toy, tiny_gpt, monkeypatch):
  c, params = tiny_gpt
  examples, _ = _examples(c, toy["tok"], "train", "instruction")
  batch = {k: jnp.asarray(v) for k, v in sft.pack_causal(examples[:10], 48, toy["tok"].pad_id).items()}
  den = sft.denominators(batch)
  assert float(den["tokens"]) == sum(len(e.responses[0]) for e in examples[:10])
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: sft.loss(c, p, b, den)[0]))
  loss, grads = value_and_grad(params, batch)
  # the targets at prompt positions (weight 0) changed to anything: the same loss and parameter gradients
  prompt = np.asarray(batch["weights"]) == 0
  noise = np.random.default_rng(0).integers(3, 30, prompt.shape)
  perturbed = dict(batch, targets=jnp.where(prompt, noise, batch["targets"]))
  loss2, grads2 = value_and_grad(params, perturbed)
  assert float(loss2) == float(loss)
  jax.tree.map(np.testing.assert_array_equal, grads, grads2)
  # d loss / d logits is exactly 0 at every prompt (and padding) position, non-zero at every response position
  apply = models.apply
  shift = jnp.zeros((*batch["input_ids"].shape, c.model.vocab_size))
  def with_shift(delta):
    monkeypatch.setattr(models, "apply", lambda *a, **k: dict(apply(*a, **k), logits=apply(*a, **k)["logits"] + delta))
    return sft.loss(c, params, batch, den)[0]
  per_position = np.abs(np.asarray(jax.jit(jax.grad(with_shift))(shift))).sum(-1)
  assert (per_position[prompt] == 0).all() and (per_position[~prompt] > 0).all()


def test_sft_packed_rows_equal_examples_alone(toy, tiny_gpt):
  c, params = tiny_gpt
  examples, _ = _examples(c, toy["tok"], "train", "instruction")
  pad, one = toy["tok"].pad_id, {"tokens": jnp.float32(1)}
  packed = sft.pack_causal(examples[:2], 48, pad)
  assert len(packed["input_ids"]) == 1
  loss = jax.jit(lambda batch: sft.loss(c, params, batch, one)[0])
  alone = sum(float(loss(sft.pack_causal([e], 48, pad))) for e in examples[:2])
  np.testing.assert_allclose(float(loss(packed)), alone, rtol=1e-5)


def test_sft_t5_encodes_prompt_and_decodes_response(toy):
  c = config_lib.load("configs/t5.py:tiny", {
      "objective": "sft", "rlhf.files": toy["instruction"], "data.tokenizer": toy["tokenizer"], "data.seq_len": 16,
      "data.target_len": 8, "model.vocab_size": 256, "model.d_model": 32, "model.num_layers": 1,
      "model.num_heads": 2, "model.d_ff": 64})
  tok = tokenizer_lib.load(toy["tokenizer"], models.family("t5"))
  examples, _ = _examples(c, tok, "train", "instruction")
  rows = sft.encoder_decoder(examples[:4], 16, 8, tok.pad_id, 0)
  for i, ex in enumerate(examples[:4]):
    n = len(ex.responses[0])
    np.testing.assert_array_equal(rows["decoder_target_ids"][i, :n], ex.responses[0])
    np.testing.assert_array_equal(rows["decoder_input_ids"][i, 1:n], ex.responses[0][:-1])
    assert rows["weights"][i].sum() == n and rows["attention_mask"][i].sum() == len(ex.prompt)
  params = models.init(c.model, jax.random.key(0))
  loss, metrics = jax.jit(lambda p, b: sft.loss(c, p, b, sft.denominators(b)))(params, rows)
  assert np.isfinite(float(loss)) and 0 <= float(metrics["accuracy"]) <= 1


# ---------------------------------------------------------------------------------------------- losses by hand
def test_reward_loss_and_accuracy_equal_a_hand_computation(toy):
  c = _config("reward", toy, **{"rlhf.margin": 0.5})
  params = models.init(c.model, jax.random.key(1))
  examples, _ = _examples(c, toy["tok"], "dev", "preference")
  batch = reward.pair_rows(examples[:6], 48, toy["tok"].pad_id)
  batch["pair_weights"][5] = 0.0                               # a padding pair counts nowhere
  _, metrics = reward.loss(c, params, batch, reward.denominators(batch))
  # causal: a sequence's scores do not depend on what follows it, so no mask is needed to read its last one
  scores = np.asarray(models.apply(c.model, params, {"input_ids": batch["input_ids"][:5].reshape(10, 48)})["scores"])
  last = [len(ex.prompt) + len(response) - 1 for ex in examples[:5] for response in ex.responses]
  r = scores[np.arange(10), last, 0].reshape(5, 2)
  gap = r[:, 0] - r[:, 1]
  np.testing.assert_allclose(float(metrics["loss"]), np.mean(np.log1p(np.exp(-(gap - 0.5)))), rtol=1e-4)
  np.testing.assert_allclose(float(metrics["accuracy"]), np.mean(gap > 0))
  np.testing.assert_allclose(float(metrics["reward_gap"]), gap.mean(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(metrics["chosen_reward"]), r[:, 0].mean(), rtol=1e-4, atol=1e-6)


def test_dpo_loss_equals_the_closed_form():
  pc, pr, rc, rr = (np.array(x, np.float32) for x in ([-3.0, -7.5, -2.0], [-4.0, -6.0, -9.0], [-3.5, -7.0, -2.5],
                                                       [-3.0, -6.5, -8.0]))
  beta, w = 0.2, np.array([1.0, 1.0, 0.0], np.float32)
  sums = dpo.pair_loss(pc, pr, rc, rr, w, beta)
  z = beta * ((pc - rc) - (pr - rr))
  expect = -np.log(1 / (1 + np.exp(-z)))
  np.testing.assert_allclose(float(sums["loss"]), expect[:2].sum(), rtol=1e-6)
  np.testing.assert_allclose(float(sums["margin"]), z[:2].sum(), rtol=1e-6)
  np.testing.assert_allclose(float(sums["chosen_reward"]), beta * (pc - rc)[:2].sum(), rtol=1e-6)
  assert float(sums["accuracy"]) == (z[:2] > 0).sum()


# ------------------------------------------------------------------------------- the stages, chained, learning
@pytest.fixture(scope="module")
def sft_run(toy, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("sft"))
  c = _config("sft", toy, **{"total_steps": 300, "eval_every": 0, "optimizer.lr": 3e-3, "data.seq_len": 64})
  return c, workdir, train.train(c, workdir)


def test_sft_learns_the_instruction_task(toy, sft_run):
  c, workdir, result = sft_run
  tok = toy["tok"]
  held_out = [json.loads(l) for l in open(toy["instruction"].format(split="dev"))]
  model_cfg = setup_lib.setup(c, workdir).config.model
  out = decoding.generate(model_cfg, result["state"]["params"], [tok.encode(r["prompt"]) for r in held_out],
                          max_new_tokens=8, eos_id=tok.eos_id, pad_id=tok.pad_id)
  exact = np.mean([tok.decode(o[:-1]) == r["response"] and o[-1] == tok.eos_id for o, r in zip(out, held_out)])
  assert exact >= 0.95


def test_reward_model_from_sft_ranks_held_out_pairs(toy, sft_run):
  _, sft_dir, _ = sft_run
  c = _config("reward", toy, **{"init_from": sft_dir, "total_steps": 150, "eval_every": 150})
  result = train.train(c, os.path.join(sft_dir, "rm"))
  assert result["eval"]["eval_accuracy"] >= 0.9


def test_dpo_from_sft_raises_the_held_out_margin(toy, sft_run):
  _, sft_dir, _ = sft_run
  c = _config("dpo", toy, **{"init_from": sft_dir, "total_steps": 60, "eval_every": 60, "log_every": 1})
  workdir = os.path.join(sft_dir, "dpo")
  result = train.train(c, workdir)
  first = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))][0]
  np.testing.assert_allclose(first["loss"], np.log(2), rtol=1e-5)    # policy = reference = the SFT model
  assert result["eval"]["eval_margin"] > 0.1 and result["eval"]["eval_accuracy"] > 0.7
  policy, reference = dpo.split_reference(c, result["state"]["params"])
  sft_params = run_eval.restore_params(_config("sft", toy), sft_dir)[1]
  jax.tree.map(np.testing.assert_array_equal, reference, sft_params)   # frozen: still the SFT model
  assert not np.array_equal(policy["word_embeddings"]["embedding"], reference["word_embeddings"]["embedding"])


def test_dpo_with_lora_uses_the_frozen_base_as_reference(toy, sft_run):
  """DPO with LoRA: no reference copy; the reference is the base without adapters (bit-identical to the SFT model
  after training), policy = reference at the start, and the adapters alone raise the held-out margin."""
  _, sft_dir, _ = sft_run
  fields = {"init_from": sft_dir, "total_steps": 60, "eval_every": 60, "log_every": 1, "model.frozen_reference": False,
            "lora.rank": 8, "lora.targets": ("kernel",), "optimizer.lr": 3e-3}
  with pytest.raises(ValueError, match="frozen_reference=False"):
    checks.validate(_config("dpo", toy, **{**fields, "model.frozen_reference": True}), num_devices=1)
  workdir = os.path.join(sft_dir, "dpo_lora")
  c = _config("dpo", toy, **fields)
  result = train.train(c, workdir)
  first = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))][0]
  np.testing.assert_allclose(first["loss"], np.log(2), rtol=1e-5)
  assert result["eval"]["eval_margin"] > 0.1 and result["eval"]["eval_accuracy"] > 0.7, result["eval"]
  params = result["state"]["params"]
  policy, reference = dpo.split_reference(c, params)
  assert models.REFERENCE not in params and lora.KEY in policy and lora.KEY not in reference
  sft_params = run_eval.restore_params(_config("sft", toy), sft_dir)[1]
  jax.tree.map(np.testing.assert_array_equal, reference, sft_params)


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_configs_validate_and_name_the_field_at_fault(stage):
  for variant in ("gpt1", "tiny", "sst2"):
    c = config_lib.load(f"configs/rlhf/{stage}.py:{variant}", {"model.scan_layers": True, "rlhf.files": "x_{split}.jsonl"})
    checks.validate(c, num_devices=8)
  wrong = {"sft": {"rlhf.template": "nothing"}, "reward": {"model.num_labels": 0},
           "dpo": {"model.frozen_reference": False}}[stage]
  with pytest.raises(ValueError, match=next(iter(wrong))):
    checks.validate(config_lib.load(f"configs/rlhf/{stage}.py:tiny", wrong), num_devices=1)

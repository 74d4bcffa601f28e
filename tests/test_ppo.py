"""PPO: its arithmetic equals a NumPy transcription of TRL's PPOTrainer formulas on fixed tensors; the scoring pass
reads the rollouts where the model scores them; a tiny policy raises an exact reward well above its initial one with
the KL to the reference bounded; kill -9 and SIGTERM resume to exactly the uninterrupted run."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from lm_jax import checks, config_lib, models
from lm_jax.data import instructions, tokenizer
from lm_jax.obs import metrics_log
from lm_jax.rlhf import ppo, ppo_math, rollout
from conftest import REPO, run_tokenizer

ITERATIONS = 20


# ---------------------------------------------------------------------------- NumPy reference (TRL's formulas)
def np_masked_mean(x, mask):
  return (x * mask).sum() / mask.sum()


def np_whiten(x, mask, shift_mean=True):
  mean = np_masked_mean(x, mask)
  var = np_masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1)   # unbiased, as TRL's masked_var
  out = (x - mean) / np.sqrt(var + 1e-8)
  return out if shift_mean else out + mean


def np_rewards(logprobs, ref_logprobs, scores, mask, kl_coef):
  kl = (logprobs - ref_logprobs) * mask
  rewards = -kl_coef * kl
  rewards[np.arange(len(scores)), mask.sum(1).astype(int) - 1] += scores
  return rewards, kl


def np_gae(rewards, values, mask, gamma, lam):
  """TRL's backward loop, with values and rewards zeroed past each response's end (its masked_fill)."""
  rewards, values = rewards * mask, values * mask
  last, out = 0.0, []
  for t in reversed(range(rewards.shape[1])):
    next_values = values[:, t + 1] if t < rewards.shape[1] - 1 else 0.0
    delta = rewards[:, t] + gamma * next_values - values[:, t]
    last = delta + gamma * lam * last
    out.append(last)
  advantages = np.stack(out[::-1], axis=1)
  return advantages, advantages + values


def np_policy_loss(logprobs, old_logprobs, advantages, mask, cliprange):
  ratio = np.exp(logprobs - old_logprobs)
  losses, clipped = -advantages * ratio, -advantages * np.clip(ratio, 1 - cliprange, 1 + cliprange)
  return (np_masked_mean(np.maximum(losses, clipped), mask), np_masked_mean((clipped > losses).astype(float), mask),
          0.5 * np_masked_mean((logprobs - old_logprobs) ** 2, mask))


def np_value_loss(values, old_values, returns, mask, cliprange_value):
  clipped_values = np.clip(values, old_values - cliprange_value, old_values + cliprange_value)
  losses, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
  return 0.5 * np_masked_mean(np.maximum(losses, clipped), mask), np_masked_mean((clipped > losses).astype(float), mask)


@pytest.fixture(scope="module")
def tensors():
  rng = np.random.default_rng(0)
  b, n = 4, 7
  lengths = np.array([7, 3, 1, 5])
  mask = (np.arange(n)[None] < lengths[:, None]).astype(np.float32)
  f = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
  return dict(mask=mask, logprobs=f(b, n) - 2, ref_logprobs=f(b, n) - 2, old_logprobs=f(b, n, scale=0.3) - 2,
              values=f(b, n), old_values=f(b, n), returns=f(b, n), advantages=f(b, n), scores=f(b))


def test_kl_penalty_and_score_at_the_last_token(tensors):
  t = tensors
  rewards, kl = ppo_math.token_rewards(t["logprobs"], t["ref_logprobs"], t["scores"], t["mask"], 0.1)
  want_rewards, want_kl = np_rewards(t["logprobs"], t["ref_logprobs"], t["scores"], t["mask"], 0.1)
  np.testing.assert_allclose(rewards, want_rewards, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(kl, want_kl, rtol=1e-6, atol=1e-6)
  assert rewards[2, 0] == pytest.approx(t["scores"][2] - 0.1 * (t["logprobs"][2, 0] - t["ref_logprobs"][2, 0]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5)])
def test_gae(tensors, gamma, lam):
  t = tensors
  rewards = np_rewards(t["logprobs"], t["ref_logprobs"], t["scores"], t["mask"], 0.1)[0]
  advantages, returns = ppo_math.gae(rewards, t["values"], t["mask"], gamma, lam)
  want_advantages, want_returns = np_gae(rewards, t["values"], t["mask"], gamma, lam)
  np.testing.assert_allclose(advantages, want_advantages, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(returns, want_returns, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten(tensors, shift_mean):
  x, mask = tensors["advantages"] * 3 + 1, tensors["mask"]
  np.testing.assert_allclose(ppo_math.whiten(x, mask, shift_mean) * mask, np_whiten(x, mask, shift_mean) * mask,
                             rtol=1e-5, atol=1e-5)


def test_clipped_policy_and_value_losses(tensors):
  t = tensors
  loss, metrics = ppo_math.policy_loss(t["logprobs"], t["old_logprobs"], t["advantages"], t["mask"], 0.2)
  want_loss, want_clip, want_kl = np_policy_loss(t["logprobs"], t["old_logprobs"], t["advantages"], t["mask"], 0.2)
  np.testing.assert_allclose([loss, metrics["clip_frac"], metrics["approx_kl"]], [want_loss, want_clip, want_kl],
                             rtol=1e-5)
  assert 0 < want_clip < 1   # both branches of the max are exercised
  loss, metrics = ppo_math.value_loss(t["values"], t["old_values"], t["returns"], t["mask"], 0.2)
  want_loss, want_clip = np_value_loss(t["values"], t["old_values"], t["returns"], t["mask"], 0.2)
  np.testing.assert_allclose([loss, metrics["value_clip_frac"]], [want_loss, want_clip], rtol=1e-5)
  assert 0 < want_clip < 1
  # a minibatch's sums over a larger denominator: what lm_jax.step accumulates over microbatches
  half, _ = ppo_math.value_loss(t["values"], t["old_values"], t["returns"], t["mask"], 0.2, 2 * t["mask"].sum())
  np.testing.assert_allclose(half, want_loss / 2, rtol=1e-5)


def test_adaptive_kl_controller():
  """Ziegler et al. §2.2: beta grows when the KL is above target, shrinks below, by at most 20% * n / horizon."""
  assert ppo_math.adaptive_kl_coef(0.1, 12.0, 6.0, 100.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
  assert ppo_math.adaptive_kl_coef(0.1, 5.7, 6.0, 100.0, 10) == pytest.approx(0.1 * (1 - 0.05 * 10 / 100))


@pytest.mark.parametrize("overrides, message", [
    ({"ppo.reward_fn": "nope"}, "config.ppo.reward_fn='nope' is unknown; known: count_e, toy_preference"),
    ({"ppo.reward_fn": ""}, "config.objective='ppo' needs config.ppo.reward_from (a reward model's workdir) or "
                            "config.ppo.reward_fn"),
    ({"ppo.max_new_tokens": 57}, "config.ppo.prompt_len + max_new_tokens = 65 exceeds config.model.max_positions=64"),
    ({"ppo.minibatches": 3}, "config.ppo.minibatches=3 must be >= 1 and divide config.batch_size=32"),
    ({"ppo.lam": 1.5}, "config.ppo.lam must be in [0, 1], got 1.5"),
])
def test_config_mistakes_are_one_line(overrides, message):
  config = config_lib.load("configs/rlhf/ppo.py:tiny", overrides)
  with pytest.raises(config_lib.ConfigError, match="^" + re.escape(message)):
    checks.validate(config, 1)


def test_sst2_variant_validates_and_fits_the_sft_model():
  """configs/rlhf/ppo.py:sst2 with its two workdirs validates; prompt + response fit the SST-2 SFT model's positions;
  minibatches split the rollouts."""
  config = config_lib.load("configs/rlhf/ppo.py:sst2", {"init_from": "/tmp/sst2/sft", "ppo.reward_from": "/tmp/sst2/rm"})
  checks.validate(config, 1)
  sft = config_lib.load("configs/rlhf/sft.py:sst2")
  assert config.ppo.prompt_len + config.ppo.max_new_tokens <= sft.model.max_positions
  assert config.ppo.prompts.startswith(sft.rlhf.files.replace("{split}.jsonl", ""))   # the SFT data's prompts
  assert config.batch_size % config.ppo.minibatches == 0 and not config.ppo.reward_fn


def test_prompts_are_formatted_by_the_sft_template(overrides, tmp_path):
  """PPO's prompts are the ids SFT trains on: config.rlhf.template applied, each text tokenized alone."""
  records = [{"prompt": "To be, or not", "response": "x"}, {"prompt": "Citizen", "response": "y"}]
  (tmp_path / "p_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  config = config_lib.load("configs/rlhf/ppo.py:tiny", {**overrides, "ppo.prompts": str(tmp_path / "p_train.jsonl"),
                                                        "rlhf.files": str(tmp_path / "p_{split}.jsonl"),
                                                        "rlhf.template": "Human: {prompt}\n\nAssistant:"})
  tok = tokenizer.load(overrides["data.tokenizer"], models.family("gpt"))
  examples = instructions.examples(config, "train", tok, "instruction")
  sft = [e.prompt.tolist() for e in examples.tokens(list(range(len(examples))))]
  assert instructions.prompts(config, tok) == [ids[-config.ppo.prompt_len:] for ids in sft]
  assert tok.encode("Human: Citizen")[-1] != sft[1][-1]   # the template's end is in the prompt
  with config.unlocked():
    config.rlhf.template = "Human: <prompt>"
  with pytest.raises(ValueError, match="config.rlhf.template must contain '{prompt}'"):
    instructions.prompts(config, tok)


def _bench_judge():
  spec = importlib.util.spec_from_file_location("rlhf_sst2", REPO / "bench" / "rlhf_sst2.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_sst2_judge_table_and_time_split():
  """bench/rlhf_sst2.py's summaries on fixed numbers: means, standard errors, the positive rate at P > 0.5, and the
  time split without the compiling first iteration."""
  judge = _bench_judge()
  samples = {"SFT": dict(rm=[0.0, 1.0, 2.0, 3.0], p_pos=[0.2, 0.4, 0.6, 0.9], kl=[0.0] * 4, length=[3, 5, 7, 9]),
             "PPO": dict(rm=[4.0, 4.0, 4.0, 4.0], p_pos=[0.8, 0.9, 0.51, 0.3], kl=[1, 2, 3, 6], length=[8] * 4)}
  summary = judge.summarise({k: {f: np.asarray(v, float) for f, v in s.items()} for k, s in samples.items()})
  assert summary["SFT"]["rm"] == pytest.approx((1.5, np.std([0, 1, 2, 3], ddof=1) / 2))
  assert summary["SFT"]["pos_rate"][0] == 0.5 and summary["PPO"]["pos_rate"][0] == 0.75
  assert summary["PPO"]["p_pos"][0] == pytest.approx(0.6275) and summary["PPO"]["kl"][0] == 3.0
  lines = judge.table(summary).splitlines()
  assert len(lines) == 4 and lines[3].startswith("| PPO | 4.00 ± 0.00 | 0.627 ± ") and "| 3.0 ± 1.1 | 8.0 ± 0.0 |" in lines[3]
  records = [{"step": 1, "rollout_s": 9.0, "scoring_s": 5.0, "update_s": 20.0, "reward": -1.0, "kl": 0.0,
              "tokens_per_sec": 10.0}] + [
             {"step": i, "rollout_s": 1.0 + i, "scoring_s": 0.5, "update_s": 2.5, "reward": float(i), "kl": 0.5 * i,
              "tokens_per_sec": 100.0} for i in (2, 3, 4)]
  split = judge.time_split([{"step": 4, "eval": 1.0}] + records)
  assert split["iterations"] == 4 and split["first"]["update_s"] == 20.0
  assert split["median"] == {"rollout_s": 4.0, "scoring_s": 0.5, "update_s": 2.5}
  assert split["share"]["rollout_s"] == pytest.approx(4 / 7) and split["rm_score"] == (-1.0, 4.0)


# ------------------------------------------------------------------------------------------------ tiny PPO runs
@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
  """A persistent compilation cache for this module: the command-line run loads the executables the in-process runs
  compiled (the same programs, so the same results) instead of compiling them again. The session's setting is
  restored afterwards."""
  path = tmp_path_factory.mktemp("compilation_cache")
  fields = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  before = [getattr(jax.config, f) for f in fields]
  for field, value in zip(fields, (str(path), 0)):
    jax.config.update(field, value)
  jax_cache.reset_cache()
  yield path
  for field, value in zip(fields, before):
    jax.config.update(field, value)
  jax_cache.reset_cache()


@pytest.fixture(scope="module")
def overrides(shared_data, tmp_path_factory) -> dict:
  """The tiny test run on the first 2000 lines of Tiny Shakespeare, its SentencePiece model trained once for every
  run."""
  workdir = tmp_path_factory.mktemp("data")
  text = workdir / "lines.txt"
  text.write_text("".join((shared_data / "tiny_shakespeare" / "input.txt").read_text().splitlines(True)[:2000]))
  fields = {"data.files": str(text), "ppo.prompts": str(text), "total_steps": ITERATIONS, "checkpoint_every": 4,
            "model.num_layers": 1, "ppo.ptx_coef": 0.05, "data.seq_len": 32}   # PPO-ptx: its stream resumes too
  run_tokenizer(config_lib.load("configs/rlhf/ppo.py:tiny", fields), str(workdir))
  return {**fields, "data.tokenizer": str(next(workdir.glob("tokenizer_*.model")))}


@pytest.fixture(scope="module")
def trained(overrides, compilation_cache, tmp_path_factory):
  """(Run, records, final state) of an uninterrupted tiny run."""
  config = config_lib.load("configs/rlhf/ppo.py:tiny", overrides)
  run = ppo.build(config, str(tmp_path_factory.mktemp("build")))
  workdir = tmp_path_factory.mktemp("uninterrupted")
  result = ppo.loop(run, str(workdir))
  return run, metrics_log.read(workdir / "metrics.jsonl"), result["state"]


def test_scoring_reads_each_response_where_the_model_scores_it(trained):
  """Left-padded prompts, right-padded responses: the scoring pass's log-probabilities equal those of a plain
  right-padded forward pass (causal: padding after a token cannot change it)."""
  run, _, _ = trained
  c, p = run.setup.config, run.setup.config.ppo
  prompts = [[5, 6, 7], [8] * p.prompt_len, [9, 10]] * (c.batch_size // 3) + [[4]] * (c.batch_size % 3)
  responses = [[11, 12, 13, 1], [14] * p.max_new_tokens, [15]] * (c.batch_size // 3) + [[3]] * (c.batch_size % 3)
  rows = rollout.assemble(prompts, responses, p.prompt_len, p.max_new_tokens, pad_id=0)
  rows["scores"] = np.zeros(c.batch_size, np.float32)
  params = run.initial["policy"]
  plain = np.zeros((3, p.prompt_len + p.max_new_tokens), np.int32)
  for i in range(3):
    plain[i, :len(prompts[i]) + len(responses[i])] = prompts[i] + responses[i]
  with jax.set_mesh(run.setup.mesh):
    targets, stats = jax.device_get(run.score(params, params, run.initial["value"], None, rows, np.float32(0.1)))
    logits = models.apply(c.model, params, {"input_ids": plain})["logits"]
  logp = np.asarray(jax.nn.log_softmax(logits / p.temperature))
  for i in range(3):
    start, n = len(prompts[i]), len(responses[i])
    want = logp[i, np.arange(start - 1, start - 1 + n), responses[i]]
    np.testing.assert_allclose(targets["logprobs"][i, :n], want, rtol=1e-4, atol=1e-5)
    assert not targets["logprobs"][i, n:].any() and stats["length"][i] == n
  np.testing.assert_allclose(stats["kl"], 0.0, atol=1e-6)   # policy = reference


def test_ppo_raises_the_true_reward_with_a_bounded_kl(trained):
  _, records, _ = trained
  assert [r["step"] for r in records] == list(range(1, ITERATIONS + 1))
  first, last = records[0], np.mean([r["reward"] for r in records[-3:]])
  assert last > 2 * first["reward"], [round(r["reward"], 2) for r in records]
  assert first["kl"] == pytest.approx(0.0, abs=1e-4)   # the first rollouts come from the reference itself
  assert 0 < records[-1]["kl"] < 40, [round(r["kl"], 2) for r in records]   # nats per response of 16 tokens
  for key in ("entropy", "value_loss", "clip_frac", "approx_kl", "ptx_loss", "response_length", "tokens_per_sec",
              *ppo.TIMES):
    assert all(np.isfinite(r[key]) for r in records), key


def _comparable(records):
  wall_clock = (*metrics_log.WALL_CLOCK, *ppo.TIMES)
  return [{k: v for k, v in r.items() if k not in wall_clock} for r in records]


def test_kill_and_sigterm_resume_exactly(trained, overrides, compilation_cache, tmp_path, monkeypatch):
  """kill -9 of the command line run, then SIGTERM of an in-process resume: the records and the final policy equal
  the uninterrupted run's."""
  run, expected, final = trained
  workdir = tmp_path / "interrupted"
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  with open(tmp_path / "log", "w") as log:
    proc = subprocess.Popen([sys.executable, "-m", "lm_jax.main", "--config=configs/rlhf/ppo.py:tiny", *flags,
                             f"--workdir={workdir}"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(compilation_cache),
                                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
  deadline = time.time() + 300
  while not (metrics_log.read(workdir / "metrics.jsonl") or [{"step": 0}])[-1]["step"] >= 6:
    assert proc.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
    time.sleep(0.02)
  proc.kill()   # SIGKILL: no chance to save
  proc.wait()

  iteration = ppo.iteration
  def sigterm_after_ten(*args):
    out = iteration(*args)
    if args[-1] == 10:
      os.kill(os.getpid(), signal.SIGTERM)
    return out
  monkeypatch.setattr(ppo, "iteration", sigterm_after_ten)
  assert ppo.loop(run, str(workdir))["step"] == 10
  monkeypatch.undo()
  result = ppo.loop(run, str(workdir))
  assert result["step"] == ITERATIONS
  assert _comparable(metrics_log.read(workdir / "metrics.jsonl")) == _comparable(expected)
  for x, y in zip(jax.tree.leaves(final), jax.tree.leaves(result["state"])):
    np.testing.assert_array_equal(x, y)


def test_ppo_with_qlora_trains_only_adapters_and_chains_merged(overrides, compilation_cache, tmp_path):
  """PPO on a QLoRA policy and value model: the NF4 base stays bit-identical while the adapters learn, the first
  rollouts have zero KL (scoring applies the adapters as the update does), and WORKDIR/policy, read by a next stage
  through init_from, is the merged model the rollouts sampled from. (On this random-init policy LoRA does not raise
  the reward within a few iterations as a full update does; its gradients equal the merged model's, test_lora.)"""
  from lm_jax import init_from, sharding
  from lm_jax.models import nf4
  from lm_jax.peft import lora
  fields = {**overrides, "total_steps": 8, "ppo.ptx_coef": 0.0, "lora.rank": 8, "lora.alpha": 16.0, "lora.qlora": True,
            "lora.targets": ("attention/(query|value)/", "mlp/"), "optimizer.lr": 1e-2}
  config = config_lib.load("configs/rlhf/ppo.py:tiny", fields)
  run = ppo.build(config, str(tmp_path / "build"))
  result = ppo.loop(run, str(tmp_path / "run"))
  records = metrics_log.read(tmp_path / "run" / "metrics.jsonl")
  assert records[0]["kl"] == pytest.approx(0.0, abs=1e-4) and all(np.isfinite(r["value_loss"]) for r in records)
  assert records[-1]["kl"] > 0.01, [r["kl"] for r in records]   # the policy moved away from the reference
  for name in ("policy", "value"):
    before, after = jax.device_get(run.initial[name]), jax.device_get(result["state"][name]["params"])
    base = lambda tree: jax.tree.leaves({k: v for k, v in tree.items() if k not in (lora.KEY, "classifier")})
    assert all(np.array_equal(x, y) for x, y in zip(base(before), base(after))), name
    assert not any(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[lora.KEY]),
                                                         jax.tree.leaves(after[lora.KEY]))), name
    assert isinstance(after["layers_0"]["mlp"]["wo"]["kernel"], nf4.NF4), name
  next_stage = config_lib.load("configs/rlhf/ppo.py:tiny", {**overrides, "init_from": str(tmp_path / "run" / "policy")})
  mesh = sharding.make_mesh(next_stage)
  with jax.set_mesh(mesh):
    merged = jax.device_get(init_from.pretrained_params(next_stage, mesh, sharding.RULES))
  sampled = jax.device_get(run.sampled(result["state"]["policy"]["params"]))
  assert lora.KEY not in merged
  for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(sampled)):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)

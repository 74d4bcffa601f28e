"""PPO for the GPT family (InstructGPT's third step, Ouyang et al. 2022; Ziegler et al. 2019; the formulas of TRL's
PPOTrainer, lm_jax/rlhf/ppo_math.py): train.train hands a config.objective='ppo' run to `train` here.

One iteration:
  rollout  config.batch_size prompts drawn from config.ppo.prompts (in SFT's config.rlhf.template) are continued by
           sampling from the policy at config.ppo.temperature on the KV cache (lm_jax.decoding.generate), up to
           max_new_tokens or EOS;
  scoring  ONE jitted pass over prompt + response: the policy's and the frozen reference's log-probabilities of the
           response tokens, the value model's values, the reward model's score at the last response token (or an
           exact reward of the text, config.ppo.reward_fn, computed on the host); per-token rewards
           -beta * (logp - ref_logp) with the score added at the last token; GAE advantages (whitened), returns;
  update   config.ppo.epochs passes over the rollouts in config.ppo.minibatches shuffled minibatches, each a policy
           update (clipped surrogate, plus config.ppo.ptx_coef times the LM loss on a pre-training batch: PPO-ptx)
           and a value update (clipped value loss), both lm_jax.step's jitted train step on the mesh, so
           microbatches, frozen parameters (config.finetune.freeze, policy only) and the optimizers work as in
           pre-training;
then the adaptive KL controller (config.ppo.kl_target > 0) moves beta.

Models: the policy starts from config.init_from (an SFT workdir, or config.model's seeded init) and the reference is
a frozen copy of it. The value model is a separate GPT with the 'classifier' head (num_labels = 1) read at every
response position, initialised as InstructGPT's from the reward model (config.ppo.reward_from), or with an exact
reward from the policy's initial weights and a fresh head. Separate, its regression does not pull on the policy's
features and it has its own optimizer (learning rate config.ppo.value_lr), so TRL's vf_coef, a weight between two
losses of one model, has no role. Everything runs without dropout: an iteration's first update has ratio 1.
With LoRA / QLoRA (config.lora, config.qlora) policy and value model each train their own adapters on a frozen
base; rollouts sample from the merged policy, the scoring pass applies the adapters as the updates do
(docs/lora.md).

Checkpoints (every config.checkpoint_every iterations, at the end and on SIGTERM) hold both models' train states,
the sampler key (prompts, samples and minibatch order derive from it), beta and the PPO-ptx stream's position: a
resumed run repeats the uninterrupted one. config.total_steps counts iterations; the optimizers count updates, so
their schedules (and optimizer.warmup_steps) run over total_steps * epochs * minibatches updates.
"""
import dataclasses
import math
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import checkpoint, decoding, finetune, init_from, metrics_log, models, sharding, step, train as train_lib
from lm_jax.data import instructions, pipeline
from lm_jax.objectives import clm, reward as reward_lib
from lm_jax.peft import lora
from lm_jax.rlhf import ppo_math, rewards

TIMES = ("rollout_s", "scoring_s", "update_s")   # wall-clock fields of a record, with tokens_per_sec


def assemble(prompts, responses, prompt_len: int, max_new_tokens: int, pad_id: int) -> dict:
  """Rollouts as model rows: the prompt left-padded to prompt_len, the response from column prompt_len on
  (right-padded), positions counted from each row's first token; response_mask (B, max_new_tokens) marks the
  response tokens (EOS included)."""
  b, width = len(prompts), prompt_len + max_new_tokens
  ids, attention = np.full((b, width), pad_id, np.int32), np.zeros((b, width), np.int32)
  mask = np.zeros((b, max_new_tokens), np.float32)
  for i, (prompt, response) in enumerate(zip(prompts, responses)):
    ids[i, prompt_len - len(prompt):prompt_len], ids[i, prompt_len:prompt_len + len(response)] = prompt, response
    attention[i, prompt_len - len(prompt):prompt_len + len(response)] = 1
    mask[i, :len(response)] = 1
  positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
  return dict(input_ids=ids, attention_mask=attention, positions=positions, response_mask=mask)


# ----------------------------------------------------------------------------------------------------- the models
def _inputs(batch):
  return {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}


def _apply(model_cfg, params, batch):
  return models.apply(model_cfg, params, _inputs(batch))


def _as_in_step(config, fn, params, batch):
  """fn(config, params, batch) outside the train step, LoRA adapters applied as the step applies them, so the
  scoring pass's log-probabilities are the ones the first update recomputes."""
  with lora.unmerged(config, train=False):
    return fn(config, params, batch)


def _responses(config, x):
  """Columns of a (B, prompt_len + max_new_tokens, ...) output that predict (or value) the response tokens."""
  p = config.ppo
  return x[:, p.prompt_len - 1:p.prompt_len - 1 + p.max_new_tokens]


def _policy_out(config, params, batch):
  """(log-probabilities of the response tokens (B, N), the response positions' logits / temperature (B, N, V))."""
  logits = _responses(config, _apply(config.model, params, batch)["logits"]) / config.ppo.temperature
  tokens = batch["input_ids"][:, config.ppo.prompt_len:]
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[..., None], axis=-1)[..., 0]
  return logprobs, logits


def _values(config, params, batch):
  return _responses(config, _apply(config.model, params, batch)["scores"])[..., 0]


# ---------------------------------------------------------------------------------------------- the two updates
def _policy_loss(config, params, batch, den, *, rng=None, train=False):
  """Clipped surrogate over the minibatch's response tokens, plus ptx_coef * the LM loss of its ptx rows."""
  del rng, train   # no dropout: the ratio of the first update is exactly 1
  logprobs, _ = _policy_out(config, params, batch)
  loss, metrics = ppo_math.policy_loss(logprobs, batch["logprobs"], batch["advantages"], batch["response_mask"],
                                       config.ppo.cliprange, den["tokens"])
  metrics["policy_loss"] = loss
  if config.ppo.ptx_coef:
    lm_loss, lm = clm.loss(config, params, _ptx(batch), {"tokens": den["ptx_tokens"]})
    loss = loss + config.ppo.ptx_coef * lm_loss
    metrics["ptx_loss"] = lm["token_loss"]
  return loss, dict(metrics, loss=loss)


def _ptx(batch):
  """The pre-training rows of a PPO-ptx minibatch (features ptx_*), as the clm objective reads them."""
  return {k.removeprefix("ptx_"): v for k, v in batch.items() if k.startswith("ptx_")}


def _response_tokens(batch):
  return {"tokens": jnp.maximum(jnp.sum(batch["response_mask"]), 1.0)}


def _policy_denominators(batch):
  den = _response_tokens(batch)
  if "ptx_input_ids" in batch:
    den["ptx_tokens"] = clm.denominators(_ptx(batch))["tokens"]
  return den


def _value_loss(config, params, batch, den, *, rng=None, train=False):
  del rng, train
  loss, metrics = ppo_math.value_loss(_values(config, params, batch), batch["values"], batch["returns"],
                                      batch["response_mask"], config.ppo.cliprange_value, den["tokens"])
  return loss, dict(metrics, loss=loss, value_loss=loss)


_POLICY = types.SimpleNamespace(loss=_policy_loss, denominators=_policy_denominators)
_VALUE = types.SimpleNamespace(loss=_value_loss, denominators=_response_tokens)


@dataclasses.dataclass(frozen=True)
class _Part:
  """One trained model: its config (model, optimizer, update-counting schedule) and its jitted update."""
  config: object
  tx: object
  abstract: dict
  sharding: dict
  update: object


def _part(config, mesh, rules, objective) -> _Part:
  tx, lr, abstract, shardings = step.state_layout(config, mesh, rules)
  return _Part(config, tx, abstract, shardings, step.make_train_step(config, objective, tx, lr, shardings, mesh))


def _replace(config, **fields):
  """A copy of config with top-level fields replaced."""
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.update(fields)
  return c


def _update_config(config, model, lr: float, freeze: tuple):
  """config training `model` at `lr`, its schedule counting updates (epochs * minibatches per iteration)."""
  p = config.ppo
  c = _replace(config, model=model, total_steps=config.total_steps * p.epochs * p.minibatches)
  with c.unlocked():
    c.optimizer.lr, c.finetune.freeze = lr, freeze
  return c


def _reward_model(config):
  """config.ppo.reward_from's model config (run with this run's runtime fields): a GPT with num_labels = 1."""
  p, m = config.ppo, config.model
  if not (epath.Path(p.reward_from) / "checkpoints").is_dir():
    raise FileNotFoundError(f"config.ppo.reward_from={p.reward_from!r} is not a run's workdir (no checkpoints/ in it)")
  model, _ = init_from.source_model(p.reward_from)
  if model.family != "gpt" or model.get("num_labels", 0) != 1:
    raise ValueError(f"config.ppo.reward_from={p.reward_from!r} holds a {model.family} model with num_labels="
                     f"{model.get('num_labels', 0)}; a reward model is a GPT with num_labels = 1")
  if model.vocab_size != m.vocab_size:
    raise ValueError(f"config.ppo.reward_from={p.reward_from!r} has vocab_size {model.vocab_size}, the policy "
                     f"{m.vocab_size}: train the reward model from the policy's SFT workdir")
  with model.unlocked():
    model.update({k: m[k] for k in (*checkpoint.RUNTIME_MODEL_FIELDS, "scan_layers")})
  return model


@dataclasses.dataclass(frozen=True)
class Run:
  """What a PPO run builds before its first iteration; loop() can run it several times (tests do)."""
  setup: train_lib.Setup
  workdir: str             # where build() found or trained the tokenizer
  policy: _Part
  value: _Part
  reward_model: object     # model config of config.ppo.reward_from; None with an exact reward
  reward_fn: object        # config.ppo.reward_fn's function or None
  prompts: list
  score: object            # the jitted scoring pass
  sampled: object          # policy params -> what decoding samples from (LoRA adapters merged: lora.materialize)
  initial: dict            # params: policy (= the frozen reference), value, reward_model (None with an exact reward)


def build(config, workdir: str, devices=None) -> Run:
  """Validates the config (train.setup: one-line errors), reads the prompts, lays out both models, loads or
  initialises their params and the reward model's, and jits the scoring pass and the updates."""
  s = train_lib.setup(config, workdir, devices)
  c, p = s.config, s.config.ppo
  reward_model = _reward_model(c) if p.reward_from else None
  if reward_model:
    value_model = reward_model
  else:
    value_model = ml_collections.ConfigDict(c.model.to_dict())
    with value_model.unlocked():
      value_model.num_labels = 1
  minibatch = c.batch_size // p.minibatches
  per_update = c.microbatches * math.prod(s.mesh.shape[a] for a in sharding.BATCH_AXES)
  if minibatch % per_update:
    raise ValueError(f"a minibatch of config.batch_size / config.ppo.minibatches = {minibatch} rollouts is not "
                     f"divisible by config.microbatches * mesh.data * mesh.fsdp = {per_update}")
  prompts = instructions.prompts(c, s.tokenizer)
  policy = _part(_update_config(c, c.model, c.optimizer.lr, c.finetune.freeze), s.mesh, s.rules, _POLICY)
  value_config = _update_config(c, value_model, p.value_lr or c.optimizer.lr, ())
  with value_config.unlocked():
    value_config.lora.init_from = ""   # a PEFT adapter directory is the policy's
  value = _part(value_config, s.mesh, s.rules, _VALUE)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    initial = _initial_params(s, policy, value, reward_model)
  sampled = jax.jit(lambda params: lora.materialize(c, params)) if lora.enabled(c) else lambda params: params
  return Run(s, workdir, policy, value, reward_model, rewards.get(p.reward_fn) if p.reward_fn else None, prompts,
             _scoring_pass(c, value_model, reward_model, s.mesh), sampled, initial)


def _initial_params(s: train_lib.Setup, policy: _Part, value: _Part, reward_model) -> dict:
  """The policy's params (config.init_from's where it has them, else the seeded init), the reward model's, and the
  value model's: the reward model's, or the policy's with a fresh head."""
  c = s.config
  seed = jax.random.fold_in(jax.random.key(c.seed), 0)
  fresh = lambda part: jax.jit(lambda k: lora.init_params(part.config, k),
                               out_shardings=part.sharding["params"])(seed)
  params = fresh(policy)
  if c.init_from:
    pretrained = lora.prepare(c, init_from.pretrained_params(c, s.mesh, s.rules))
    params, report = init_from.initial_params(c, params, pretrained)
    train_lib._print(report)
  reward = None
  if reward_model:
    reward = init_from.pretrained_params(_replace(c, model=reward_model, init_from=c.ppo.reward_from), s.mesh, s.rules)
  source = lora.base(c, params) if reward is None else reward
  value_params, _ = init_from.initial_params(value.config, fresh(value), lora.prepare(value.config, source))
  put = lambda tree, part: jax.device_put(tree, part.sharding["params"])
  return {"policy": put(params, policy), "value": put(value_params, value), "reward_model": reward}


# --------------------------------------------------------------------------------------------- the scoring pass
def _scoring_pass(config, value_model, reward_model, mesh):
  """Jitted (policy, reference, value, reward-model params, rollout batch, beta) -> the rollouts' update targets
  (logprobs, values, advantages, returns) and their per-sequence statistics, replicated."""
  p = config.ppo
  value_cfg = _replace(config, model=value_model)

  def score(policy, reference, value, reward, batch, kl_coef):
    mask = batch["response_mask"]
    logprobs, logits = _as_in_step(config, _policy_out, policy, batch)
    ref_logprobs, _ = _as_in_step(config, _policy_out, reference, batch)
    values = _as_in_step(value_cfg, _values, value, batch) * mask
    scores = reward_lib.sequence_rewards(reward_model, reward, _inputs(batch)) if reward_model else batch["scores"]
    token_rewards, kl = ppo_math.token_rewards(logprobs, ref_logprobs, scores, mask, kl_coef)
    advantages, returns = ppo_math.gae(token_rewards, values, mask, p.gamma, p.lam)
    targets = dict(logprobs=logprobs * mask, values=values, advantages=ppo_math.whiten(advantages, mask) * mask,
                   returns=returns)
    stats = dict(scores=scores, kl=jnp.sum(kl, axis=1), entropy=jnp.sum(ppo_math.entropy(logits) * mask, axis=1),
                 length=jnp.sum(mask, axis=1))
    return targets, stats

  return jax.jit(score, out_shardings=NamedSharding(mesh, P()))




# ------------------------------------------------------------------------------------------ state and iterations
def _layout(run: Run):
  """(abstract PPO state, its shardings): both models' train states, the sampler key, beta."""
  replicated = NamedSharding(run.setup.mesh, P())
  abstract = {"policy": run.policy.abstract, "value": run.value.abstract,
              "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
              "kl_coef": jax.ShapeDtypeStruct((), jnp.float32)}
  return abstract, {"policy": run.policy.sharding, "value": run.value.sharding, "rng": replicated,
                    "kl_coef": replicated}


def initial_state(run: Run) -> dict:
  """The PPO state before the first iteration. Its params are copies: updates donate (free) the state's buffers,
  and run.initial's policy params are the reference."""
  c = run.setup.config

  def train_state(part, params):
    params = jax.tree.map(jnp.copy, params)
    return step.init_state(params, part.tx, finetune.trainable_mask(part.config))
  state = {"policy": train_state(run.policy, run.initial["policy"]),
           "value": train_state(run.value, run.initial["value"]),
           "rng": jax.random.key_data(jax.random.fold_in(jax.random.key(c.seed), 1)),
           "kl_coef": jnp.float32(c.ppo.kl_coef)}
  return jax.device_put(state, _layout(run)[1])


def _local(rows: dict) -> dict:
  """This process's part of global rows (every process holds all rollouts)."""
  n = len(next(iter(rows.values()))) // jax.process_count()
  return {k: v[jax.process_index() * n:(jax.process_index() + 1) * n] for k, v in rows.items()}


def _mean(records: list[dict]) -> dict:
  return {k: float(np.mean([r[k] for r in records])) for k in records[0]}


def iteration(run: Run, state: dict, ptx_it, it: int) -> tuple[dict, dict]:
  """One PPO iteration (rollout, scoring, updates, beta) -> (new state, its metrics record at step `it`)."""
  c, p, tok, mesh = run.setup.config, run.setup.config.ppo, run.setup.tokenizer, run.setup.mesh
  key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
  gen = np.random.default_rng(np.asarray(jax.random.key_data(sub)))
  kl_coef, batch_sh = float(state["kl_coef"]), sharding.batch_sharding(mesh)
  start = time.perf_counter()

  chosen = gen.choice(len(run.prompts), c.batch_size, replace=len(run.prompts) < c.batch_size)
  prompts = [run.prompts[i] for i in chosen]
  responses = decoding.generate(c.model, run.sampled(state["policy"]["params"]), prompts,
                                max_new_tokens=p.max_new_tokens, method="sample", temperature=p.temperature,
                                eos_id=tok.eos_id, pad_id=tok.pad_id, seed=int(gen.integers(2**31 - 1)))
  rollout_end = time.perf_counter()

  rows = assemble(prompts, responses, p.prompt_len, p.max_new_tokens, tok.pad_id)
  if run.reward_fn:   # ids past the tokenizer's pieces (a model vocabulary larger than the tokenizer) have no text
    text = lambda ids: tok.decode([i for i in ids if i < tok.vocab_size and i != tok.eos_id])
    true_reward = np.array([run.reward_fn(text(q), text(r)) for q, r in zip(prompts, responses)], np.float32)
  if not run.reward_model:
    rows["scores"] = true_reward
  targets, stats = jax.device_get(run.score(state["policy"]["params"], run.initial["policy"],
                                            state["value"]["params"], run.initial["reward_model"],
                                            sharding.global_batch(_local(rows), batch_sh), np.float32(kl_coef)))
  scoring_end = time.perf_counter()

  rollouts = {**{k: rows[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")}, **targets}
  policy, value, metrics = state["policy"], state["value"], []
  for _ in range(p.epochs):
    for idx in np.split(gen.permutation(c.batch_size), p.minibatches):
      minibatch = sharding.global_batch(_local({k: v[idx] for k, v in rollouts.items()}), batch_sh)
      extra = {f"ptx_{k}": v for k, v in sharding.global_batch(next(ptx_it), batch_sh).items()} if ptx_it else {}
      policy, policy_metrics = run.policy.update(policy, {**minibatch, **extra})
      value, value_metrics = run.value.update(value, minibatch)
      metrics.append({**{k: policy_metrics[k] for k in ("policy_loss", "clip_frac", "approx_kl", "grad_norm", "lr")},
                      **({"ptx_loss": policy_metrics["ptx_loss"]} if ptx_it else {}),
                      "value_loss": value_metrics["value_loss"], "value_clip_frac": value_metrics["value_clip_frac"],
                      "value_grad_norm": value_metrics["grad_norm"]})
  updates = _mean(jax.device_get(metrics))
  end = time.perf_counter()

  tokens = float(np.sum(stats["length"]))
  record = dict(step=it, reward=float(np.mean(stats["scores"])),
                **({"true_reward": float(np.mean(true_reward))} if run.reward_fn and run.reward_model else {}),
                kl=float(np.mean(stats["kl"])), kl_coef=kl_coef, entropy=float(np.sum(stats["entropy"])) / tokens,
                response_length=tokens / c.batch_size, **updates, tokens_per_sec=tokens / (end - start),
                rollout_s=rollout_end - start, scoring_s=scoring_end - rollout_end, update_s=end - scoring_end)
  if p.kl_target:
    kl_coef = ppo_math.adaptive_kl_coef(kl_coef, record["kl"], p.kl_target, p.kl_horizon, c.batch_size)
  replicated = NamedSharding(mesh, P())
  state = {"policy": policy, "value": value, "rng": jax.device_put(jax.random.key_data(key), replicated),
           "kl_coef": jax.device_put(np.float32(kl_coef), replicated)}
  return state, record


def _check_finite(record: dict, mngr):
  bad = [k for k, v in record.items() if not math.isfinite(v)]
  if bad:
    checkpoint.finish(mngr)
    raise FloatingPointError(f"non-finite {', '.join(bad)} at PPO iteration {record['step']}; not saved. Last good "
                             f"checkpoint: iteration {mngr.latest_step()}")


def _ptx_iterator(run: Run):
  """The pre-training stream of PPO-ptx: a clm batch of one minibatch's size per update (None when off)."""
  c = run.setup.config
  if not c.ppo.ptx_coef:
    return None
  ptx = _replace(c, batch_size=c.batch_size // c.ppo.minibatches)
  return pipeline.make_train_iterator(ptx, run.setup.tokenizer, clm.OBJECTIVE, process_index=jax.process_index(),
                                      process_count=jax.process_count())


def _policy_workdir(run: Run, workdir: str):
  """WORKDIR/policy: the policy alone as a run's workdir (train state, config, tokenizer), saved with every
  checkpoint, so generate, eval, export and a next stage read it (--workdir or --init_from) like any other run."""
  path = epath.Path(workdir) / "policy"
  mngr = checkpoint.manager(str(path), 1)
  if jax.process_index() == 0:
    for tokenizer in epath.Path(run.workdir).glob("tokenizer_*.model"):
      tokenizer.copy(path / tokenizer.name, overwrite=True)
  return mngr


def train(config, workdir: str, *, devices=None) -> dict:
  """PPO iterations up to config.phase_end_step or total_steps, resuming the latest checkpoint in workdir ->
  {'step', 'train': the last iteration's record, 'state': the PPO state}."""
  return loop(build(config, workdir, devices), workdir)


def loop(run: Run, workdir: str) -> dict:
  """train() with the parts built: iterations from the latest checkpoint in workdir (or the start) to the end, a
  record per iteration in workdir/metrics.jsonl, checkpoints on schedule and on SIGTERM."""
  s, c = run.setup, run.setup.config
  mngr, policy_mngr = checkpoint.manager(workdir, c.keep_checkpoints), _policy_workdir(run, workdir)
  ptx_it = _ptx_iterator(run)
  end, result = c.phase_end_step or c.total_steps, {"step": 0, "train": None}
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    restored = checkpoint.restore_latest(mngr, *_layout(run), c, with_data=True)
    if restored is None:
      state = initial_state(run)
    else:
      state, result["step"] = restored.state, restored.step
      if ptx_it and restored.data_state:
        ptx_it.set_state(restored.data_state)
      train_lib._print(f"resumed iteration {restored.step} from {mngr.directory}")
    log = metrics_log.MetricsLog(workdir, result["step"])
    with checkpoint.Preemption() as preemption:
      for it in range(result["step"] + 1, end + 1):
        state, record = iteration(run, state, ptx_it, it)
        checkpoint.check_save(mngr)
        _check_finite(record, mngr)
        log.write(record)
        if it % c.log_every == 0 or it in (1, end):
          train_lib._print(metrics_log.console(record, end))
        stop = preemption.any_process()
        if it % c.checkpoint_every == 0 or it == end or stop:
          checkpoint.save(mngr, it, state, checkpoint.data_state(ptx_it) if ptx_it else {}, c)
          checkpoint.save(policy_mngr, it, state["policy"], {}, run.policy.config)
        result.update(step=it, train=record)
        if stop:
          train_lib._print(f"SIGTERM: saved iteration {it}, exiting")
          break
    for m in (mngr, policy_mngr):
      checkpoint.finish(m)
      m.close()
    log.close()
    if ptx_it:
      ptx_it.close()
  return {**result, "state": state}

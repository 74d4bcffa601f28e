"""The PPO trainer for decoder-only models (InstructGPT's third step, Ouyang et al. 2022; Ziegler et al. 2019; the
formulas of TRL's PPOTrainer, lm_jax/rlhf/ppo_math.py): main.py runs `train` for an objective that trains on its own
rollouts (config.objective='ppo', Objective.rollouts). Dependencies: main -> rlhf -> setup, loop, objectives;
nothing outside rlhf/ but main imports it.

One iteration: rollout (rollout.py: config.batch_size prompts drawn from config.ppo.prompts, read once in SFT's
config.rlhf.template by lm_jax.data.instructions.prompts, continued by sampling from the merged policy), scoring
(scoring.py: one jitted pass for the log-probabilities, values, reward and the update's targets), update (update.py:
epochs x minibatches of a policy and a value step), then the adaptive KL controller (config.ppo.kl_target > 0) moves
beta. The iterations run on the schedules every trainer shares (lm_jax.loop: log, checkpoint, SIGTERM, resume).

Models: the policy starts from config.init_from (an SFT workdir, or config.model's seeded init) and the reference is
a frozen copy of it. The value model is a separate decoder-only model with the 'classifier' head (num_labels = 1)
read at every response position, initialised as InstructGPT's from the reward model (config.ppo.reward_from), or
with an exact reward from the policy's initial weights and a fresh head. Separate, its regression does not pull on
the policy's features and it has its own optimizer (learning rate config.ppo.value_lr), so TRL's vf_coef, a weight
between two losses of one model, has no role. With LoRA / QLoRA (config.lora, config.lora.qlora) policy and value model
each train their own adapters on a frozen base; rollouts sample from the merged policy, the scoring pass applies the
adapters as the updates do (docs/lora.md).

Checkpoints (every config.checkpoint_every iterations, at the end and on SIGTERM) hold both models' train states,
the sampler key (prompts, samples and minibatch order derive from it), beta and the PPO-ptx stream's position: a
resumed run repeats the uninterrupted one. config.total_steps counts iterations; the optimizers count updates, so
their schedules (and optimizer.warmup_steps) run over total_steps * epochs * minibatches updates.
"""
import contextlib
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

from lm_jax import (checkpoint, init_from, loop as loop_lib, models, params as params_lib, setup as setup_lib,
                    sharding, step)
from lm_jax.data import instructions, pipeline, tokenizer as tokenizer_lib
from lm_jax.models import layers
from lm_jax.objectives import clm, rewards
from lm_jax.rlhf import ppo_math, rollout, scoring, update

TIMES = ("rollout_s", "scoring_s", "update_s")   # wall-clock fields of a record, with tokens_per_sec


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


def _reward_model(config, tokenizer):
  """config.ppo.reward_from's model config (run with this run's runtime fields): decoder-only, num_labels = 1, and
  the policy's `tokenizer` (the same pieces at every id, not only as many)."""
  p, m = config.ppo, config.model
  model, reward_tokenizer = init_from.source_model(p.reward_from)
  if models.family(model).layout != "decoder" or model.get("num_labels", 0) != 1:
    raise ValueError(f"config.ppo.reward_from={p.reward_from!r} holds a {model.family} model with num_labels="
                     f"{model.get('num_labels', 0)}; a reward model is decoder-only with num_labels = 1")
  if model.vocab_size != m.vocab_size:
    raise ValueError(f"config.ppo.reward_from={p.reward_from!r} has vocab_size {model.vocab_size}, the policy "
                     f"{m.vocab_size}: train the reward model from the policy's SFT workdir")
  tokenizer_lib.check_same(tokenizer, reward_tokenizer, f"config.ppo.reward_from={p.reward_from!r}", "the policy's")
  with model.unlocked():
    model.update({k: m[k] for k in (*checkpoint.RUNTIME_MODEL_FIELDS, "scan_layers")})
  return model


@dataclasses.dataclass(frozen=True)
class Run:
  """What a PPO run builds before its first iteration; loop() can run it several times (tests do)."""
  setup: setup_lib.Setup
  workdir: str             # where build() found or trained the tokenizer
  policy: update.Part
  value: update.Part
  reward_model: object     # model config of config.ppo.reward_from; None with an exact reward
  reward_fn: object        # config.ppo.reward_fn's function or None
  prompts: list
  score: object            # the jitted scoring pass
  sampled: object          # policy params -> what decoding samples from (rollout.sampler)
  initial: dict            # params: policy (= the frozen reference), value, reward_model (None with an exact reward)


def build(config, workdir: str, devices=None, *, held: contextlib.ExitStack | None = None) -> Run:
  """Validates the config (lm_jax.setup: one-line errors; with `held`, the trainer's run, it takes the workdir's
  lock), reads the prompts, lays out both models, loads or initialises their params and the reward model's, and jits
  the scoring pass and the updates."""
  reward_from = config.ppo.reward_from   # checked before the workdir and tokenizer are made
  if reward_from and not (epath.Path(reward_from) / "checkpoints").is_dir():
    raise FileNotFoundError(f"config.ppo.reward_from={reward_from!r} is not a run's workdir (no checkpoints/ in it)")
  s = setup_lib.setup(config, workdir, devices, held=held)
  c, p = s.config, s.config.ppo
  reward_model = _reward_model(c, s.tokenizer) if p.reward_from else None
  value_model = reward_model or layers.replace(c.model, num_labels=1)
  minibatch = c.batch_size // p.minibatches
  per_update = c.microbatches * math.prod(s.mesh.shape[a] for a in sharding.BATCH_AXES)
  if minibatch % per_update:
    raise ValueError(f"a minibatch of config.batch_size / config.ppo.minibatches = {minibatch} rollouts is not "
                     f"divisible by config.microbatches * mesh.data * mesh.fsdp = {per_update}")
  prompts = instructions.prompts(c, s.tokenizer)
  policy = update.part(_update_config(c, c.model, c.optimizer.lr, c.finetune.freeze), s.mesh, s.rules, update.POLICY)
  value_config = _update_config(c, value_model, p.value_lr or c.optimizer.lr, ())
  if params_lib.method(value_config):
    with value_config.unlocked():
      value_config[params_lib.method(value_config)].init_from = ""   # a PEFT adapter directory is the policy's
  value = update.part(value_config, s.mesh, s.rules, update.VALUE)
  with jax.set_mesh(s.mesh), nn.logical_axis_rules(s.rules):
    initial = _initial_params(s, policy, value, reward_model)
  return Run(s, workdir, policy, value, reward_model, rewards.get(p.reward_fn) if p.reward_fn else None, prompts,
             scoring.scoring_pass(s.policy, value.policy, reward_model, s.mesh), rollout.sampler(s.policy), initial)


def _initial_params(s: setup_lib.Setup, policy: update.Part, value: update.Part, reward_model) -> dict:
  """The policy's params (config.init_from's where it has them, else the seeded init), the reward model's, and the
  value model's: the reward model's, or the policy's with a fresh head."""
  c = s.config
  seed = jax.random.fold_in(jax.random.key(c.seed), 0)
  fresh = lambda part: jax.jit(lambda k: params_lib.init(part.policy, k),
                               out_shardings=part.sharding["params"])(seed)
  params = fresh(policy)
  if c.init_from:
    params, report = init_from.start_params(c, params, s.mesh, s.rules, policy.sharding["params"])
    loop_lib.say(report)
  reward = None
  if reward_model:
    reward = init_from.pretrained_params(_replace(c, model=reward_model, init_from=c.ppo.reward_from), s.mesh, s.rules)
  source = params_lib.base(s.policy, params) if reward is None else reward
  pretrained = params_lib.from_pretrained(value.policy, source)
  value_params, _ = init_from.initial_params(value.config, fresh(value), pretrained)
  put = lambda tree, part: jax.device_put(tree, part.sharding["params"])
  return {"policy": put(params, policy), "value": put(value_params, value), "reward_model": reward}


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
    return step.init_state(params, part.tx, part.policy.trainable)
  state = {"policy": train_state(run.policy, run.initial["policy"]),
           "value": train_state(run.value, run.initial["value"]),
           "rng": jax.random.key_data(jax.random.fold_in(jax.random.key(c.seed), 1)),
           "kl_coef": jnp.float32(c.ppo.kl_coef)}
  return jax.device_put(state, _layout(run)[1])


def iteration(run: Run, state: dict, ptx_it, it: int) -> tuple[dict, dict]:
  """PPO iteration `it` (rollout, scoring, updates, beta) -> (new state, its metrics record)."""
  c, tok, batch_sh = run.setup.config, run.setup.tokenizer, sharding.batch_sharding(run.setup.mesh)
  key, sub = jax.random.split(jax.random.wrap_key_data(state["rng"]))
  gen = np.random.default_rng(np.asarray(jax.random.key_data(sub)))
  kl_coef = float(state["kl_coef"])
  start = time.perf_counter()
  prompts, responses = rollout.sample(c, tok, run.sampled(state["policy"]["params"]), run.prompts, gen)
  rollout_end = time.perf_counter()

  rows = rollout.assemble(prompts, responses, c.ppo.prompt_len, c.ppo.max_new_tokens, tok.pad_id)
  true_reward = scoring.exact_rewards(tok, run.reward_fn, prompts, responses) if run.reward_fn else None
  if not run.reward_model:
    rows["scores"] = true_reward
  targets, stats = jax.device_get(run.score(state["policy"]["params"], run.initial["policy"],
                                            state["value"]["params"], run.initial["reward_model"],
                                            sharding.global_batch(rollout.local(rows), batch_sh), np.float32(kl_coef)))
  scoring_end = time.perf_counter()

  rollouts = {**{k: rows[k] for k in ("input_ids", "attention_mask", "positions", "response_mask")}, **targets}
  policy, value, updates = update.epochs(run.policy, run.value, (state["policy"], state["value"]), rollouts, gen,
                                         ptx_it, batch_sh)
  end = time.perf_counter()

  tokens = float(np.sum(stats["length"]))
  record = dict(reward=float(np.mean(stats["scores"])),
                **({"true_reward": float(np.mean(true_reward))} if run.reward_fn and run.reward_model else {}),
                kl=float(np.mean(stats["kl"])), kl_coef=kl_coef, entropy=float(np.sum(stats["entropy"])) / tokens,
                response_length=tokens / c.batch_size, **updates, tokens_per_sec=tokens / (end - start),
                rollout_s=rollout_end - start, scoring_s=scoring_end - rollout_end, update_s=end - scoring_end)
  if c.ppo.kl_target:
    kl_coef = ppo_math.adaptive_kl_coef(kl_coef, record["kl"], c.ppo.kl_target, c.ppo.kl_horizon, c.batch_size)
  replicated = NamedSharding(run.setup.mesh, P())
  state = {"policy": policy, "value": value, "rng": jax.device_put(jax.random.key_data(key), replicated),
           "kl_coef": jax.device_put(np.float32(kl_coef), replicated)}
  return state, record


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
  checkpoint.copy_tokenizers(run.workdir, path)
  return mngr


def train(config, workdir: str, *, devices=None) -> dict:
  """PPO iterations up to config.phase_end_step or total_steps, resuming the latest checkpoint in workdir ->
  {'step', 'train': the last iteration's record, 'state': the PPO state}. One run per workdir (lm_jax.setup)."""
  with contextlib.ExitStack() as held:
    return loop(build(config, workdir, devices, held=held), workdir)


def loop(run: Run, workdir: str) -> dict:
  """train() with the parts built: iterations from the latest checkpoint in workdir (or the start) to the end on
  lm_jax.loop's schedules: a record every config.log_every iterations in workdir/metrics.jsonl, checkpoints (the PPO
  state, and the policy in WORKDIR/policy) on schedule and on SIGTERM. The goodput line counts from here (build()'s
  time is not in it)."""
  c = run.setup.config
  with loop_lib.session(workdir, run.setup) as session:
    mngr, ledger = session.mngr, session.ledger
    policy_mngr = session.adopt(_policy_workdir(run, workdir))
    ptx_it = session.closes(_ptx_iterator(run))
    data_state = lambda: checkpoint.data_state(ptx_it) if ptx_it else {}

    def save(it, state):
      checkpoint.save(mngr, it, state, data_state(), c)
      checkpoint.save(policy_mngr, it, state["policy"], {}, run.policy.config)
    with ledger.timing("restore"):
      restored = checkpoint.restore_latest(mngr, *_layout(run), c, with_data=True)
      if restored is None:
        state, start = initial_state(run), 0
      else:
        state, start = restored.state, loop_lib.resume(restored, mngr.directory, ptx_it, "iteration")
    schedules = loop_lib.Schedules(c, mngr, session.open_log(start), record=lambda window, seconds: window[-1],
                                   save=save, ledger=ledger, data_state=data_state, unit="iteration")
    state, result = loop_lib.run(schedules, lambda state, it: iteration(run, state, ptx_it, it), state, start,
                                 c.phase_end_step or c.total_steps)
  return {**result, "state": state}

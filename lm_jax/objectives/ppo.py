"""PPO from a reward (InstructGPT's third step, Ouyang et al. 2022): the config checks of an objective that trains
on its own rollouts (rollouts=True), so its trainer is lm_jax.rlhf.ppo.train (main.py runs it), which builds on
this registry and lm_jax.train; nothing here imports lm_jax.rlhf. Its data fields are the causal LM's: the
pre-training stream of PPO-ptx (config.ppo.ptx_coef > 0) read from config.data like a clm run."""
from lm_jax.config_lib import require
from lm_jax.data import instructions
from lm_jax.objectives import clm, rewards
from lm_jax.objectives.registry import Lengths, Objective, no_transform


def check(config):
  p = config.get("ppo")
  require(p is not None, "config.objective='ppo' needs the config.ppo group (see configs/rlhf/ppo.py)")
  require(bool(p.reward_from) or bool(p.reward_fn), "config.objective='ppo' needs config.ppo.reward_from (a reward "
           f"model's workdir) or config.ppo.reward_fn (one of {', '.join(sorted(rewards.REWARD_FNS))})")
  if p.reward_fn:
    rewards.get(p.reward_fn)
  instructions.check_template(config)   # prompts are formatted as SFT's (lm_jax.data.instructions.prompts)
  require(bool(p.prompts), "config.ppo.prompts must name the prompt files (.txt: a prompt per line; .jsonl: "
           "config.ppo.prompt_field)")
  require(p.prompt_len >= 1 and p.max_new_tokens >= 1,
           f"config.ppo.prompt_len and max_new_tokens must be >= 1, got {p.prompt_len} and {p.max_new_tokens}")
  m = config.model
  require(p.prompt_len + p.max_new_tokens <= m.max_positions, f"config.ppo.prompt_len + max_new_tokens = "
           f"{p.prompt_len + p.max_new_tokens} exceeds config.model.max_positions={m.max_positions}")
  for name, ok, rule in (("temperature", p.temperature > 0, "> 0"), ("kl_coef", p.kl_coef >= 0, ">= 0"),
                         ("kl_target", p.kl_target >= 0, ">= 0 (0 = fixed kl_coef)"),
                         ("kl_horizon", p.kl_horizon > 0, "> 0"), ("gamma", 0 <= p.gamma <= 1, "in [0, 1]"),
                         ("lam", 0 <= p.lam <= 1, "in [0, 1]"), ("epochs", p.epochs >= 1, ">= 1"),
                         ("cliprange", p.cliprange > 0, "> 0"), ("cliprange_value", p.cliprange_value > 0, "> 0"),
                         ("value_lr", p.value_lr >= 0, ">= 0 (0 = optimizer.lr)"),
                         ("ptx_coef", p.ptx_coef >= 0, ">= 0")):
    require(ok, f"config.ppo.{name} must be {rule}, got {p[name]!r}")
  require(p.minibatches >= 1 and config.batch_size % p.minibatches == 0,
           f"config.ppo.minibatches={p.minibatches} must be >= 1 and divide config.batch_size={config.batch_size}")


def lengths(config):
  """A rollout: prompt and response read by the scoring pass; the response's positions are scored."""
  p = config.ppo
  return Lengths(inputs=p.prompt_len + p.max_new_tokens, targets=0, scored=p.max_new_tokens)


OBJECTIVE = Objective(name="ppo", layouts=("decoder",), check=check, lengths=lengths, rows=clm.row_layout,
                      transform=no_transform, features=clm.features, denominators=clm.denominators, loss=clm.loss,
                      rollouts=True)

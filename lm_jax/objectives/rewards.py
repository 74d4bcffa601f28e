"""Exact reward functions (config.ppo.reward_fn): toys whose true reward is known, so a test can tell whether PPO
optimises what it is asked to. Each maps (prompt text, response text) to a float."""
from lm_jax.data import toy_tasks

REWARD_FNS = {
    "count_e": lambda prompt, response: float(response.count("e")),   # the letters 'e' in the response
    # the preference toy's (lm_jax/data/toy_tasks.py): symbols toy_tasks.TARGET among the response's symbols
    "toy_preference": lambda prompt, response: toy_tasks.true_reward(response),
}


def get(name: str):
  if name not in REWARD_FNS:
    raise ValueError(f"config.ppo.reward_fn={name!r} is unknown; known: {', '.join(sorted(REWARD_FNS))}")
  return REWARD_FNS[name]

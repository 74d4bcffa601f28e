"""Reinforcement learning from a reward: PPO, a trainer of its own (ppo.py) on lm_jax.loop's schedules, with an
iteration's parts in rollout.py, scoring.py and update.py, its arithmetic in ppo_math.py; the exact toy rewards are
lm_jax/objectives/rewards.py. Only main.py imports rlhf; rlhf imports train, loop and objectives. See docs/ppo.md."""

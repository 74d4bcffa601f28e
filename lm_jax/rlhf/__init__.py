"""Reinforcement learning from a reward: PPO (ppo.py, its arithmetic in ppo_math.py, exact toy rewards in
lm_jax/objectives/rewards.py). See docs/ppo.md."""

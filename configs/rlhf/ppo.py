"""PPO from a reward (InstructGPT, Ouyang et al. 2022 §3.5; Ziegler et al. 2019): lm_jax/rlhf/ppo.py, docs/ppo.md.

Variants:
  ppo   the policy and the reference from an SFT workdir (--config.init_from=SFT_WORKDIR), the reward model and the
        value model's init from a reward-model workdir (--config.ppo.reward_from=RM_WORKDIR), prompts from
        --config.ppo.prompts; TRL's PPOTrainer defaults where the papers give none (InstructGPT's model is 1.3B-175B).
  tiny  a CPU run with no other workdir: a 2-layer policy from its seeded init on Tiny Shakespeare lines as prompts,
        rewarded exactly by the number of letters 'e' in the response (config.ppo.reward_fn='count_e').
  sst2  the docs/rlhf.md demonstration: the tiny SST-2 SFT policy (configs/rlhf/sft.py:sst2, --config.init_from)
        continues the first words of SST-2 train sentences against the SST-2 reward model
        (configs/rlhf/reward.py:sst2, --config.ppo.reward_from); a CPU run of a few minutes.
"""
import os

import ml_collections

from lm_jax import defaults

VARIANTS = ("ppo", "tiny", "sst2")


def get_config(arg="ppo"):
  if arg not in VARIANTS:
    raise ValueError(f"configs/rlhf/ppo.py: unknown variant {arg!r}; use {', '.join(VARIANTS)}")
  c = defaults.base_config()
  c.objective = "ppo"
  m = c.model = defaults.gpt1_model()   # init_from's architecture wins
  m.dropout_rate = m.attention_dropout_rate = 0.0

  p = c.ppo = ml_collections.ConfigDict()
  p.prompts = ""             # glob: .txt (a prompt per non-empty line) or .jsonl (field prompt_field)
  p.prompt_field = "prompt"
  p.prompt_len = 64          # prompts keep their last prompt_len tokens
  p.max_new_tokens = 64      # response length limit (EOS ends a response earlier)
  p.temperature = 1.0        # sampling temperature, also applied to the log-probabilities (as TRL)
  p.reward_from = ""         # a reward model's workdir (GPT, model.num_labels = 1)
  p.reward_fn = ""           # or an exact reward (lm_jax/objectives/rewards.py); with reward_from: logged as true_reward
  p.kl_coef = 0.05           # beta of the per-token KL penalty (TRL's default)
  p.kl_target = 0.0          # > 0: Ziegler et al.'s adaptive controller steers the summed KL per response to it
  p.kl_horizon = 10000.0     # the controller's horizon in rollouts (Ziegler et al.)
  p.gamma = 1.0
  p.lam = 0.95               # GAE lambda
  p.epochs = 4               # PPO epochs over each batch of rollouts
  p.minibatches = 4          # minibatches per epoch (config.batch_size rollouts in all)
  p.cliprange = 0.2
  p.cliprange_value = 0.2
  p.value_lr = 0.0           # the value model's learning rate; 0 = optimizer.lr
  p.ptx_coef = 0.0           # PPO-ptx: weight of the LM loss on config.data's text (InstructGPT's gamma)

  c.optimizer.name = "adamw"
  c.optimizer.lr = 3e-6      # TRL's PPOConfig default
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-8
  c.optimizer.schedule = "linear"
  c.optimizer.warmup_steps = 0
  c.optimizer.clip_norm = 1.0
  c.batch_size = 64          # rollouts per iteration
  c.total_steps = 256        # PPO iterations
  c.log_every, c.checkpoint_every = 1, 10

  if arg == "sst2":
    defaults.tiny(c)
    m.max_positions, c.data.seq_len = 64, 64
    c.data.tfds_name, c.data.files, c.data.text_field = "", "rlhf_data/sst2_sft_{split}.jsonl", "text"
    p.prompts, p.prompt_len, p.max_new_tokens = "rlhf_data/sst2_sft_train.jsonl", 8, 24
    c.optimizer.lr, c.optimizer.warmup_steps = 1e-4, 0
    c.batch_size, c.total_steps = 64, 40
    c.log_every, c.eval_every, c.checkpoint_every = 1, 0, 10
  if arg == "tiny":
    defaults.tiny(c)
    text = os.path.join(os.environ.get("LM_JAX_DATA", "data"), "tiny_shakespeare", "input.txt")
    c.data.tfds_name, c.data.files = "", text
    m.max_positions, m.vocab_size = 64, 256
    m.num_layers, m.d_model, m.num_heads, m.d_ff = 2, 64, 2, 256
    c.data.seq_len = 64
    p.prompts, p.prompt_len, p.max_new_tokens = text, 8, 16
    p.reward_fn = "count_e"
    p.minibatches = 2
    c.optimizer.lr, c.optimizer.warmup_steps = 3e-3, 0
    c.batch_size, c.total_steps = 32, 20
    c.log_every, c.eval_every, c.checkpoint_every = 1, 0, 10
  return c

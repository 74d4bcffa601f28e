"""PPO's rollouts: config.batch_size prompts drawn from the run's prompts, continued by sampling from the policy at
config.ppo.temperature on the KV cache (lm_jax.decoding.generate) up to max_new_tokens or EOS, and laid out as the
model rows the scoring pass and the updates read. Sampling reads plain params: the policy's LoRA / QLoRA adapters
merged in (sampler). Every process holds all rollouts and feeds its part of them (local).

The PPO trainer (ppo.py) calls it; it builds on decoding and the params policy only.
"""
import jax
import numpy as np

from lm_jax import decoding, params as params_lib


def sampler(run):
  """policy params -> what decoding samples from: the params, with adapters merged (jitted, params.for_inference);
  run: the policy model's params.Policy."""
  return jax.jit(lambda p: params_lib.for_inference(run, p)) if run.method else lambda p: p


def sample(config, tokenizer, params, prompts: list, gen: np.random.Generator) -> tuple[list, list]:
  """(the prompts drawn, their responses): config.batch_size of `prompts` (with replacement only when there are
  fewer), each continued by sampling from params (plain: sampler's) with a seed drawn from gen."""
  p = config.ppo
  chosen = gen.choice(len(prompts), config.batch_size, replace=len(prompts) < config.batch_size)
  drawn = [prompts[i] for i in chosen]
  responses = decoding.generate(config.model, params, drawn, max_new_tokens=p.max_new_tokens, method="sample",
                                temperature=p.temperature, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                seed=int(gen.integers(2**31 - 1)))
  return drawn, responses


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


def local(rows: dict) -> dict:
  """This process's part of global rows (every process holds all rollouts)."""
  n = len(next(iter(rows.values()))) // jax.process_count()
  return {k: v[jax.process_index() * n:(jax.process_index() + 1) * n] for k, v in rows.items()}

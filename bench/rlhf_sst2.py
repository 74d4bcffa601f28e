"""The SST-2 RLHF demonstration's judge (docs/rlhf.md, "SST-2 demonstration"): SFT, PPO and DPO policies continue
the same held-out prompts and a sentiment classifier that no stage trained on judges the samples.

  python bench/rlhf_sst2.py --sft=/tmp/sst2/sft --ppo=/tmp/sst2/ppo --dpo=/tmp/sst2/dpo --judge=/tmp/sst2/judge

Prompts: the first --n records of --prompts (SST-2 dev sentences cut after their first word), formatted and cut as
the PPO run formats its own (lm_jax.data.instructions.prompts with the PPO run's saved config: config.rlhf.template,
ppo.prompt_len). Every policy samples one response per prompt with lm_jax.decoding.generate at temperature 1 with
the same seed, up to the PPO run's ppo.max_new_tokens (EOS ends one earlier). Per policy:
  rm score   the reward model PPO optimised (the PPO run's ppo.reward_from): the proxy reward
  P(pos)     the judge's probability of SST-2 label 1 (positive) for prompt + response: the "true" reward; the
             judge is a transformers BertForSequenceClassification directory (--mode=export of
             configs/finetune/bert.py:minilm_sst2), which PPO never sees
  pos rate   how often P(pos) > 0.5
  KL         sum over the response's tokens of log pi - log pi_sft (lm_jax.decoding.score of both on the samples),
             averaged: a Monte-Carlo estimate of KL(pi || pi_sft) per response
  length     response tokens, EOS included (as PPO's response_length)
Means carry their standard error. Then 3 samples per policy and PPO's per-iteration time split from its
metrics.jsonl (rollout_s / scoring_s / update_s).
"""
import argparse
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

POLICIES = ("SFT", "PPO", "DPO")   # labels (not objective names: tests/test_objective_api.py)


# ---------------------------------------------------------------------------------------------- the summaries
def summarise(samples: dict) -> dict:
  """Per policy {rm, p_pos, pos_rate, kl, length: (mean, standard error)} of its per-sample arrays (rm, p_pos, kl,
  length)."""
  out = {}
  for name, s in samples.items():
    p = np.asarray(s["p_pos"], np.float64)
    cols = {"rm": s["rm"], "p_pos": p, "pos_rate": (p > 0.5).astype(np.float64), "kl": s["kl"], "length": s["length"]}
    out[name] = {k: (float(np.mean(v)), float(np.std(v, ddof=1) / np.sqrt(len(v)))) for k, v in cols.items()}
  return out


def table(summary: dict) -> str:
  """A markdown table of summarise()'s output, a row per policy."""
  lines = ["| policy | rm score (proxy) | judge P(pos) | judge pos rate | KL to SFT (nats) | length (tokens) |",
           "|---|---|---|---|---|---|"]
  for name, s in summary.items():
    cell = lambda k, f: f"{s[k][0]:{f}} ± {s[k][1]:{f}}"
    lines.append(f"| {name} | {cell('rm', '.2f')} | {cell('p_pos', '.3f')} | {cell('pos_rate', '.3f')} | "
                 f"{cell('kl', '.1f')} | {cell('length', '.1f')} |")
  return "\n".join(lines)


def time_split(records: list[dict]) -> dict:
  """PPO's per-iteration wall-clock split from its metrics.jsonl records: the first iteration (it compiles) apart,
  then the medians of the others and each part's share of their sum."""
  from lm_jax.rlhf import ppo
  keys = ppo.TIMES
  it = [r for r in records if keys[0] in r]
  if not it:
    raise ValueError(f"no PPO iteration records ({', '.join(keys)}) in the metrics")
  rest = it[1:] or it
  median = {k: float(np.median([r[k] for r in rest])) for k in keys}
  total = sum(median.values())
  return {"iterations": len(it), "first": {k: it[0][k] for k in keys}, "median": median,
          "share": {k: v / total for k, v in median.items()},
          "tokens_per_sec": float(np.median([r["tokens_per_sec"] for r in rest])),
          "rm_score": (it[0]["reward"], it[-1]["reward"]), "kl": (it[0]["kl"], it[-1]["kl"])}


def time_split_text(t: dict) -> str:
  m, s, f = t["median"], t["share"], t["first"]
  return (f"PPO, {t['iterations']} iterations: median per iteration rollout {m['rollout_s']:.2f} s "
          f"({s['rollout_s']:.0%}), scoring {m['scoring_s']:.2f} s ({s['scoring_s']:.0%}), update {m['update_s']:.2f} s "
          f"({s['update_s']:.0%}), {t['tokens_per_sec']:.0f} response tokens/s; the first iteration (compiling): "
          f"{f['rollout_s']:.1f} / {f['scoring_s']:.1f} / {f['update_s']:.1f} s. Reward-model score "
          f"{t['rm_score'][0]:.2f} -> {t['rm_score'][1]:.2f}, KL {t['kl'][0]:.1f} -> {t['kl'][1]:.1f} nats per response.")


# ---------------------------------------------------------------------------------------------- the models
def _policy_params(config, path: str, mesh, rules):
  """The policy params of a run's workdir (SFT, DPO without its frozen reference, PPO's WORKDIR/policy)."""
  from lm_jax import init_from, models
  model, _ = init_from.source_model(path)
  if model.vocab_size != config.model.vocab_size:
    raise ValueError(f"{path}: vocab_size {model.vocab_size}, the PPO policy {config.model.vocab_size}: every "
                     "policy must come from the same SFT run")
  c = config.copy_and_resolve_references()
  with c.unlocked():
    c.init_from = path
  params = init_from.pretrained_params(c, mesh, rules)
  return {k: v for k, v in params.items() if k != models.REFERENCE}


def _judge(path: str, texts: list[str], batch_size: int = 64) -> np.ndarray:
  """P(label 1 = positive) of each text under the exported classifier in `path` (transformers, PyTorch)."""
  import torch
  import transformers
  tok = transformers.AutoTokenizer.from_pretrained(path)
  model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
  out = []
  with torch.no_grad():
    for i in range(0, len(texts), batch_size):
      enc = tok(texts[i:i + batch_size], padding=True, truncation=True, max_length=128, return_tensors="pt")
      out.append(torch.softmax(model(**enc).logits, dim=-1)[:, 1].numpy())
  return np.concatenate(out)


def measure(args) -> tuple[dict, dict]:
  """(per policy: its samples' arrays and texts, PPO's time split)."""
  import jax
  import ml_collections
  from flax import linen as nn
  from lm_jax import decoding, init_from, models, sharding
  from lm_jax.data import instructions, tokenizer as tokenizer_lib
  from lm_jax.objectives import reward as reward_lib
  from lm_jax.obs import metrics_log
  from lm_jax.rlhf import rollout

  config = ml_collections.ConfigDict(init_from.saved_config(args.ppo))   # the PPO run's resolved config
  with config.unlocked():
    config.ppo.prompts = args.prompts
  p, m = config.ppo, config.model
  tok = tokenizer_lib.load(config.data.tokenizer, models.family(m))
  mesh, rules = sharding.make_mesh(config), sharding.rules(config)
  prompts = instructions.prompts(config, tok)[:args.n]
  decode = lambda ids: tok.decode([i for i in ids if i < tok.vocab_size and i != tok.eos_id])
  out = {}
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    paths = dict(zip(POLICIES, (args.sft, os.path.join(args.ppo, "policy"), args.dpo)))
    params = {name: _policy_params(config, paths[name], mesh, rules) for name in POLICIES if paths[name]}
    reward_model, _ = init_from.source_model(args.reward or p.reward_from)
    rm = config.copy_and_resolve_references()
    with rm.unlocked():
      rm.model, rm.init_from = reward_model, args.reward or p.reward_from
    rm_params = init_from.pretrained_params(rm, mesh, rules)
    score_rm = jax.jit(lambda params, batch: reward_lib.sequence_rewards(reward_model, params, batch))
    for name, policy in params.items():
      responses = decoding.generate(m, policy, prompts, max_new_tokens=p.max_new_tokens, method="sample",
                                    temperature=1.0, eos_id=tok.eos_id, pad_id=tok.pad_id, seed=args.seed)
      logp, _ = decoding.score(m, policy, prompts, responses, batch_size=64)
      ref, _ = decoding.score(m, params["SFT"], prompts, responses, batch_size=64)
      rows = rollout.assemble(prompts, responses, p.prompt_len, p.max_new_tokens, tok.pad_id)
      rewards = score_rm(rm_params, {k: rows[k] for k in ("input_ids", "attention_mask", "positions")})
      texts = [f"{decode(q)} {decode(r)}".strip() for q, r in zip(prompts, responses)]
      out[name] = dict(rm=np.asarray(jax.device_get(rewards), np.float64), kl=np.asarray(logp - ref, np.float64),
                       length=np.array([len(r) for r in responses], np.float64), texts=texts)
  p_pos = _judge(args.judge, [t for s in out.values() for t in s["texts"]])   # torch, after JAX is done
  for i, s in enumerate(out.values()):
    s["p_pos"] = p_pos[i * len(prompts):(i + 1) * len(prompts)]
  return out, time_split(metrics_log.read(os.path.join(args.ppo, "metrics.jsonl")))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sft", required=True, help="the SFT workdir (the KL reference)")
  parser.add_argument("--ppo", required=True, help="the PPO workdir (its policy/, config and metrics.jsonl)")
  parser.add_argument("--dpo", default="", help="the DPO workdir ('' = none)")
  parser.add_argument("--judge", required=True, help="an exported SST-2 classifier (BertForSequenceClassification)")
  parser.add_argument("--reward", default="", help="the reward model's workdir ('' = the PPO run's ppo.reward_from)")
  parser.add_argument("--prompts", default="rlhf_data/sst2_sft_dev.jsonl", help="held-out prompts (.jsonl / .txt)")
  parser.add_argument("--n", type=int, default=512, help="prompts (the first n), one sample per policy each")
  parser.add_argument("--seed", type=int, default=0, help="the sampling seed, the same for every policy")
  parser.add_argument("--samples", type=int, default=3, help="samples printed per policy")
  parser.add_argument("--json", default="", help="also write the summary, the time split and every sample here")
  args = parser.parse_args()
  from lm_jax import malloc
  malloc.keep_freed_memory()
  samples, split = measure(args)
  summary = summarise(samples)
  print(table(summary) + "\n")
  for name, s in samples.items():
    print(f"{name}:\n" + "\n".join(f"  {t}" for t in s["texts"][:args.samples]))
  print("\n" + time_split_text(split))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"summary": summary, "time_split": split, "args": vars(args),
                 "samples": {k: {f: np.asarray(v).tolist() if f != "texts" else v for f, v in s.items()}
                             for k, s in samples.items()}}, f, indent=1)


if __name__ == "__main__":
  main()

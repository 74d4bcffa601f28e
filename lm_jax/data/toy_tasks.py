"""Instruction and preference data whose quality is known exactly, for tests and demonstrations of the RLHF
stages (docs/rlhf.md), in the JSONL formats of lm_jax/data/instructions.py.

- Instructions: copy / reverse a string of letters, or add two numbers, written as space-separated symbols so a
  tokenizer gives one token per symbol: {"prompt": "reverse : b a c", "response": "c a b"}.
- Preferences: {"prompt": "write : d e", "chosen": "a f a c", "rejected": "b a c e"}: two random strings of the
  same length, the chosen one with more occurrences of TARGET ('a'); true_reward(response) counts them, so a
  PPO run can score its samples exactly.
- SST-2 (sst2_records): sentences cut after their first word(s); SFT continues the prompt, and preference pairs
  share a prompt with a positive sentence chosen over a negative one.
Every record also has a "text" field (all its texts joined) to train a tokenizer from scratch on the same files
(data.files = the files, data.text_field = "text").

python -m lm_jax.data.toy_tasks --out=DIR [--sst2=DIR_OF_SST2_TSV] writes them.
"""
import json
import os

import numpy as np

LETTERS = "abcdef"
TARGET = "a"
TASKS = ("copy", "reverse", "add")


def true_reward(text: str, target: str = TARGET) -> float:
  """The exact reward of a response of the preference toy: how many of its space-separated symbols are target."""
  return float(text.split().count(target))


def _spaced(symbols) -> str:
  return " ".join(symbols)


def _instruction(task: str, rng, length) -> dict:
  if task == "add":
    a, b = (int(rng.integers(0, 100)) for _ in range(2))
    return dict(prompt=f"add : {_spaced(str(a))} + {_spaced(str(b))}", response=_spaced(str(a + b)))
  word = [LETTERS[i] for i in rng.integers(0, len(LETTERS), int(rng.integers(length[0], length[1] + 1)))]
  return dict(prompt=f"{task} : {_spaced(word)}", response=_spaced(word if task == "copy" else word[::-1]))


def _with_text(record: dict) -> dict:
  return {**record, "text": " ".join(record.values())}


def instruction_records(n: int, *, tasks=TASKS, length=(3, 6), seed: int = 0, exclude=()) -> list[dict]:
  """n distinct {prompt, response, text} records of `tasks` (copy / reverse: strings of `length` letters, a range;
  add: numbers below 100), none with a prompt in `exclude`."""
  unknown = set(tasks) - set(TASKS)
  if unknown:
    raise ValueError(f"unknown toy tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
  rng, seen, out = np.random.default_rng(seed), set(exclude), []
  for _ in range(100 * n):
    record = _instruction(tasks[int(rng.integers(0, len(tasks)))], rng, length)
    if record["prompt"] not in seen:
      seen.add(record["prompt"])
      out.append(_with_text(record))
      if len(out) == n:
        return out
  raise ValueError(f"the toy tasks {tasks} have fewer than {n} distinct new prompts")


def preference_records(n: int, *, seed: int = 0, length=(4, 8), target: str = TARGET) -> list[dict]:
  """n {prompt, chosen, rejected, text} records; true_reward(chosen) > true_reward(rejected) in each."""
  rng, out = np.random.default_rng(seed), []
  while len(out) < n:
    prompt = f"write : {_spaced(LETTERS[i] for i in rng.integers(0, len(LETTERS), 2))}"
    size = int(rng.integers(length[0], length[1] + 1))
    a, b = ([LETTERS[i] for i in rng.integers(0, len(LETTERS), size)] for _ in range(2))
    if a.count(target) == b.count(target):
      continue
    chosen, rejected = (a, b) if a.count(target) > b.count(target) else (b, a)
    out.append(_with_text(dict(prompt=prompt, chosen=_spaced(chosen), rejected=_spaced(rejected))))
  return out


def sst2_records(tsv: str, *, prompt_words: int = 1, seed: int = 0) -> tuple[list[dict], list[dict]]:
  """(SFT records, preference records) of an SST-2 file (sentence<TAB>label 0/1): the prompt is a sentence's first
  prompt_words words and the response the rest; a pair joins a positive and a negative sentence with the same
  prompt (each sentence in at most one pair), the positive one chosen."""
  sft, groups = [], {}
  with open(tsv, encoding="utf-8") as f:
    for line in f:
      sentence, _, label = line.rstrip("\n").rpartition("\t")
      words = sentence.split()
      if len(words) <= prompt_words or label not in ("0", "1"):
        continue
      prompt, response = " ".join(words[:prompt_words]), " ".join(words[prompt_words:])
      sft.append(_with_text(dict(prompt=prompt, response=response)))
      groups.setdefault(prompt, ([], []))[int(label)].append(response)
  rng, pairs = np.random.default_rng(seed), []
  for prompt, (negative, positive) in groups.items():
    for good, bad in zip(rng.permutation(positive), rng.permutation(negative)):
      pairs.append(_with_text(dict(prompt=prompt, chosen=str(good), rejected=str(bad))))
  return sft, [pairs[i] for i in rng.permutation(len(pairs))]


def write_jsonl(path: str, records: list[dict]) -> str:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write("".join(json.dumps(r) + "\n" for r in records))
  return path


def write_toy(out: str, *, train: int = 4000, dev: int = 200, tasks=TASKS, length=(3, 6), seed: int = 0) -> dict:
  """instructions_{train,dev}.jsonl (dev prompts unseen in train) and preferences_{train,dev}.jsonl in `out`;
  returns their {split} globs {'instruction': ..., 'preference': ...}."""
  held_out = instruction_records(dev, tasks=tasks, length=length, seed=seed + 1)
  write_jsonl(os.path.join(out, "instructions_dev.jsonl"), held_out)
  write_jsonl(os.path.join(out, "instructions_train.jsonl"),
              instruction_records(train, tasks=tasks, length=length, seed=seed,
                                  exclude={r["prompt"] for r in held_out}))
  write_jsonl(os.path.join(out, "preferences_train.jsonl"), preference_records(train, seed=seed))
  write_jsonl(os.path.join(out, "preferences_dev.jsonl"), preference_records(dev, seed=seed + 1))
  return {"instruction": os.path.join(out, "instructions_{split}.jsonl"),
          "preference": os.path.join(out, "preferences_{split}.jsonl")}


def write_sst2(sst2_dir: str, out: str, *, prompt_words: int = 1) -> dict:
  """sst2_sft_{train,dev}.jsonl and sst2_preferences_{train,dev}.jsonl in `out` from SST-2's train.tsv / dev.tsv;
  returns their {split} globs."""
  for split in ("train", "dev"):
    sft, pairs = sst2_records(os.path.join(sst2_dir, f"{split}.tsv"), prompt_words=prompt_words)
    write_jsonl(os.path.join(out, f"sst2_sft_{split}.jsonl"), sft)
    write_jsonl(os.path.join(out, f"sst2_preferences_{split}.jsonl"), pairs)
  return {"instruction": os.path.join(out, "sst2_sft_{split}.jsonl"),
          "preference": os.path.join(out, "sst2_preferences_{split}.jsonl")}


def main(argv):
  from absl import flags
  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments: {' '.join(argv[1:])}")
  f = flags.FLAGS
  written = {"toy": write_toy(f.out)}
  if f.sst2:
    written["sst2"] = write_sst2(f.sst2, f.out)
  print(json.dumps(written, indent=2))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("out", None, "directory to write the JSONL files to", required=True)
  flags.DEFINE_string("sst2", "", "a directory with SST-2's train.tsv and dev.tsv: also write the SST-2 sets")
  app.run(main)

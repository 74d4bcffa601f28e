"""Instruction and preference data for supervised fine-tuning, reward models and DPO (config.rlhf).

config.rlhf.files is a glob of .jsonl in which `{split}` becomes the split name (e.g. /data/toy/sft_{split}.jsonl),
one JSON object per line:
  instruction  {"prompt": ..., "response": ...}
  preference   {"prompt": ..., "chosen": ..., "rejected": ...}   (the chosen response is the preferred one)
The field names are config.rlhf.prompt_field / response_field / chosen_field / rejected_field; other fields are
ignored (the toy files carry a "text" field to train a tokenizer from scratch with data.text_field="text"). A chat
template config.rlhf.template wraps every prompt: "{prompt}" in it becomes the prompt's text. Splits take slice
syntax (train[:90%]). A record that cannot be used (not JSON, a field missing or not a string, an empty prompt or
response) is counted and skipped, like a bad document.

Each text is tokenized on its own; every response ends with the tokenizer's eos, so a model learns to stop. A
sequence that does not fit keeps the end of its prompt and the start of its response (`fit`).
"""
import dataclasses
import glob
import json
import os

import numpy as np

from lm_jax.data import rows, sources, tasks

KINDS = {"instruction": ("response_field",), "preference": ("chosen_field", "rejected_field")}


@dataclasses.dataclass(frozen=True)
class Record:
  prompt: str
  responses: tuple        # (response,) or (chosen, rejected)


@dataclasses.dataclass(frozen=True)
class Example:
  """A tokenized record: prompt ids (the template applied), response ids each ending with eos, position in the
  split."""
  prompt: np.ndarray
  responses: tuple
  index: int


def check(config):
  """One-line ValueError naming the config.rlhf field that cannot describe the data."""
  r = config.rlhf
  if not r.files:
    raise ValueError("config.rlhf.files must name the .jsonl data, e.g. '/data/toy/sft_{split}.jsonl'")
  for name in ("prompt_field", "response_field", "chosen_field", "rejected_field"):
    if not isinstance(r[name], str) or not r[name]:
      raise ValueError(f"config.rlhf.{name} must name a JSON field, got {r[name]!r}")
  check_template(config)


def check_template(config):
  """One-line ValueError for a config.rlhf.template without '{prompt}' (PPO formats its prompts with it too)."""
  template = config.rlhf.template
  if template and "{prompt}" not in template:
    raise ValueError(f"config.rlhf.template must contain '{{prompt}}', got {template!r}")


def prompt_text(config, prompt: str) -> str:
  """The prompt as the model reads it: config.rlhf.template with {prompt} replaced, or the prompt itself."""
  template = config.rlhf.template
  return template.replace("{prompt}", prompt) if template else prompt


def fit(prompt_len: int, response_len: int, budget: int) -> tuple[int, int]:
  """(prompt tokens kept, response tokens kept) of a sequence of at most `budget` tokens: the response keeps its
  start and leaves at least one prompt token; the prompt keeps its end."""
  r = min(response_len, budget - 1)
  return min(prompt_len, budget - r), r


def sequence(example_prompt: np.ndarray, response: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
  """(prompt + response fitted to `budget` tokens, how many of them are prompt)."""
  p, r = fit(len(example_prompt), len(response), budget)
  return np.concatenate([example_prompt[len(example_prompt) - p:], response[:r]]).astype(np.int32), p


class _InMemory(list):
  def __init__(self, items, path: str, replaced: int):
    super().__init__(items)
    self.path, self.decode_stats = path, {"replaced_characters": replaced}


def records(config, split: str, kind: str) -> list:
  """The records of `split` ('instruction' or 'preference' kind): Record, or sources.Bad for an unusable line; .path."""
  r = config.rlhf
  fields = (r.prompt_field, *(r[f] for f in KINDS[kind]))
  name, spec = sources.split_spec(split)
  pattern = os.path.expanduser(r.files.replace("{split}", name))
  paths = sorted(glob.glob(pattern, recursive=True))
  if not paths:
    raise FileNotFoundError(f"config.rlhf.files: no files match {pattern}")
  out, replaced = [], 0
  for path in paths:
    if not path.endswith(".jsonl"):
      raise ValueError(f"config.rlhf.files: {path}: unsupported type; use .jsonl")
    with open(path, "rb") as f:
      data = f.read()
    text = data.decode("utf-8", "replace")
    replaced += text.count("\ufffd") - data.count("\ufffd".encode())
    out += [_record(line, fields) for line in text.split("\n") if line.strip()]
  if not out:
    raise ValueError(f"config.rlhf.files: no records in {pattern}")
  return _InMemory(sources._apply_slice(out, spec), f"{pattern} ({split})", replaced)


def _record(line: str, fields: tuple):
  try:
    texts = [json.loads(line)[f] for f in fields]
  except (ValueError, KeyError, TypeError):
    return sources.Bad("malformed")
  return Record(texts[0], tuple(texts[1:])) if all(isinstance(t, str) for t in texts) else sources.Bad("malformed")


class Examples(tasks.TokenizedSplit):
  """Instruction or preference examples (Example: prompt, responses, index)."""

  def __init__(self, config, records_, tokenizer):
    super().__init__(records_, tokenizer, ())
    self._config = config

  def _tokenize(self, ids):
    good = []
    for i in ids:
      rec = self.docs[i]
      self.stats["documents"] += 1
      reason = rec.reason if isinstance(rec, sources.Bad) else (
          None if rec.prompt.strip() and all(t.strip() for t in rec.responses) else "empty")
      if reason:
        self.stats[reason] += 1
        self._cache[i] = None
      else:
        good.append((i, (prompt_text(self._config, rec.prompt), *rec.responses)))
    flat = self._tok.encode_batch([t for _, texts in good for t in texts]) if good else []
    k, eos = 0, self._tok.eos_id
    for i, texts in good:
      pieces = flat[k:k + len(texts)]
      k += len(texts)
      self.bytes += sum(len(t.encode("utf-8")) for t in texts)
      self.chars += sum(map(len, texts))
      self.tokens_count += sum(map(len, pieces))
      if not all(pieces):
        self.stats["empty"] += 1
        self._cache[i] = None
        continue
      responses = tuple(np.asarray([*p, eos], np.int32) for p in pieces[1:])
      self._cache[i] = Example(np.asarray(pieces[0], np.int32), responses, i)


def examples(config, split: str, tokenizer, kind: str) -> Examples:
  return Examples(config, records(config, split, kind), tokenizer)


def layout(config, tokenizer, kind: str, build, real_tokens) -> rows.PerDocument:
  """The row layout of an objective on `kind` records: one instance per example; build(list of Example) -> rows
  dict (padding rows are all zeros: weight 0)."""
  empty = build([])
  return rows.PerDocument(
      width=config.data.seq_len, instances=lambda example, rng, other_doc: [example], assemble=build,
      real_tokens=real_tokens, corpus=lambda split: examples(config, split, tokenizer, kind),
      padding=lambda n: {k: np.zeros((n, *v.shape[1:]), v.dtype) for k, v in empty.items()})

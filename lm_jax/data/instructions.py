"""Instruction and preference data for supervised fine-tuning, reward models and DPO (config.rlhf).

config.rlhf.files is a glob of .jsonl (or .tsv with a header row naming the fields) in which `{split}` becomes the
split name (e.g. /data/toy/sft_{split}.jsonl), one JSON object per line:
  instruction  {"prompt": ..., "response": ...}
  preference   {"prompt": ..., "chosen": ..., "rejected": ...}   (the chosen response is the preferred one)
The field names are config.rlhf.prompt_field / response_field / chosen_field / rejected_field; other fields are
ignored (the toy files carry a "text" field to train a tokenizer from scratch with data.text_field="text"). A chat
template config.rlhf.template wraps every prompt: "{prompt}" in it becomes the prompt's text. Splits take slice
syntax (train[:90%]). A record that cannot be used (not JSON, a field missing or not a string, an empty prompt or
response, a preference pair whose chosen response is the rejected one: nothing to learn from it) is counted and
skipped, like a bad document, and reported with its file and line (data/records.py); a split is screened when it is
opened, so one with no usable record stops the run in one line and a partly bad one is named in a warning at the
start. PPO's prompts (config.ppo.prompts, `prompts`) come through the same reader and the same template.

Each text is tokenized on its own; every response ends with the tokenizer's eos, so a model learns to stop. A
sequence that does not fit keeps the end of its prompt and the start of its response (`fit`).
"""
import dataclasses

import numpy as np
from absl import logging

from lm_jax.data import records as records_lib
from lm_jax.data import rows, tasks

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


def records(config, split: str, kind: str) -> records_lib.Records:
  """The records of `split` ('instruction' or 'preference' kind): Record, or records_lib.Bad for an unusable one."""
  r = config.rlhf
  fields = (r.prompt_field, *(r[f] for f in KINDS[kind]))
  found = records_lib.read(split, fields, files=r.files, origin="config.rlhf.files",
                           named_by=f"config.rlhf.prompt_field / {' / '.join(KINDS[kind])}")
  return found.map(lambda rec: Record(rec[fields[0]], tuple(rec[f] for f in fields[1:])))


def prompts(config, tokenizer) -> list[list[int]]:
  """The token ids of every prompt in config.ppo.prompts (.txt: a prompt per non-empty line; .jsonl / .tsv: the field
  config.ppo.prompt_field; a {split} in the glob becomes 'train') in config.rlhf.template, as SFT formats its prompts,
  each cut to its last config.ppo.prompt_len tokens. Unusable prompts are skipped and reported in one warning line;
  none left is an error."""
  p = config.ppo
  check_template(config)
  found = records_lib.read("train", p.prompt_field, files=p.prompts, origin="config.ppo.prompts",
                           named_by="config.ppo.prompt_field")
  tally, good = records_lib.Tally(found, ("empty",)), []
  for i, text in enumerate(found):
    if isinstance(text, records_lib.Bad):
      tally.count(i, text.reason, text.detail)
    else:
      good.append(i)
  out = []
  for i, ids in zip(good, tokenizer.encode_batch([prompt_text(config, found[i]) for i in good]) if good else []):
    tally.count(i, None if ids else "empty", "no tokens")
    if ids:
      out.append(ids[-p.prompt_len:])
  if not out:
    raise ValueError(f"config.ppo.prompts={p.prompts!r}: no usable prompt; {tally.report()}")
  if tally.report():
    logging.warning("data: %s", tally.report())
  return out


def _problem(rec: Record) -> records_lib.Bad | None:
  if not all(t.strip() for t in (rec.prompt, *rec.responses)):
    return records_lib.Bad("empty", "a blank text")
  return records_lib.Bad("identical", "chosen == rejected") if len(set(rec.responses)) < len(rec.responses) else None


class Examples(tasks.TokenizedSplit):
  """Instruction or preference examples (Example: prompt, responses, index)."""

  def __init__(self, config, records_, tokenizer):
    super().__init__(records_, tokenizer, ())
    self._config = config
    records_lib.screen(records_, _problem)

  def _tokenize(self, ids):
    good = self._usable(ids, _problem)
    good = [(i, (prompt_text(self._config, rec.prompt), *rec.responses)) for i, rec in good]
    flat = self._tok.encode_batch([t for _, texts in good for t in texts]) if good else []
    k, eos = 0, self._tok.eos_id
    for i, texts in good:
      pieces = flat[k:k + len(texts)]
      k += len(texts)
      self._measure(texts, pieces)
      if not all(pieces):
        self._skip(i, records_lib.Bad("empty", "a text of no tokens"))
        continue
      self.tally.count(i)
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

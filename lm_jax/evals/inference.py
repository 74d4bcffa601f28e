"""Using a trained model from the command line: fill [MASK] tokens (BERT) and continue prompts (GPT, T5), with
the latest checkpoint of a workdir or a Hugging Face directory (config.init_from). The command line's prompts and
decoding flags are checked here before any model is read: a flag of another method, or a value out of range, is a
ConfigError (exit code 2)."""
import jax
import numpy as np

from lm_jax import config_lib, decoding, models, params as params_lib, storage
from lm_jax.evals import run_eval

MASK = "[MASK]"
# The generate flags that only one decoding method reads.
METHOD_OPTIONS = {"sample": ("temperature", "top_k", "top_p", "seed"), "beam": ("num_beams",)}
_RANGES = {"max_new_tokens": (">= 1", lambda x: x >= 1), "temperature": ("> 0", lambda x: x > 0),
           "top_k": (">= 0 (0 = all)", lambda x: x >= 0), "top_p": ("in (0, 1]", lambda x: 0 < x <= 1),
           "num_beams": (">= 1", lambda x: x >= 1)}


def read_prompts(prompts, prompts_file: str | None) -> list[str]:
  """--prompt values, then one prompt per non-empty line of --prompts_file (UTF-8 text)."""
  out = list(prompts or [])
  if any(not text.strip() for text in out):
    raise config_lib.ConfigError("--prompt is empty; give the text to continue (--mode=fill_mask: a text with "
                                 "[MASK]s)")
  if prompts_file:
    try:
      with storage.open(prompts_file, "r", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as e:
      raise ValueError(f"--prompts_file={prompts_file}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except IsADirectoryError:
      raise ValueError(f"--prompts_file={prompts_file} is a directory, not a file of prompts") from None
    if not lines:
      raise ValueError(f"--prompts_file={prompts_file} is empty (no non-blank line)")
    out += lines
  if not out:
    raise config_lib.ConfigError("give at least one --prompt or a --prompts_file")
  return out


def check_generate_flags(given: set[str], method: str, **options):
  """ConfigError for a decoding flag `given` on the command line that --method does not read (--temperature without
  --method=sample: silently ignored, it would hide a typo in the method), or for an option out of its range."""
  for other, names in METHOD_OPTIONS.items():
    wrong = sorted(n for n in names if n in given and method != other)
    if wrong:
      raise config_lib.ConfigError(f"--{wrong[0]} applies to --method={other}, not --method={method}")
  for name, (rule, ok) in _RANGES.items():
    if name in options and not ok(options[name]):
      raise config_lib.ConfigError(f"--{name} must be {rule}, got {options[name]}")


def generate_text(config, workdir: str, texts: list[str], **options) -> list[str]:
  """Continuations of text prompts (a decoder's: the text so far; an encoder-decoder's: the encoder input,
  eos-terminated) with lm_jax.decoding.generate(**options), decoded without their eos."""
  s, params, _ = run_eval.restore_params(config, workdir)
  params, tok, m = params_lib.for_inference(s.config, params), s.tokenizer, s.config.model
  eos = [tok.eos_id] if models.family(m).layout == "encoder_decoder" else []
  prompts = [tok.encode(t) + eos for t in texts]
  out = decoding.generate(m, params, prompts, eos_id=tok.eos_id, pad_id=tok.pad_id, **options)
  return [tok.decode([i for i in ids if i != tok.eos_id]) for ids in out]


def encode_masked(tokenizer, text: str) -> list[int]:
  """Ids of `text` with every literal [MASK] replaced by the tokenizer's mask id."""
  parts = text.split(MASK)
  ids = []
  for i, part in enumerate(parts):
    ids += tokenizer.encode(part) if part.strip() else []
    if i < len(parts) - 1:
      ids.append(tokenizer.mask_id)
  return ids


def fill_mask(config, workdir: str, texts: list[str], top_k: int = 5) -> list[list[list[tuple[str, float]]]]:
  """Per text, per [MASK]: the top_k (token, probability) of the MLM head."""
  s, params, _ = run_eval.restore_params(config, workdir)
  params, tok, m = params_lib.for_inference(s.config, params), s.tokenizer, s.config.model
  if tok.mask_id is None or models.family(m).layout != "encoder":
    raise ValueError(f"--mode=fill_mask needs a BERT model and tokenizer; config.model.family={m.family!r}")
  rows = [[tok.cls_id] + encode_masked(tok, t)[:s.config.data.seq_len - 2] + [tok.sep_id] for t in texts]
  masks = [[i for i, t in enumerate(r) if t == tok.mask_id] for r in rows]
  if not all(masks):
    raise ValueError(f"every prompt needs a {MASK} within data.seq_len={s.config.data.seq_len} tokens: "
                     f"{texts[[bool(x) for x in masks].index(False)]!r}")
  length, preds = max(map(len, rows)), max(map(len, masks))
  ids = np.full((len(rows), length), tok.pad_id, np.int32)
  positions = np.zeros((len(rows), preds), np.int32)
  for r, (row, where) in enumerate(zip(rows, masks)):
    ids[r, :len(row)], positions[r, :len(where)] = row, where
  batch = dict(input_ids=ids, token_type_ids=np.zeros_like(ids), attention_mask=(ids != tok.pad_id).astype(np.int32),
               mlm_positions=positions)
  logits = jax.device_get(jax.jit(lambda p, b: models.apply(m, p, b)["logits"])(params, batch))
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = []
  for r, where in enumerate(masks):
    best = [np.argsort(-probs[r, j])[:top_k] for j in range(len(where))]
    out.append([[(tok.decode([int(i)]), float(probs[r, j, i])) for i in ids_] for j, ids_ in enumerate(best)])
  return out

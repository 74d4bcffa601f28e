"""Using a trained model from the command line: fill [MASK] tokens (BERT) and continue prompts (GPT, T5), with
the latest checkpoint of a workdir or a Hugging Face directory (config.init_from)."""
import jax
import numpy as np

from lm_jax import decoding, models, params as params_lib, train

MASK = "[MASK]"


def read_prompts(prompts, prompts_file: str | None) -> list[str]:
  """--prompt values, then one prompt per non-empty line of --prompts_file."""
  out = list(prompts or [])
  if prompts_file:
    with open(prompts_file, encoding="utf-8") as f:
      out += [line.rstrip("\n") for line in f if line.strip()]
  if not out:
    raise ValueError("give at least one --prompt or a --prompts_file")
  return out


def generate_text(config, workdir: str, texts: list[str], **options) -> list[str]:
  """Continuations of text prompts (a decoder's: the text so far; an encoder-decoder's: the encoder input,
  eos-terminated) with lm_jax.decoding.generate(**options), decoded without their eos."""
  s, params, _ = train.restore_params(config, workdir)
  params, tok, m = params_lib.materialize(s.config, params), s.tokenizer, s.config.model
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
  s, params, _ = train.restore_params(config, workdir)
  params, tok, m = params_lib.materialize(s.config, params), s.tokenizer, s.config.model
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

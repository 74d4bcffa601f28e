"""The tokenizer files of a Hugging Face export: tokenizer.json (the `tokenizers` library's format, which
transformers' AutoTokenizer loads as a PreTrainedTokenizerFast), tokenizer_config.json and special_tokens_map.json.

An imported HF tokenizer (tokenizer.json, WordPiece vocab.txt) is written back as it was loaded. A SentencePiece
model becomes a `tokenizers` Unigram or BPE model behind SentencePiece's normalizer: its precompiled character
map, then its whitespace rule (runs of spaces collapsed, leading and trailing ones dropped) and the Metaspace
pre-tokenizer ('▁' for spaces, one in front). Its control and unknown pieces, and T5's 100 sentinels
<extra_id_k> above them, become special added tokens at lm_jax's ids.

The ids equal lm_jax's for every text lm_jax encodes whole (a document, a sentence), with two known
differences: transformers matches special-token strings written in the text (a literal "</s>") while
SentencePiece spells them out; and SentencePiece segments a string as one lattice with float32 path scores,
so in a string of megabytes a near-tie between two segmentations of one word can fall the other way.
"""
import json
import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from lm_jax import models as model_lib
from lm_jax.data import tokenizer as tokenizer_lib

_ROLES = ("pad", "eos", "unk", "cls", "sep", "mask")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4    # SentencePiece ModelProto.SentencePiece.Type


def backend(tok: tokenizer_lib.Tokenizer, family: str) -> tokenizers.Tokenizer:
  """The `tokenizers` Tokenizer that gives `tok`'s ids; its post-processor adds the family's special tokens
  (Tokens.template: [CLS] x [SEP] for BERT, x </s> for T5, nothing for GPT) when asked to."""
  if isinstance(tok.serialized, str):
    return tokenizers.Tokenizer.from_str(tok.serialized)
  return _from_sentencepiece(tok, family)


def save(tok: tokenizer_lib.Tokenizer, family: str, out_dir: str, model_max_length: int | None = None) -> None:
  """tokenizer.json, tokenizer_config.json and special_tokens_map.json of `tok` in out_dir."""
  backend_tok = backend(tok, family)
  specials = _special_tokens(tok, family, backend_tok)
  # Only a family that reads them gets token_type_ids (OpenAIGPTModel would add their word embeddings); a decoder
  # generates from the left.
  fam = model_lib.family(family)
  inputs = ["input_ids", *(["token_type_ids"] if fam.tokens.token_types else []), "attention_mask"]
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **specials,
            "model_input_names": inputs, "padding_side": "left" if fam.layout == "decoder" else "right"}
  if model_max_length:
    config["model_max_length"] = model_max_length
  os.makedirs(out_dir, exist_ok=True)
  backend_tok.save(os.path.join(out_dir, "tokenizer.json"))
  for name, fields in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(fields, f, indent=2, ensure_ascii=False)


def _special_tokens(tok: tokenizer_lib.Tokenizer, family: str, backend_tok: tokenizers.Tokenizer) -> dict:
  """{'pad_token': '<pad>', ...} of the roles `tok` has, plus the sentinels (T5) as additional_special_tokens."""
  out = {}
  for role in _ROLES:
    i = getattr(tok, f"{role}_id")
    if i is not None:
      out[f"{role}_token"] = backend_tok.id_to_token(i)
  if model_lib.family(family).tokens.sentinels:
    out["additional_special_tokens"] = [f"<extra_id_{k}>" for k in range(tokenizer_lib.NUM_SENTINELS)]
  return out


def _from_sentencepiece(tok: tokenizer_lib.Tokenizer, family: str) -> tokenizers.Tokenizer:
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto.FromString(tok.serialized)
  spec, norm = proto.trainer_spec, proto.normalizer_spec
  problems = {"a model type other than unigram or bpe": spec.model_type not in (spec.UNIGRAM, spec.BPE),
              "byte_fallback": spec.byte_fallback,
              "user-defined pieces": any(p.type == _USER_DEFINED for p in proto.pieces)}
  if any(problems.values()):
    raise ValueError(f"SentencePiece model: {', '.join(k for k, bad in problems.items() if bad)} cannot be "
                     "exported to Hugging Face")
  pieces = [(p.piece, p.score) for p in proto.pieces]
  if spec.model_type == spec.UNIGRAM:
    model = models.Unigram(pieces, spec.unk_id, False)
  else:
    model = models.BPE({p: i for i, (p, _) in enumerate(pieces)}, _bpe_merges(proto),
                       unk_token=pieces[spec.unk_id][0], fuse_unk=True)
  out = tokenizers.Tokenizer(model)
  steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
  if norm.remove_extra_whitespaces:
    steps += [normalizers.Replace(tokenizers.Regex(" {2,}"), " "),
              normalizers.Replace(tokenizers.Regex(r"\A | \z"), "")]
  out.normalizer = normalizers.Sequence(steps)
  prepend = "always" if norm.add_dummy_prefix else "never"
  out.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)
  out.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend, split=True)
  special = [p.piece for p in proto.pieces if p.type in (_UNKNOWN, _CONTROL)]
  # Sentinels follow the pieces, <extra_id_99> first: added tokens take the next ids in order.
  if model_lib.family(family).tokens.sentinels:
    special += [f"<extra_id_{k}>" for k in reversed(range(tokenizer_lib.NUM_SENTINELS))]
  out.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in special])
  out.post_processor = _post_processor(tok, family, out)
  return out


def _bpe_merges(proto) -> list[tuple[str, str]]:
  """Every split of a piece into two pieces, best-scored result first: SentencePiece's BPE merges the adjacent
  pair whose concatenation scores highest, which is the lowest rank in these merges."""
  index = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == _NORMAL}
  merges = []
  for i, p in enumerate(proto.pieces):
    if p.type == _NORMAL:
      merges += [(-p.score, i, index[p.piece[:k]], (p.piece[:k], p.piece[k:])) for k in range(1, len(p.piece))
                 if p.piece[:k] in index and p.piece[k:] in index]
  return [m[-1] for m in sorted(merges)]


def _post_processor(tok, family, out):
  """Special tokens transformers adds around a text (Tokens.template): BERT's [CLS] x [SEP] ([CLS] x [SEP] y [SEP]
  with y's type id 1), T5's x </s> (x </s> y </s>); none for GPT."""
  spec = model_lib.family(family).tokens
  if spec.template == ("$A",):
    return None
  names = {role: out.id_to_token(getattr(tok, role)) for role in spec.template if role != "$A"}
  single = [names.get(t, t) for t in spec.template]
  second = ":1" if spec.token_types else ""
  after = [names.get(t, "$B") + second for t in spec.template[spec.template.index("$A"):]]
  return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(single + after),
                                       special_tokens=[(n, out.token_to_id(n)) for n in dict.fromkeys(names.values())])

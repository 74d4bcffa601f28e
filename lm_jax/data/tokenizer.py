"""Tokenizers: SentencePiece (trained here or loaded), Hugging Face (`tokenizers`) and characters behind one interface.

Special ids per family (what the objectives need; each family's `Tokens` record, lm_jax/models/registry.py). The
caller hands in the family record (`lm_jax.models.family(name)`): data/ never looks a family up itself.
  bert:      [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4
  gpt, gpt2: <pad>=0 </s>=1 (eos, appended to every document) <unk>=2
  t5:        <pad>=0 </s>=1 <unk>=2, and 100 sentinels <extra_id_k> above the SentencePiece pieces:
        sentinel_id(k) = sp_size + 100 - 1 - k (the seqio / HF T5Tokenizer rule, so <extra_id_0> of the
        released T5 vocab is 32099). A trained T5 tokenizer gets sp_size = model vocab - 100, which puts the
        sentinels at the very top of the model vocab (id = vocab_size - 1 - k).
  char:      no specials: id i is the i-th of the text's distinct characters in sorted order (nanoGPT's
        shakespeare_char), so a token's loss is exactly a character's; saved as tokenizer_char.json.
"""
import io
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
from etils import epath

from lm_jax import storage
from lm_jax.data import sources, windows

NUM_SENTINELS = 100
_TRAIN_CHARS = 3_000_000      # training text sample: SentencePiece's training time grows with it (bench/README.md)
_MAX_SENTENCE_BYTES = 4192    # SentencePiece's max_sentence_length: its trainer skips longer sentences
_NAMES = {  # special role -> piece names used by SentencePiece models and HF tokenizers
    "pad_id": ("[PAD]", "<pad>", "<|pad|>"), "unk_id": ("[UNK]", "<unk>", "<|unk|>"),
    "cls_id": ("[CLS]", "<cls>"), "sep_id": ("[SEP]", "<sep>"), "mask_id": ("[MASK]", "<mask>"),
    "eos_id": ("</s>", "<|endoftext|>", "<eos>"),
}


class Tokenizer:
  """Text <-> ids plus the special ids a model family needs (None where the family has none)."""

  def __init__(self, *, pieces, encode_batch, decode, specials, word_start, family, sentinels=None, serialized=None,
               path=""):
    self._pieces = pieces
    self.path = path                          # the file (or directory) it was read from
    self.family = family                      # the Family record it was checked against (load(path, family) again)
    self.serialized = serialized              # the SentencePiece model proto (bytes) or tokenizer.json (str)
    self._encode_batch = encode_batch
    self._decode = decode
    self._sentinels = sentinels               # id of <extra_id_0>, counting down; None = no sentinels
    self.pad_id = specials.get("pad_id")
    self.eos_id = specials.get("eos_id")
    self.unk_id = specials.get("unk_id")
    self.cls_id = specials.get("cls_id")
    self.sep_id = specials.get("sep_id")
    self.mask_id = specials.get("mask_id")
    # Ids below the sentinels: the text pieces (the trainer adds the 100 sentinels for span corruption).
    self.vocab_size = sentinels - NUM_SENTINELS + 1 if sentinels is not None else len(pieces)
    self.special_ids = sorted({i for i in specials.values() if i is not None})
    # Lookup table: does this id start a word? Specials count as word starts; unknown ids too.
    table = np.array([word_start(p) for p in pieces] + [True], bool)
    table[self.special_ids] = True
    self._starts = table

  def encode(self, text: str) -> list[int]:
    return self.encode_batch([text])[0]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Ids of each text, no special tokens added (the pipeline adds [CLS]/[SEP]/eos itself)."""
    return self._encode_batch(texts)

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids]
    if self._sentinels is None:
      return self._decode(ids)
    out, run = [], []
    for i in ids + [-1]:
      if 0 <= self._sentinels - i < NUM_SENTINELS or i == -1:
        if run:
          out.append(self._decode(run))
          run = []
        if i != -1:
          out.append(f"<extra_id_{self._sentinels - i}>")
      else:
        run.append(i)
    return " ".join(out)

  def sentinel_id(self, k: int) -> int:
    if self._sentinels is None:
      raise ValueError("this tokenizer has no <extra_id_k> sentinels (T5 family only)")
    if not 0 <= k < NUM_SENTINELS:
      raise ValueError(f"sentinel index {k} out of range [0, {NUM_SENTINELS})")
    return self._sentinels - k

  def word_starts(self, ids: np.ndarray) -> np.ndarray:
    """True where a token begins a word ('▁' prefix in SentencePiece, no '##' in WordPiece), for WWM."""
    ids = np.asarray(ids)
    return self._starts[np.clip(ids, 0, len(self._starts) - 1)]


def differences(a: Tokenizer, b: Tokenizer) -> str:
  """'' when a and b give every id the same piece (the same tokenizer to a model, even if their files differ),
  else how many ids differ and the first one. Equal sizes are not enough: two tokenizers trained on different text
  have the same size and other pieces."""
  x, y = a._pieces, b._pieces
  if x == y:
    return ""
  differ = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
  out = f"{len(differ) + abs(len(x) - len(y))} of {max(len(x), len(y))} ids differ"
  return out + (f"; id {differ[0]} is {x[differ[0]]!r} in one, {y[differ[0]]!r} in the other" if differ else "")


def check_same(tokenizer: Tokenizer, other_path: str, what: str, whose: str):
  """One-line ValueError when the tokenizer at other_path (that of `what`, e.g. the reward model) is not `tokenizer`
  (`whose`, e.g. the policy's): ids would mean other pieces in the two models."""
  other = load(other_path, tokenizer.family)
  diff = differences(tokenizer, other)
  if diff:
    raise ValueError(f"{what}: its tokenizer {other.path} is not {whose} {tokenizer.path} ({diff}); both models "
                     "must use one tokenizer")


def _sentencepiece(proto: bytes, family, path: str = "", fix: str = "pass an intact one") -> Tokenizer:
  """A SentencePiece model; a damaged file (truncated, overwritten) is a one-line ValueError naming it and `fix`."""
  import sentencepiece as spm
  try:
    sp = spm.SentencePieceProcessor(model_proto=proto)
  except RuntimeError:   # a 40-line traceback ending in sentencepiece's 'ParseFromArray' check
    raise ValueError(f"tokenizer {path or '(bytes)'} is damaged ({len(proto)} bytes that are not a SentencePiece "
                     f"model): {fix}") from None
  pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
  index = {p: i for i, p in enumerate(pieces)}
  specials = {role: next((index[n] for n in names if n in index), None) for role, names in _NAMES.items()}
  if sp.unk_id() >= 0:
    specials["unk_id"] = sp.unk_id()
  if sp.pad_id() >= 0:
    specials["pad_id"] = sp.pad_id()
  if sp.eos_id() >= 0:
    specials["eos_id"] = sp.eos_id()
  sentinels = len(pieces) + NUM_SENTINELS - 1 if family.tokens.sentinels else None
  _check_family(specials, family, "SentencePiece model")
  return Tokenizer(pieces=pieces, encode_batch=lambda t: sp.encode(t, num_threads=min(len(t) // 16 + 1, os.cpu_count() or 1)),
                   decode=sp.decode, specials=specials, word_start=lambda p: p.startswith("▁"),
                   sentinels=sentinels, serialized=proto, path=path, family=family)


def _huggingface(path: pathlib.Path, family) -> Tokenizer:
  """A Hugging Face tokenizer: tokenizer.json, or a WordPiece vocab.txt (+ tokenizer_config.json)."""
  import tokenizers
  folder = path if path.is_dir() else path.parent
  config = _read_json(folder / "tokenizer_config.json")
  if path.is_dir():
    path = folder / "tokenizer.json" if (folder / "tokenizer.json").exists() else folder / "vocab.txt"
  if path.name.endswith(".json"):
    tok = tokenizers.Tokenizer.from_file(str(path))
  else:
    tok = tokenizers.BertWordPieceTokenizer(str(path), lowercase=config.get("do_lower_case", True))
  tok.no_padding()
  tok.no_truncation()
  vocab = tok.get_vocab(with_added_tokens=True)
  pieces = [""] * (max(vocab.values()) + 1)
  for p, i in vocab.items():
    pieces[i] = p
  declared = _read_json(folder / "special_tokens_map.json")
  specials = {}
  for role, names in _NAMES.items():
    name = declared.get(role[:-3] + "_token")
    name = name.get("content") if isinstance(name, dict) else name
    specials[role] = next((vocab[n] for n in ((name,) if name else ()) + names if n in vocab), None)
  wordpiece = type(tok.model).__name__ == "WordPiece"
  if wordpiece:
    word_start = lambda p: not p.startswith("##")
  elif any(p.startswith("Ġ") for p in pieces[:1000]):
    word_start = lambda p: p.startswith("Ġ")
  else:
    word_start = lambda p: p.startswith("▁")
  needs_sentinels = family.tokens.sentinels
  sentinels = vocab.get("<extra_id_0>") if needs_sentinels else None
  if needs_sentinels and sentinels is None:
    raise ValueError(f"tokenizer {path}: a {family.name} tokenizer needs <extra_id_0..99> tokens")
  _check_family(specials, family, str(path))
  encode = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
  return Tokenizer(pieces=pieces, encode_batch=encode, decode=tok.decode, specials=specials,
                   word_start=word_start, sentinels=sentinels, serialized=tok.to_str(), path=str(path), family=family)


def _chars(chars: str, path: str, family) -> Tokenizer:
  """One id per character of `chars` (sorted, distinct); pad_id 0 pads decoding's prompts, nothing is an eos."""
  index = {ch: i for i, ch in enumerate(chars)}

  def encode(texts):
    out = []
    for text in texts:
      unknown = set(text) - index.keys()
      if unknown:
        raise ValueError(f"char tokenizer {path or '(new)'}: characters {''.join(sorted(unknown))!r} are not in its "
                         f"{len(chars)}-character vocabulary")
      out.append([index[ch] for ch in text])
    return out

  return Tokenizer(pieces=list(chars), encode_batch=encode, decode=lambda ids: "".join(chars[i] for i in ids),
                   specials={"pad_id": 0}, word_start=lambda p: not p.strip(),
                   serialized=json.dumps({"chars": chars}), path=path, family=family)


def char_vocabulary(texts) -> str:
  """nanoGPT's vocabulary: the distinct characters of all `texts`, sorted by code point."""
  return "".join(sorted(set().union(*map(set, texts))))


def _read_json(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {}


def _check_family(specials, family, what):
  missing = [r[:-3] for r in family.tokens.required if specials.get(r) is None]
  if missing:
    raise ValueError(f"{what}: no {', '.join(missing)} token, which family {family.name!r} needs")


_HF_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def load(path: str, family) -> Tokenizer:
  """A SentencePiece .model, or a Hugging Face tokenizer.json / vocab.txt / checkpoint directory; local or remote
  (gs://...: its tokenizer files are read from a local copy, and .path stays the URL); checked against `family` (a
  lm_jax.models Family record: the special tokens its objectives need)."""
  if storage.is_remote(path):
    return _load_remote(str(path).rstrip("/"), family)
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise FileNotFoundError(f"config.data.tokenizer: {path} does not exist")
  models = sorted(p.glob("*.model")) if p.is_dir() else []
  if p.is_dir() and not (p / "tokenizer.json").exists() and not (p / "vocab.txt").exists():
    if not models:
      raise FileNotFoundError(f"config.data.tokenizer: {path} has no tokenizer.json, vocab.txt or *.model")
    p = models[0]
  if p.suffix == ".model":
    return _sentencepiece(p.read_bytes(), family, str(p))
  if p.name.startswith("tokenizer_char") and p.suffix == ".json":
    return _chars(json.loads(p.read_text())["chars"], str(p), family)
  return _huggingface(p, family)


def _load_remote(url: str, family) -> Tokenizer:
  """load() of a URL: a .model's bytes are read directly; the HF readers take local files, so the tokenizer files of
  the folder (not its weights) are copied to a temporary one, and errors name the URL."""
  if not storage.exists(url):
    raise FileNotFoundError(f"config.data.tokenizer: {url} does not exist")
  folder, name = (url, "") if storage.isdir(url) else url.rsplit("/", 1)
  if name.endswith(".model"):
    return _sentencepiece(storage.path(url).read_bytes(), family, url)
  wanted = {name} if name else set(_HF_FILES) | {u.rsplit("/", 1)[1] for u in storage.glob(f"{folder}/*.model")}
  local = tempfile.mkdtemp(prefix="lm_jax-tokenizer-")
  try:
    for f in storage.list_files(folder):
      if f.rsplit("/", 1)[1] in wanted | set(_HF_FILES[2:]):
        pathlib.Path(local, f.rsplit("/", 1)[1]).write_bytes(storage.path(f).read_bytes())
    tok = load(os.path.join(local, name), family)
  except (ValueError, FileNotFoundError) as e:
    raise type(e)(str(e).replace(local, folder)) from None
  finally:
    shutil.rmtree(local, ignore_errors=True)
  tok.path = folder + tok.path[len(local):].rstrip("/")
  return tok


def train(lines, *, family, vocab_size: int, model_type: str = "unigram") -> bytes:
  """Serialized SentencePiece model trained on `lines` (deterministic for the same lines); lines of any
  length (each is cut into sentences SentencePiece keeps)."""
  import sentencepiece as spm
  if model_type not in ("unigram", "bpe"):
    raise ValueError(f"config.data.tokenizer_type: {model_type!r}; use 'unigram', 'bpe' or 'char'")
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=(s for line in lines for s in spm_sentences(line)), model_writer=out,
      vocab_size=vocab_size, model_type=model_type, max_sentence_length=_MAX_SENTENCE_BYTES,
      hard_vocab_limit=False,       # a small corpus may not support the requested size: take what it has
      num_threads=2, minloglevel=2, **family.tokens.spm)
  return out.getvalue()


def spm_sentences(line: str, max_bytes: int = _MAX_SENTENCE_BYTES):
  """The non-blank pieces of `line` of at most max_bytes of UTF-8, cut at the last space or tab before the
  limit (mid-word, between characters, where the second half of a piece has none)."""
  data = line.encode("utf-8")
  start = 0
  while start < len(data):
    end = start + max_bytes
    if end < len(data):
      half = end - max_bytes // 2
      cut = max(data.rfind(b" ", half, end + 1), data.rfind(b"\t", half, end + 1))
      if cut >= 0:
        end = cut
      else:
        while data[end] & 0xC0 == 0x80:    # a UTF-8 continuation byte: back to the character's start
          end -= 1
    piece = data[start:end]
    if piece.strip():
      yield piece.decode("utf-8")
    start = end


def _write(path: epath.Path, data: bytes):
  """Writes through a temporary file, so a reader never sees a partial tokenizer; a local one is new (never a link
  placed in the workdir) and its rename replaces a link at `path` rather than writing through it."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if not storage.is_remote(path):
    return os.replace(storage.write_new(str(path.parent), f"{path.name}.", data), path)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_bytes(data)
  tmp.replace(path)


def num_sentinels(family) -> int:
  """Model ids a family's tokenizer has beyond its vocab_size: T5's sentinels (Tokens.sentinels), else none."""
  return NUM_SENTINELS if family.tokens.sentinels else 0


def spm_vocab_size(family, model_vocab_size: int) -> int:
  """SentencePiece size to train so the tokenizer fills the model vocab (T5 keeps 100 ids for sentinels)."""
  sentinels = num_sentinels(family)
  size = model_vocab_size - sentinels
  if size < 16:
    raise ValueError(f"config.model.vocab_size={model_vocab_size} is too small for a {family.name} tokenizer"
                     + (f" plus {sentinels} sentinels" if sentinels else ""))
  return size


def load_or_train(config, workdir: str, family) -> Tokenizer:
  """config.data.tokenizer if set; else a SentencePiece model trained on a sample of the training
  text and cached in workdir (every host trains the same bytes, so nothing needs sharing). `family` is the record of
  config.model.family."""
  vocab = config.model.vocab_size
  if config.data.tokenizer:
    tok = load(config.data.tokenizer, family)
  elif config.data.tokenizer_type == "char":
    path = epath.Path(workdir) / "tokenizer_char.json"
    if not path.exists():
      _write(path, json.dumps({"chars": char_vocabulary(windows.split_texts(config))}).encode())
    tok = _chars(json.loads(path.read_text())["chars"], str(path), family)
  else:
    size = spm_vocab_size(family, vocab)
    kind = config.data.tokenizer_type
    path = epath.Path(workdir) / f"tokenizer_{family.name}_{kind}_{size}.model"   # epath: gs:// workdirs too
    if not path.exists():
      _write(path, train(sources.training_text(config, _TRAIN_CHARS), family=family, vocab_size=size,
                         model_type=kind))
    tok = _sentencepiece(path.read_bytes(), family, str(path), fix="remove it to train it again from the data, or "
                         "name a tokenizer with --config.data.tokenizer")
  sentinels = num_sentinels(family)
  need = tok.vocab_size + sentinels
  if vocab < need:
    extra = f" + {sentinels} sentinels" if sentinels else ""
    raise ValueError(f"config.model.vocab_size={vocab} is smaller than the tokenizer's {tok.vocab_size} "
                     f"tokens{extra} = {need}")
  return tok

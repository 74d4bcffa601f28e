"""Llama (lm_jax/models/llama.py, lm_jax/hf/llama.py, configs/llama.py): SmolLM's parameter counts as transformers
has them, logits within 1e-4 of transformers both ways with grouped-query (GQA) and multi-query (MQA) attention
and a tied or untied head, greedy and beam generate token-identical to transformers', a KV cache of the kv heads
only, GQA on a (2, 2, 2) mesh equal to one device, and a tiny run from the command line that resumes exactly,
exports to a transformers pipeline and starts DPO with LoRA."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, cli, hf_generate
from test_scaling import _matmul_flops
from lm_jax import checkpoint_export, config_lib, decoding, flops, models, train
from lm_jax import hf as hf_lib
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.data import toy_tasks
from lm_jax.hf import export
from lm_jax.models import layers
from lm_jax.obs import metrics_log
from lm_jax.plan import memory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, NEW = 98, 8
IDS = np.random.default_rng(1).integers(0, VOCAB, (3, 24)).tolist()
PROMPTS = [[5, 17, 33, 2, 60, 71, 9], [44, 3], [12, 90, 8, 27], [81]]
# Odd sizes (d_ff 44, 4 heads of 8 on a width of 32) so a transposed or mis-split tensor shows.
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2, max_position_embeddings=64)


def hf_random(cls, config_cls, **fields):
  """transformers' model of SHAPE | fields, its weights perturbed N(0, 0.3^2) away from the init (unit norms)."""
  torch.manual_seed(0)
  hf = cls(config_cls(**SHAPE | fields)).eval()
  with torch.no_grad():
    for t in hf.parameters():
      t.add_(0.3 * torch.randn_like(t))
  return hf


def hf_logits(hf, ids):
  with torch.no_grad():
    return hf(torch.tensor(ids)).logits.numpy()


def ours_logits(m, p, ids):
  return np.asarray(models.apply(m, p, {"input_ids": np.asarray(ids, np.int32)})["logits"])


def check_both_ways(hf, cls, path, out):
  """transformers' checkpoint at `path` loads (looped and scanned) with its logits; our export at `out` loads in
  `cls` with them too. Returns our (config, params)."""
  want = hf_logits(hf, IDS)
  for scan in (True, False):
    m, p = export.load_hf(path, scan_layers=scan)
    np.testing.assert_allclose(ours_logits(m, p, IDS), want, atol=1e-4, rtol=0)
  export.save_hf(m, p, out)
  back = cls.from_pretrained(out, dtype=torch.float32).eval()
  np.testing.assert_allclose(hf_logits(back, IDS), want, atol=1e-4, rtol=0)
  return m, p


def check_generate(m, p, hf):
  """Greedy and 4-beam search on left-padded prompts of several lengths, token for token; EOS is a token greedy
  decoding emits early, so rows end apart."""
  eos = hf_generate(hf, PROMPTS[:1], -1, NEW)[0][2]
  greedy = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, eos_id=eos)
  assert greedy == hf_generate(hf, PROMPTS, eos, NEW)
  assert min(map(len, greedy)) < NEW == max(map(len, greedy))
  beam = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, method="beam", num_beams=4, eos_id=eos)
  assert beam == hf_generate(hf, PROMPTS, eos, NEW, num_beams=4, length_penalty=1.0, early_stopping=True)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
  """(transformers' GQA model: 4 heads over 2 kv heads, untied head, rope_theta 500; our config and params)."""
  hf = hf_random(transformers.LlamaForCausalLM, transformers.LlamaConfig, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=500.0, tie_word_embeddings=False)
  path, out = (str(tmp_path_factory.mktemp(name)) for name in ("hf", "ours"))
  hf.save_pretrained(path)
  m, p = check_both_ways(hf, transformers.LlamaForCausalLM, path, out)
  return hf, m, p


# ------------------------------------------------------------------------------------------------ HF parity
@pytest.mark.parametrize("variant,count", [("smollm_135m", 134_515_008), ("smollm_360m", 361_821_120)])
def test_parameter_counts_equal_hf(variant, count):
  """From shapes alone on both sides (our eval_shape, HF's model on the meta device from our hf_config)."""
  m = config_lib.load(f"configs/llama.py:{variant}", {"model.scan_layers": True}).model   # traces one layer
  assert models.count(models.abstract_params(m)) == count
  hf_config = {k: v for k, v in hf_lib.family_module(m).hf_config(m).items() if k != "architectures"}
  with torch.device("meta"):
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert type(hf).__name__ == "LlamaForCausalLM" and sum(t.numel() for t in hf.parameters()) == count


def test_gqa_untied_both_ways(gqa):
  _, m, p = gqa
  assert (m.family, m.num_heads, m.num_kv_heads, m.rope_theta, m.tie_embeddings) == ("llama", 4, 2, 500.0, False)
  assert p["layers_0"]["attention"]["key"]["kernel"].shape == (32, 2, 8) and "lm_head" in p


def test_mqa_tied_both_ways(tmp_path):
  hf = hf_random(transformers.LlamaForCausalLM, transformers.LlamaConfig, num_attention_heads=4,
                 num_key_value_heads=1, tie_word_embeddings=True)
  hf.save_pretrained(tmp_path / "hf")
  m, p = check_both_ways(hf, transformers.LlamaForCausalLM, str(tmp_path / "hf"), str(tmp_path / "ours"))
  assert (m.num_kv_heads, m.tie_embeddings) == (1, True) and "lm_head" not in p


def test_unsupported_checkpoints_are_refused_in_one_line():
  """Llama 3's scaled rotary frequencies, biases and other activations would load with wrong logits: refused."""
  hf = transformers.LlamaConfig(**SHAPE).to_dict()
  for change, field in (({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3"),
                        ({"attention_bias": True}, "attention_bias"), ({"hidden_act": "gelu"}, "hidden_act")):
    with pytest.raises(ValueError, match=field) as e:
      hf_lib.family_module("llama").config_from_hf(hf | change)
    assert "\n" not in str(e.value)


def test_generate_matches_transformers(gqa):
  hf, m, p = gqa
  check_generate(m, p, hf)


def test_kv_cache_holds_the_kv_heads_only(gqa):
  """The cache the model builds, and the one plan/memory counts, is num_kv_heads / num_heads of multi-head's."""
  _, m, p = gqa
  mha = m.copy_and_resolve_references()
  mha.num_kv_heads = 0
  batch = {"input_ids": jnp.zeros((3, 5), jnp.int32)}
  size = lambda cfg: sum(x.size for layer in models.init_cache(cfg, p, batch, 16)["layers"] for x in layer.values())
  assert size(m) * 2 == size(mha) == 2 * 2 * 3 * 4 * 16 * 8
  assert memory.kv_cache_bytes(m, 3, 16) * 2 == memory.kv_cache_bytes(mha, 3, 16) == 4 * size(mha)


@pytest.mark.parametrize("file", ["llama", "qwen3"])
def test_flops_count_the_real_model(file):
  """The family's FLOP count (K and V at the kv heads' width, a gated MLP, the head, a classifier) = every matmul
  in the forward pass of the unscanned tiny model, read off its jaxpr."""
  m, L = layers.replace(config_lib.load(f"configs/{file}.py:tiny").model, num_labels=3), 32
  forward = lambda p, b: [out[key] for out in [models.apply(m, p, b)] for key in ("logits", "scores")]
  ids = jax.ShapeDtypeStruct((2, L), jnp.int32)
  counted = _matmul_flops(jax.make_jaxpr(forward)(models.abstract_params(m), dict(input_ids=ids)).jaxpr)
  assert 2 * models.forward_flops(m, flops.Lengths(L, 0, L)) == counted   # 2 rows


# ------------------------------------------------------------------------------------------------------- mesh
MESH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from lm_jax import config_lib, train
    losses = {{}}
    for mesh in ((1, 1, 1), (2, 2, 2)):
      fields = dict({fields!r}, **dict(zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), mesh)))
      config = config_lib.load("configs/llama.py:tiny", fields)
      train.train(config, {work!r} + "x".join(map(str, mesh)), devices=jax.devices()[:mesh[0] * mesh[1] * mesh[2]])
      rows = [json.loads(line) for line in open({work!r} + "x".join(map(str, mesh)) + "/metrics.jsonl")]
      losses["x".join(map(str, mesh))] = [[r["loss"], r["grad_norm"]] for r in rows if "loss" in r]
    print("RESULT" + json.dumps(losses))
""")


def test_gqa_on_a_mesh_equals_one_device(toy, tmp_path):
  """Query heads split over tensor=2 with their kv heads (2 of 4), examples over data x fsdp: the same loss and
  grad norm as one device at every step."""
  fields = {**TINY, "data.tokenizer": toy["tokenizer"], "data.files": toy["text"], "batch_size": 8}
  script = MESH_SCRIPT.format(fields=fields, work=str(tmp_path / "run"))
  run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                                                       "--xla_backend_optimization_level=0"})
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  assert len(out["1x1x1"]) == 3
  assert np.allclose(out["2x2x2"], out["1x1x1"], rtol=1e-5, atol=0), out


# ----------------------------------------------------------------------------------------------- a tiny run
TINY = {"model.d_model": 32, "model.num_heads": 4, "model.num_kv_heads": 2, "model.d_ff": 64, "model.num_layers": 1,
        "model.vocab_size": 64, "model.max_positions": 64, "data.seq_len": 32, "batch_size": 4, "total_steps": 3,
        "log_every": 1, "eval_every": 0, "checkpoint_every": 1, "optimizer.warmup_steps": 1}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """Toy instruction / preference files, their text as one file, and one tokenizer for all runs."""
  out = tmp_path_factory.mktemp("toy")
  paths = toy_tasks.write_toy(str(out), train=64, dev=8, tasks=("reverse",), length=(4, 4))
  lines = [json.loads(line)["text"] for name in sorted(os.listdir(out)) for line in open(out / name)]
  (out / "text.txt").write_text("\n".join(lines) + "\n")
  (out / "toy.model").write_bytes(tokenizer_lib.train(lines, family=models.family("llama"), vocab_size=64))
  return dict(paths, text=str(out / "text.txt"), tokenizer=str(out / "toy.model"))


def _losses(workdir):
  return [r["loss"] for r in metrics_log.read(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def clm_run(toy, tmp_path_factory):
  """configs/llama.py:tiny stopped after step 1, then resumed to step 3 from the command line; the same run
  uninterrupted. -> (workdir, its config, the uninterrupted run's losses)."""
  fields = {**TINY, "data.tokenizer": toy["tokenizer"], "data.files": toy["text"]}
  config = config_lib.load("configs/llama.py:tiny", fields)
  workdir, whole = (str(tmp_path_factory.mktemp(name)) for name in ("clm", "whole"))
  train.train(config_lib.load("configs/llama.py:tiny", {**fields, "phase_end_step": 1}), workdir)
  run = cli("--config=configs/llama.py:tiny", *[f"--config.{k}={v}" for k, v in fields.items()],
            f"--workdir={workdir}")
  assert run.returncode == 0, run.stderr[-3000:]
  train.train(config, whole)
  return workdir, config, _losses(whole)


def test_clm_resumes_exactly(clm_run):
  workdir, _, whole = clm_run
  assert len(whole) == 3 and _losses(workdir) == whole


def test_export_runs_in_a_transformers_pipeline(clm_run, toy, tmp_path):
  """--mode=export's export (with the run's tokenizer) generates in transformers' pipeline as our decoding does."""
  workdir, config, _ = clm_run
  checkpoint_export.export_checkpoint(config, workdir, str(tmp_path))
  assert json.load(open(tmp_path / "config.json"))["architectures"] == ["LlamaForCausalLM"]
  generate = transformers.pipeline("text-generation", model=str(tmp_path))
  prompt = "reverse the letters"
  new = generate(prompt, max_new_tokens=6, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
  ids = tokenizer_lib.load(toy["tokenizer"], models.family("llama")).encode(prompt)
  assert new[:len(ids)] == ids and len(new) > len(ids)
  m, p = export.load_hf(str(tmp_path))
  assert decoding.generate(m, p, [ids], max_new_tokens=len(new) - len(ids)) == [new[len(ids):]]


def test_dpo_with_lora_starts_from_the_run(clm_run, toy, tmp_path):
  """DPO (a frozen reference) with LoRA adapters on the query / value projections, from the tiny clm run."""
  workdir, *_ = clm_run
  config = config_lib.load("configs/rlhf/dpo.py:tiny", {
      "model.family": "llama", "model.frozen_reference": False, "init_from": workdir, "rlhf.files": toy["preference"], "data.files": "", "data.tokenizer": toy["tokenizer"],
      "data.seq_len": 32, "batch_size": 4, "total_steps": 2, "log_every": 1, "eval_every": 0, "lora.rank": 4})
  params = jax.device_get(train.train(config, str(tmp_path))["state"]["params"])
  assert models.family(config.model).name == "llama"
  losses = _losses(str(tmp_path))
  assert len(losses) == 2 and np.all(np.isfinite(losses))
  adapters = {jax.tree_util.keystr(p): b for p, b in jax.tree_util.tree_leaves_with_path(params["lora"])}
  assert sorted(k.split("'")[-4] for k in adapters if k.endswith("['b']")) == ["query", "value"]   # layers_0's
  assert all(np.abs(b).max() > 0 for k, b in adapters.items() if k.endswith("['b']"))   # trained from B = 0

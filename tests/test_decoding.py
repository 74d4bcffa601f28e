"""decoding.generate and decoding.score against transformers on tiny random models with odd sizes (vocab 98,
d_model 36, 4 heads of 9): greedy and beam search token for token, on our exports and on a T5 saved by
transformers; sampled first tokens against the filtered softmax (chi-square); scores against transformers'
log-softmax; and T5's beam search with params sharded over an 8-device (data, fsdp, tensor) mesh.

Compiling dominates the time: every call here reuses one of few shapes (4 prompts, 8 new tokens, lengths
in the first bucket), and options that are traced (EOS, sampling knobs, length penalty, early stopping)
change between calls without recompiling."""
import json
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import REPO
from lm_jax import decoding, defaults, models
from lm_jax import hf as hf_lib
from lm_jax.hf import export

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
stats = pytest.importorskip("scipy.stats")

VOCAB, NEW = 98, 8
PROMPTS = [[5, 17, 33, 2, 60, 71, 9], [44, 3], [12, 90, 8, 27], [81]]   # GPT prompts / T5 encoder inputs
_RNG = np.random.default_rng(0)   # score pairs: random token ids, one bucket of lengths
CONTEXTS = [_RNG.integers(2, VOCAB, n).tolist() for n in (1, 12, 3, 11, 2)]
CONTINUATIONS = [_RNG.integers(2, VOCAB, n).tolist() for n in (4, 1, 13, 2, 7)]


def tiny(family, **fields):
  m = defaults.model_defaults(family)
  m.update(dict(vocab_size=VOCAB, d_model=36, num_layers=2, num_heads=4, head_dim=9, d_ff=4 * 36, max_positions=40,
                layer_norm_eps=1e-5, dropout_rate=0.0, attention_dropout_rate=0.0) | fields)
  return m


def random_params(m, seed=0):
  """N(0, 0.3^2) tensors, norm scales 1 + N(0, 0.3^2), drawn in numpy (no compile): far enough from the init
  (zero biases, unit norms, near-uniform logits) that a mapping bug would show."""
  rng = np.random.default_rng(seed)
  draw = lambda path, a: (0.3 * rng.standard_normal(a.shape) + path[-1].key.endswith("scale")).astype(np.float32)
  return jax.tree_util.tree_map_with_path(draw, models.abstract_params(m))


def exported(family, path):
  """(our config, our params, the transformers model loaded from our export)."""
  m = tiny(family)
  p = random_params(m)
  export.save_hf(m, p, path)
  cls = getattr(transformers, hf_lib.family_module(family).ARCHITECTURE)
  hf = cls.from_pretrained(path, dtype=torch.float32).eval()
  return m, p, hf


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
  return exported("gpt", str(tmp_path_factory.mktemp("gpt")))


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
  return exported("t5", str(tmp_path_factory.mktemp("t5")))


@pytest.fixture(scope="module")
def t5_from_transformers(tmp_path_factory):
  """A v1.1-style T5 (gated GELU, untied head, 3 encoder / 2 decoder layers) made and saved by transformers."""
  torch.manual_seed(0)
  config = transformers.T5Config(vocab_size=VOCAB, d_model=36, d_kv=10, d_ff=52, num_layers=3, num_decoder_layers=2,
                                 num_heads=3, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                 relative_attention_num_buckets=8, relative_attention_max_distance=20,
                                 dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
  hf = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():
    for t in hf.parameters():
      t.add_(0.3 * torch.randn_like(t))
  path = tmp_path_factory.mktemp("t5_hf")
  hf.save_pretrained(path, safe_serialization=True)
  m, p = export.load_hf(str(path))
  return m, p, hf


def hf_generate(hf, family, prompts, eos_id, **kw):
  """transformers' continuations, cut after the first EOS. GPT: one prompt at a time, since transformers'
  OpenAIGPT takes no position ids in generate and would shift a left-padded row's positions; T5: one padded
  batch with its attention mask, as a tokenizer makes it."""
  kw = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": eos_id, "pad_token_id": 0, **kw}
  if family == "gpt":
    with torch.no_grad():
      out = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw)[0, len(p):]
             for p in prompts]
  else:
    ids = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    for i, p in enumerate(prompts):
      ids[i, :len(p)] = p
    with torch.no_grad():
      out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor((ids > 0).astype(np.int64)), **kw)[:, 1:]
  rows = [o.tolist() for o in out]
  return [r[:r.index(eos_id) + 1] if eos_id in r else r for r in rows]


def check_against_transformers(m, p, hf, family):
  """Greedy and 4-beam search equal transformers' for prompts of different lengths; EOS is a token the greedy
  decoding emits early, so some rows stop early and others run to max_new_tokens."""
  free = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW)
  assert [len(r) for r in free] == [NEW] * len(PROMPTS)
  eos = free[0][2]
  greedy = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, eos_id=eos)
  assert greedy == hf_generate(hf, family, PROMPTS, eos)
  assert greedy[0] == free[0][:free[0].index(eos) + 1] and min(map(len, greedy)) < NEW == max(map(len, greedy))
  beam = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, method="beam", num_beams=4, eos_id=eos)
  assert beam == hf_generate(hf, family, PROMPTS, eos, num_beams=4, length_penalty=1.0, early_stopping=True)
  assert beam != greedy
  return eos


def test_gpt_matches_transformers(gpt):
  check_against_transformers(*gpt, "gpt")


def test_t5_matches_transformers(t5):
  m, p, hf = t5
  eos = check_against_transformers(m, p, hf, "t5")
  # a length penalty and the other early-stopping rules (traced options: no new compile)
  for early_stopping in (False, "never"):
    kw = dict(max_new_tokens=NEW, method="beam", num_beams=4, eos_id=eos, length_penalty=0.5)
    ours = decoding.generate(m, p, PROMPTS, early_stopping=early_stopping, **kw)
    hf_kw = dict(num_beams=4, length_penalty=0.5, early_stopping=early_stopping)
    assert ours == hf_generate(hf, "t5", PROMPTS, eos, **hf_kw), early_stopping


def test_t5_from_transformers_matches(t5_from_transformers):
  check_against_transformers(*t5_from_transformers, "t5")


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_longer_generations_grow_the_cache(family, request):
  """24 new tokens: the token loop starts on a shorter cache and moves to the full one part-way (GPT: 24 then 39
  slots, T5: 16 then 24), and greedy and beam search still equal transformers' token for token."""
  m, p, hf = request.getfixturevalue(family)
  assert decoding._cache_lengths(16 if family == "gpt" else 1, 24) == ((24, 39) if family == "gpt" else (16, 24))
  for kw in (dict(), dict(num_beams=4, length_penalty=1.0, early_stopping=True)):
    ours = decoding.generate(m, p, PROMPTS, max_new_tokens=24, method="beam" if kw else "greedy", **kw)
    assert ours == hf_generate(hf, family, PROMPTS, None, max_new_tokens=24, **kw)


def test_decode_step_updates_the_cache_in_place(gpt):
  """A compiled decode step (cache donated) neither copies nor transposes anything a layer's cache in size:
  each layer's keys / values are written where they lie and read by the attention's dots in their layout."""
  m, p, _ = gpt
  cache = models.init_cache(m, p, {"input_ids": np.zeros((8, 16), np.int32)}, 32)
  step = jax.jit(lambda p, c, t: models.decode_step(m, p, t, c, positions=t), donate_argnums=1)
  hlo = step.lower(p, cache, jax.ShapeDtypeStruct((8, 1), np.int32)).compile().as_text()
  layer_cache = 8 * 32 * 36   # rows x slots x heads * head_dim
  big = [line for line in hlo.splitlines()
         if re.search(r"\b(copy|transpose)\(", line) and np.prod(hlo_shape(line)) >= layer_cache]
  assert not big, big[:3]


@pytest.mark.parametrize("features,axes,x_shape", [((144,), ("embed", "mlp"), (3, 2, 36)),
                                                   ((4, 9), ("embed", "heads", "kv"), (3, 2, 36)),
                                                   ((36,), ("heads", "kv", "embed"), (3, 2, 4, 9))])
def test_output_major_kernels_give_the_same_products(features, axes, x_shape):
  """A Dense reading relayout.output_major's copy (axes reversed) computes what it computes from the trained kernel,
  for a plain, a multi-output (query) and a multi-input (attention out) kernel, looped or in a scanned stack."""
  from lm_jax.models import layers, relayout
  dense = layers.Dense(features, axes)
  x = jax.random.normal(jax.random.key(1), x_shape)
  params = nn.unbox(dense.init(jax.random.key(0), x)["params"])
  params["bias"] = params["bias"] + 0.5
  want = dense.apply({"params": params}, x)
  got = dense.apply({"params": relayout.output_major(params)}, x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  stacked = relayout.output_major({"layers": jax.tree.map(lambda a: np.stack([a, 2 * a]), params)})["layers"]
  np.testing.assert_array_equal(stacked["kernel_t"][1], 2 * relayout.output_major(params)["kernel_t"])


def test_generate_streams_output_major_kernels_without_copying_them(gpt):
  """On a CPU generate prepares the output-major copy once per params (a second call with the same params reuses
  it) and its compiled program copies or transposes no kernel: XLA lays an in-program transpose out as the
  original and copies it back every step (found that way), which is why the copy is made outside."""
  m, p, _ = gpt
  p = jax.device_put(p)   # device arrays: numpy leaves could change in place, so they are prepared anew each call
  decoding.generate(m, p, PROMPTS[:1], max_new_tokens=2)
  prepared = decoding._prepared[0][1]
  decoding.generate(m, p, PROMPTS[:1], max_new_tokens=2)
  assert decoding._prepared[0][1] is prepared and "kernel_t" in prepared["layers_0"]["mlp"]["wi"]
  ids, mask = decoding._pad(PROMPTS, 16, 0, left=True)
  opts = decoding._Options(False, NEW, decoding._cache_lengths(16, NEW), 1)
  knobs = decoding._Knobs(*(np.asarray(v) for v in (-1, 0, False, 1, 1.0, 0, 1.0)), np.ones(NEW, np.float32))
  hlo = decoding._generate.lower(models.layers.frozen(m), opts, prepared, ids, mask, jax.random.key(0),
                                 knobs).compile().as_text()
  kernels = {tuple(sorted(x.shape)) for x in jax.tree.leaves(p) if x.ndim >= 2}   # in any order of their axes
  moved = [line for line in hlo.splitlines()
           if re.search(r"\b(copy|transpose)\(", line) and tuple(sorted(hlo_shape(line))) in kernels]
  assert not moved, moved[:3]


def hlo_shape(line: str) -> list[int]:
  """The result dims of an HLO instruction line."""
  dims = re.search(r"= \w+\[([\d,]*)\]", line)
  return [int(d) for d in dims.group(1).split(",") if d] if dims else []


def test_generate_errors(gpt):
  m, p, _ = gpt
  with pytest.raises(ValueError, match="exceeds model.max_positions=40 by 1"):
    decoding.generate(m, p, [[1] * 34], max_new_tokens=NEW)
  with pytest.raises(ValueError, match=r"prompts_ids\[1\] has token ids outside \[0, model.vocab_size=98\)"):
    decoding.generate(m, p, [[1], [98]], max_new_tokens=NEW)
  with pytest.raises(ValueError, match="unknown decoding method 'topk'"):
    decoding.generate(m, p, [[1]], max_new_tokens=NEW, method="topk")
  with pytest.raises(ValueError, match="sampling needs temperature > 0"):
    decoding.generate(m, p, [[1]], max_new_tokens=NEW, method="sample", temperature=0.0)


# ------------------------------------------------------------------------------------------------- sampling
def filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
  """The distribution sampling should follow, written independently in float64 numpy."""
  z = logits.astype(np.float64) / temperature
  keep = np.ones_like(z, bool)
  if top_k:
    keep &= z >= np.sort(z)[-top_k]
  probs = np.where(keep, np.exp(z - z.max()), 0.0)
  probs /= probs.sum()
  order = np.argsort(-probs)
  n = np.searchsorted(np.cumsum(probs[order]), top_p) + 1   # smallest prefix with mass >= top_p
  keep[order[n:]] = False
  probs = np.where(keep, probs, 0.0)
  return probs / probs.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.0, 6, 1.0), (1.0, 0, 0.7), (1.5, 12, 0.9)])
def test_sampling_follows_filtered_softmax(gpt, temperature, top_k, top_p):
  m, p, hf = gpt
  prompt, draws = PROMPTS[0], 4096
  with torch.no_grad():
    logits = hf(torch.tensor([prompt])).logits[0, -1].numpy()
  expected = filtered_probs(logits, temperature, top_k, top_p)
  assert 3 <= np.count_nonzero(expected) < VOCAB or (top_k, top_p) == (0, 1.0)
  kw = dict(max_new_tokens=2, method="sample", temperature=temperature, top_k=top_k, top_p=top_p)
  tokens = np.array(decoding.generate(m, p, [prompt] * draws, seed=0, **kw))
  counts = np.bincount(tokens[:, 0], minlength=VOCAB)
  assert counts[expected == 0].sum() == 0   # never a filtered token
  # chi-square over the kept tokens, those expected fewer than 5 times merged into one bin
  common, rare = expected * draws >= 5, (expected > 0) & (expected * draws < 5)
  observed, wanted = counts[common], expected[common] * draws
  if rare.any():
    observed, wanted = np.append(observed, counts[rare].sum()), np.append(wanted, expected[rare].sum() * draws)
  assert stats.chisquare(observed, wanted).pvalue > 1e-3
  if top_k and top_p < 1:   # reproducible: the seed fixes every token
    assert np.array_equal(tokens, decoding.generate(m, p, [prompt] * draws, seed=0, **kw))
    assert not np.array_equal(tokens, decoding.generate(m, p, [prompt] * draws, seed=1, **kw))


# --------------------------------------------------------------------------------------------------- score
def hf_score(hf, family, context, continuation):
  """Summed log-softmax of the continuation and its greedy flag, from transformers' logits."""
  with torch.no_grad():
    if family == "gpt":
      logits = hf(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1]
    else:
      decoder = torch.tensor([[hf.config.decoder_start_token_id] + continuation[:-1]])
      logits = hf(input_ids=torch.tensor([context]), decoder_input_ids=decoder).logits[0]
  logprobs = torch.log_softmax(logits.double(), -1).numpy()
  return logprobs[np.arange(len(continuation)), continuation].sum(), bool(np.all(logprobs.argmax(-1) == continuation))


@pytest.mark.parametrize("family", ["gpt", "t5"])
def test_score_matches_transformers(family, request):
  m, p, hf = request.getfixturevalue(family)
  greedy = decoding.generate(m, p, PROMPTS, max_new_tokens=NEW)   # compiled already
  contexts, continuations = PROMPTS + CONTEXTS, greedy + CONTINUATIONS
  logprob, is_greedy = decoding.score(m, p, contexts, continuations, batch_size=4)
  expected = [hf_score(hf, family, c, x) for c, x in zip(contexts, continuations)]
  np.testing.assert_allclose(logprob, [e[0] for e in expected], atol=1e-4, rtol=0)
  assert is_greedy.tolist() == [e[1] for e in expected]
  assert is_greedy[:len(PROMPTS)].all() and not is_greedy[len(PROMPTS):].all()


def test_score_errors(gpt):
  m, p, _ = gpt
  with pytest.raises(ValueError, match=r"continuations\[0\] is empty"):
    decoding.score(m, p, [[1]], [[]])
  with pytest.raises(ValueError, match="context \\+ continuation 0 has 42 tokens; GPT reads at most"):
    decoding.score(m, p, [[1] * 40], [[2, 3]])


# ---------------------------------------------------------------------------------------------------- mesh
MESH_SCRIPT = """
import json
import jax
from flax import linen as nn
from lm_jax import decoding, defaults, models, sharding
from lm_jax.hf import export

config = defaults.base_config()
config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
mesh, rules = sharding.make_mesh(config), sharding.RULES
out = dict()
for name, path in {paths!r}.items():
  m, params = export.load_hf(path)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    params = jax.device_put(params, sharding.logical_to_sharding(models.logical_axes(m), mesh, rules))
    out[name] = dict((method, decoding.generate(m, params, {prompts!r}, max_new_tokens={new}, method=method))
                     for method in decoding.METHODS)
  out[name + "_embedding"] = list(params[{embedding!r}[name]]["embedding"].sharding.spec)
print("RESULT" + json.dumps(out))
"""


def test_mesh_matches_single_device(gpt, t5):
  """With params sharded over a (2, 2, 2) mesh as the trainer shards them (embeddings over (tensor, fsdp)),
  the rows and beams over data x fsdp, greedy decoding, sampling and beam search (T5: encoder, cross-attention
  cache; beam reordering, top-k over the sharded vocabulary) give the single-device tokens. One process: compiling
  for 8 devices is slow."""
  paths = {"gpt": gpt[2].name_or_path, "t5": t5[2].name_or_path}
  embedding = {"gpt": "word_embeddings", "t5": "shared"}
  script = MESH_SCRIPT.format(paths=paths, prompts=PROMPTS, new=NEW, embedding=embedding)
  run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                            "JAX_PLATFORMS": "cpu"})
  assert run.returncode == 0, run.stderr[-3000:]
  out = json.loads(run.stdout.split("RESULT")[-1])
  for name, (m, p, _) in (("gpt", gpt), ("t5", t5)):
    assert out[name + "_embedding"] == ["tensor", "fsdp"]
    for method in decoding.METHODS:
      assert out[name][method] == decoding.generate(m, p, PROMPTS, max_new_tokens=NEW, method=method), (name, method)

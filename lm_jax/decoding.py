"""Text generation (greedy, sampling, beam search) on the models' KV cache, and continuation scoring.

`generate` pads the prompts, then one jitted program feeds them in a single decode_step (the prefill) and runs the
token loop in `lax.while_loop`, stopping as soon as every row is done. A token step reads every weight once, so
its floor is the time to stream the weights and the filled cache from memory (bench/README.md, decode.py): each
layer's cache is its own loop-carried buffer in the attention's layout, written in place (attention.write_cache);
scanned params are split into layers once per call; the cache starts a bucket above the prompt and doubles, so
the attention reads little more than the filled slots; beam search gathers only the self-attention keys / values.
On a CPU the loop reads output-major copies of the kernels (relayout.output_major, kept for the params of the last
call), which XLA's few-row products stream faster than the trained layout.

What a prompt is depends on the family's layout (lm_jax.models.family): a decoder's (GPT) prompts are left-padded
with their positions counted from each row's first real token, so a row decodes exactly as it would alone; an
encoder-decoder's (T5) are the encoder input (right-padded, masked) and the decoder starts from
model.decoder_start_token_id.
Beam search follows transformers' beam search (GenerationMixin._beam_search): 2 * num_beams candidates per
step, a hypothesis' score is its summed log-probability / (generated length incl. EOS) ** length_penalty,
early_stopping True / False / "never" as there; its results are token-identical to transformers' `generate`.
Sampling applies temperature, top-k and top-p in that order, as transformers' logits warpers do.

`score` gives the summed log-probability of each continuation given its context and whether greedy decoding
would produce it: lm-evaluation-harness' loglikelihood requests.

Both run under a mesh like the train step: call them inside `jax.set_mesh(mesh)` and
`nn.logical_axis_rules(rules)` with params placed by the trainer's shardings; the models' logical
constraints then spread the rows (and beams) over the data axes, and the results come back replicated. Prompt
and sequence lengths are rounded up to a few bucket sizes, so new lengths rarely recompile (a new number of
prompts, max_new_tokens or num_beams does).
"""
import functools
import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lm_jax import models
from lm_jax.models import layers, relayout

METHODS = ("greedy", "sample", "beam")
_NEG = -1.0e9                            # transformers' score for excluded beams and hypotheses


def _bucket(n: int) -> int:
  """n rounded up to 16, 24, 32, 48, 64, 96, ...: at most a third of padding, few distinct shapes."""
  size = 16
  while size < n:
    size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
  return size


def _check_ids(kind: str, rows, vocab_size: int) -> None:
  for i, row in enumerate(rows):
    if len(row) == 0:
      raise ValueError(f"{kind}[{i}] is empty")
    if min(row) < 0 or max(row) >= vocab_size:
      raise ValueError(f"{kind}[{i}] has token ids outside [0, model.vocab_size={vocab_size})")


def _pad(rows, width: int, pad_id: int, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Token lists -> (ids (N, width) int32, mask (N, width) int32), padded on the right or left."""
  ids, mask = np.full((len(rows), width), pad_id, np.int32), np.zeros((len(rows), width), np.int32)
  for i, row in enumerate(rows):
    cols = slice(width - len(row), width) if left else slice(0, len(row))
    ids[i, cols], mask[i, cols] = row, 1
  return ids, mask


# --------------------------------------------------------------------------------------------- decoder state
def _start(cfg, params, ids, mask, cache_len: int):
  """Feeds the prompts -> (logits of each row's first new token (B, V), decoder state)."""
  if models.family(cfg).layout == "decoder":
    cache = models.init_cache(cfg, params, {"input_ids": ids}, cache_len)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    logits, cache = models.decode_step(cfg, params, ids, cache, mask, positions)
    return logits[:, -1], {"cache": cache, "position": positions[:, -1] + 1}
  cache = models.init_cache(cfg, params, {"input_ids": ids, "attention_mask": mask}, cache_len)
  start = jnp.full((ids.shape[0], 1), cfg.decoder_start_token_id, jnp.int32)
  logits, cache = models.decode_step(cfg, params, start, cache)
  return logits[:, -1], {"cache": cache}


def _feed(cfg, params, tokens, state):
  """One new token per row (B,) -> (logits of the next one (B, V), state)."""
  if models.family(cfg).layout == "decoder":
    logits, cache = models.decode_step(cfg, params, tokens[:, None], state["cache"],
                                       positions=state["position"][:, None])
    return logits[:, -1], {"cache": cache, "position": state["position"] + 1}
  logits, cache = models.decode_step(cfg, params, tokens[:, None], state["cache"])
  return logits[:, -1], {"cache": cache}


def _take_rows(state, rows):
  """The decoder state (every array has the rows on axis 0) of rows `rows`."""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, rows, axis=0), state)


def _reorder_beams(state, rows):
  """Beam search's per-step reordering: only the self-attention keys/values differ between the beams of a row
  and change as they decode (the filled-slot mask, positions and the encoder's keys/values are the row's), so only
  they are gathered, one copy of each layer's buffers."""
  caches = tuple({**c, "k": jnp.take(c["k"], rows, axis=0), "v": jnp.take(c["v"], rows, axis=0)}
                 for c in state["cache"]["layers"])
  return {**state, "cache": {**state["cache"], "layers": caches}}


def _cache_lengths(filled: int, max_new_tokens: int) -> tuple[int, ...]:
  """The cache's length for each stretch of token steps: the attention reads every slot of the cache, filled or
  not, so it starts at a bucket above the prompt and doubles (one copy into the longer cache each time) while
  that saves at least a quarter of the full length's slots; the last is the full length. `filled`: the slots
  the prompt fills, each token step but the last feeds one more."""
  full = filled + max_new_tokens - 1
  lengths, size = [], _bucket(filled + 1)
  while 4 * size <= 3 * full:
    lengths.append(size)
    size *= 2
  return tuple(lengths) + (full,)


def _last_steps(opts) -> list[int]:
  """Per cache length, the last token step (steps count from 1, see _sample_loop) it has a slot for."""
  filled = opts.cache_lengths[-1] - opts.max_new_tokens + 1
  return [length - filled for length in opts.cache_lengths]


def _grow(state, length: int):
  """The decoder state with its self-attention cache padded with empty slots to `length`."""
  cache = state["cache"]
  pad = lambda x, axis: jnp.pad(x, [(0, length - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])
  caches = tuple({**c, "k": pad(c["k"], 2), "v": pad(c["v"], 2)} for c in cache["layers"])
  return {**state, "cache": {**cache, "layers": caches, "mask": pad(cache["mask"], 1)}}


# ----------------------------------------------------------------------------------------- greedy, sampling
def _filter_logits(logits, temperature, top_k, top_p):
  """transformers' warpers in their order: logits / temperature; top-k keeps the k largest (and ties with
  the k-th; 0 = off); top-p keeps the most probable tokens until their mass exceeds top_p (at least one).
  Filtered logits become -inf."""
  logits = logits / temperature
  desc = -jnp.sort(-logits, axis=-1)
  kth = jnp.take(desc, jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=-1)[..., None]
  off = lambda x: (top_k > 0) & (x < kth)
  logits, desc = jnp.where(off(logits), -jnp.inf, logits), jnp.where(off(desc), -jnp.inf, desc)
  mass_below = jnp.cumsum(jax.nn.softmax(desc, axis=-1)[..., ::-1], axis=-1)[..., ::-1]   # of this and less likely
  keep = jnp.maximum(jnp.sum(mass_below > 1 - top_p, axis=-1, keepdims=True), 1)
  return jnp.where(logits < jnp.take_along_axis(desc, keep - 1, axis=-1), -jnp.inf, logits)


def _sample_loop(cfg, opts, knobs, params, ids, mask, key):
  """Greedy or sampled decoding -> tokens (B, max_new_tokens), pad_id after EOS."""
  logits, state = _start(cfg, params, ids, mask, opts.cache_lengths[0])
  n = opts.max_new_tokens

  def sample(logits, t):
    filtering = (knobs.top_k > 0) | (knobs.top_p < 1)   # else skip the sort over the vocabulary
    logits = jax.lax.cond(filtering, lambda x: _filter_logits(x, knobs.temperature, knobs.top_k, knobs.top_p),
                          lambda x: x / knobs.temperature, logits)
    return jax.random.categorical(jax.random.fold_in(key, t), logits).astype(jnp.int32)

  def choose(logits, t, done):
    greedy = lambda logits, t: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(done, knobs.pad_id, jax.lax.cond(knobs.sample, sample, greedy, logits, t))

  first = choose(logits, 0, jnp.zeros(ids.shape[0], bool))
  tokens = jnp.full((ids.shape[0], n), knobs.pad_id, jnp.int32).at[:, 0].set(first)

  def body(carry):
    t, tokens, done, state = carry
    logits, state = _feed(cfg, params, tokens[:, t - 1], state)
    token = choose(logits, t, done)
    return t + 1, jax.lax.dynamic_update_index_in_dim(tokens, token, t, 1), done | (token == knobs.eos_id), state

  carry = (jnp.int32(1), tokens, first == knobs.eos_id, state)
  for j, last in enumerate(_last_steps(opts)):
    if j:
      carry = carry[:3] + (_grow(carry[3], opts.cache_lengths[j]),)
    cond = lambda carry, last=last: (carry[0] < n) & (carry[0] <= last) & ~jnp.all(carry[2])
    carry = jax.lax.while_loop(cond, body, carry)
  return carry[1]


# -------------------------------------------------------------------------------------------------- beams
def _gather(x, index):
  """x (B, M, ...) at index (B, K) along axis 1 -> (B, K, ...)."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def _beam_search(cfg, opts, knobs, params, ids, mask):
  """transformers' beam search -> the best finished hypothesis per row (B, max_new_tokens)."""
  logits, state = _start(cfg, params, ids, mask, opts.cache_lengths[0])
  b, k, n, v = ids.shape[0], opts.num_beams, opts.max_new_tokens, logits.shape[-1]
  state = _take_rows(state, jnp.repeat(jnp.arange(b), k))   # the prompt is fed once per row, then copied
  penalty = knobs.penalty

  def select(c, logits):
    """One step: extend the running beams, move the ones that end (EOS or max length) to the finished set."""
    t = c["t"]
    scores = jax.nn.log_softmax(logits).reshape(b, k, v) + c["running_scores"][..., None]
    top_scores, top = jax.lax.top_k(scores.reshape(b, k * v), 2 * k)
    parent, token = top // v, (top % v).astype(jnp.int32)
    top_seqs = jax.lax.dynamic_update_index_in_dim(_gather(c["running"], parent), token, t, 2)
    ends = (token == knobs.eos_id) | (t + 1 >= n)
    alive = top_scores + _NEG * ends
    _, keep = jax.lax.top_k(alive, k)
    # finished: only the k best candidates may end, and not once the row is full (early_stopping=True) or
    # can no longer improve
    full = jnp.all(c["finished"], axis=1, keepdims=True) & (knobs.early_stopping == 1)
    ended = ends & (jnp.arange(2 * k) < k)
    final = top_scores / penalty[t] + _NEG * (full | ~c["improvable"]) + _NEG * ~ended
    merged_scores = jnp.concatenate([c["scores"], final], axis=1)
    _, best = jax.lax.top_k(merged_scores, k)
    new = dict(t=t + 1, running=_gather(top_seqs, keep), running_scores=_gather(alive, keep),
               parent=_gather(parent, keep), scores=_gather(merged_scores, best),
               seqs=_gather(jnp.concatenate([c["seqs"], top_seqs], axis=1), best),
               finished=_gather(jnp.concatenate([c["finished"], ended], axis=1), best))
    # can a running beam still beat the worst finished hypothesis? (transformers' early-stop heuristic)
    # transformers: with early_stopping="never" and a positive length_penalty, the longest length is the best
    longest = (knobs.early_stopping == 2) & (penalty[n - 1] > penalty[0])
    best_possible = new["running_scores"][:, :1] / jnp.where(longest, penalty[n - 1], penalty[t])
    worst = jnp.where(new["finished"], jnp.min(new["scores"], axis=1, keepdims=True), _NEG)
    new["improvable"] = c["improvable"] & jnp.any(best_possible > worst, axis=1, keepdims=True)
    all_full = jnp.all(new["finished"]) & (knobs.early_stopping == 1)
    new["go"] = jnp.any(new["improvable"]) & ~all_full & ~jnp.all(ends)
    return new

  def body(carry):
    c, state = carry
    state = _reorder_beams(state, (jnp.arange(b)[:, None] * k + c["parent"]).reshape(-1))
    logits, state = _feed(cfg, params, c["running"][:, :, c["t"] - 1].reshape(-1), state)
    return select(c, logits), state

  empty = jnp.full((b, k, n), knobs.pad_id, jnp.int32)
  c = dict(t=jnp.int32(0), running=empty, running_scores=jnp.zeros((b, k)).at[:, 1:].set(_NEG), seqs=empty,
           scores=jnp.full((b, k), _NEG), finished=jnp.zeros((b, k), bool), improvable=jnp.ones((b, 1), bool))
  carry = (select(c, jnp.repeat(logits, k, axis=0)), state)
  for j, last in enumerate(_last_steps(opts)):
    if j:
      carry = (carry[0], _grow(carry[1], opts.cache_lengths[j]))
    carry = jax.lax.while_loop(lambda carry, last=last: carry[0]["go"] & (carry[0]["t"] <= last), body, carry)
  return carry[0]["seqs"][:, 0]


# ------------------------------------------------------------------------------------------------ generate
def _decoder_layout(cfg, what: str) -> str:
  """The family's layout, 'decoder' or 'encoder_decoder'; a one-line ValueError for an encoder."""
  fam = models.family(cfg)
  if fam.layout not in ("decoder", "encoder_decoder"):
    raise ValueError(f"{what} needs a decoder, got model.family={fam.name!r} (an {fam.layout})")
  return fam.layout


class _Options(NamedTuple):   # static: a change recompiles
  beam: bool
  max_new_tokens: int
  cache_lengths: tuple      # the cache's length in each stretch of steps (see _cache_lengths)
  num_beams: int


class _Knobs(NamedTuple):   # traced: a change does not recompile
  eos_id: jax.Array          # -1: none
  pad_id: jax.Array
  sample: jax.Array          # bool; False: greedy
  early_stopping: jax.Array  # 0: False, 1: True, 2: "never"
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  penalty: jax.Array         # (max_new_tokens,) generated length ** length_penalty


_output_major = jax.jit(relayout.output_major)
_prepared: list = []   # at most one entry: (weak references to the last params' leaves, their output-major form)


def _decoding_params(params):
  """On a CPU, params with output-major kernels (relayout.output_major), kept for the last params seen: a caller
  that generates again with the same params (batches of prompts, lm-eval's requests) does not copy the weights
  again. One copy is kept until generate runs with other params."""
  leaves = jax.tree.leaves(params)
  if not all(isinstance(x, jax.Array) for x in leaves):   # a numpy leaf may change in place: no reuse
    return _output_major(params)
  if _prepared:
    refs, prepared = _prepared[0]
    if len(refs) == len(leaves) and all(r() is x for r, x in zip(refs, leaves)):
      return prepared
  _prepared.clear()   # the old copy goes before the new one is made
  prepared = _output_major(params)
  _prepared.append(([weakref.ref(x) for x in leaves], prepared))
  return prepared


@functools.partial(jax.jit, static_argnums=(0, 1))
def _generate(cfg, opts, params, ids, mask, key, knobs):
  cfg, params = relayout.unscanned(cfg, params)   # once, not per step
  if opts.beam:
    tokens = _beam_search(cfg, opts, knobs, params, ids, mask)
  else:
    tokens = _sample_loop(cfg, opts, knobs, params, ids, mask, key)
  is_eos = tokens == knobs.eos_id
  lengths = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, opts.max_new_tokens)
  return layers.constrain(tokens, (None, None)), layers.constrain(lengths, (None,))   # replicated: every host reads


def generate(model_cfg, params, prompts_ids, *, max_new_tokens: int, method: str = "greedy",
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, num_beams: int = 4,
             length_penalty: float = 1.0, early_stopping: bool | str = True, eos_id: int | None = None,
             pad_id: int = 0, seed: int = 0) -> list[list[int]]:
  """Continuations of token-id prompts (a decoder's: the text so far; an encoder-decoder's: the encoder input) -> per
  prompt its new tokens, up to and including eos_id (None: always max_new_tokens tokens).

  method: 'greedy', 'sample' (temperature, top_k (0 = off), top_p (1.0 = off), seed: the same seed gives the
  same tokens) or 'beam' (num_beams, length_penalty, early_stopping True / False / 'never' as in
  transformers). pad_id fills the prompts' padding and finished rows.
  """
  cfg = layers.frozen(model_cfg)
  layout = _decoder_layout(cfg, "generate")
  if method not in METHODS:
    raise ValueError(f"unknown decoding method {method!r}; known: {', '.join(METHODS)}")
  if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  if method == "sample" and not (temperature > 0 and top_k >= 0 and 0 < top_p <= 1):
    raise ValueError(f"sampling needs temperature > 0, top_k >= 0 and 0 < top_p <= 1, got {temperature}, {top_k}, "
                     f"{top_p}")
  if method == "beam" and not (num_beams >= 1 and early_stopping in (True, False, "never")):
    raise ValueError(f"beam search needs num_beams >= 1 and early_stopping True, False or 'never', got "
                     f"{num_beams}, {early_stopping!r}")
  prompts = [list(p) for p in prompts_ids]
  if not prompts:
    raise ValueError("generate: no prompts")
  _check_ids("prompts_ids", prompts, cfg.vocab_size)
  longest = max(map(len, prompts))
  if layout == "decoder":
    room = cfg.max_positions - max_new_tokens + 1   # the last new token is never fed
    if longest > room:
      raise ValueError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds "
                       f"model.max_positions={cfg.max_positions} by {longest - room}")
    width = min(_bucket(longest), room)
    filled = width   # slots the prompt fills; a token step then adds one
  else:
    width, filled = _bucket(longest), 1   # the decoder's start token
  ids, mask = _pad(prompts, width, pad_id, left=layout == "decoder")
  opts = _Options(method == "beam", max_new_tokens, _cache_lengths(filled, max_new_tokens),
                  num_beams if method == "beam" else 1)
  # length ** length_penalty in float64, rounded to float32, as transformers computes it
  penalty = (np.arange(1, max_new_tokens + 1, dtype=np.float64) ** length_penalty).astype(np.float32)
  knobs = _Knobs(np.int32(-1 if eos_id is None else eos_id), np.int32(pad_id), np.bool_(method == "sample"),
                 np.int32({False: 0, True: 1, "never": 2}[early_stopping]), np.float32(temperature),
                 np.int32(top_k), np.float32(top_p), penalty)
  if jax.default_backend() == "cpu":
    params = _decoding_params(params)
  tokens, lengths = _generate(cfg, opts, params, ids, mask, jax.random.key(seed), knobs)
  return [row[:length].tolist() for row, length in zip(np.asarray(tokens), np.asarray(lengths))]


# --------------------------------------------------------------------------------------------------- score
@functools.partial(jax.jit, static_argnums=0)
def _score_batch(cfg, params, inputs, targets, weights):
  logits = models.apply(cfg, params, inputs)["logits"]
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  logprob = picked - jax.nn.logsumexp(logits, axis=-1)
  greedy = (jnp.argmax(logits, axis=-1) == targets) | (weights == 0)
  return (layers.constrain(jnp.sum(logprob * weights, axis=1), (None,)),   # replicated: every host reads them
          layers.constrain(jnp.all(greedy, axis=1), (None,)))


def score(model_cfg, params, contexts, continuations, *, batch_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
  """log P(continuation | context) summed over the continuation's tokens (N,) float32, and whether each
  continuation is the greedy one, i.e. every token the argmax (N,) bool. contexts / continuations: lists of
  token-id lists. A decoder (GPT) reads context + continuation in one causal pass; an encoder-decoder (T5) encodes
  the context and scores the continuation as the decoder target after model.decoder_start_token_id. batch_size rows
  per forward pass."""
  cfg = layers.frozen(model_cfg)
  layout = _decoder_layout(cfg, "score")
  contexts, continuations = [list(c) for c in contexts], [list(c) for c in continuations]
  if len(contexts) != len(continuations):
    raise ValueError(f"score: {len(contexts)} contexts but {len(continuations)} continuations")
  _check_ids("contexts", contexts, cfg.vocab_size)
  _check_ids("continuations", continuations, cfg.vocab_size)
  if layout == "decoder":
    seqs = [c + x for c, x in zip(contexts, continuations)]
    for i, s in enumerate(seqs):
      if len(s) - 1 > cfg.max_positions:
        raise ValueError(f"score: context + continuation {i} has {len(s)} tokens; GPT reads at most "
                         f"model.max_positions + 1 = {cfg.max_positions + 1} (truncate the context on the left)")
    order = np.argsort([-len(s) for s in seqs], kind="stable")
  else:
    order = np.argsort([-len(c) - len(x) for c, x in zip(contexts, continuations)], kind="stable")
  logprob, greedy = np.zeros(len(contexts), np.float32), np.zeros(len(contexts), bool)
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    rows_padded = np.concatenate([rows, np.repeat(rows[:1], batch_size - len(rows))])   # one batch shape
    conts = [continuations[i] for i in rows_padded]
    if layout == "decoder":
      seq = [seqs[i] for i in rows_padded]
      width = min(_bucket(max(len(s) for s in seq) - 1), cfg.max_positions)
      ids, mask = _pad([s[:-1] for s in seq], width, cfg.pad_token_id)
      targets, weights = _pad([s[1:] for s in seq], width, cfg.pad_token_id)
      weights = np.stack([(np.arange(width) >= len(s) - 1 - len(x)) * w for s, x, w in zip(seq, conts, weights)])
      inputs = {"input_ids": ids, "attention_mask": mask}
    else:
      ids, mask = _pad([contexts[i] for i in rows_padded], _bucket(max(len(contexts[i]) for i in rows_padded)),
                       cfg.pad_token_id)
      width = _bucket(max(map(len, conts)))
      dec_ids, dec_mask = _pad([[cfg.decoder_start_token_id] + x[:-1] for x in conts], width, cfg.pad_token_id)
      targets, weights = _pad(conts, width, cfg.pad_token_id)
      inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec_ids,
                "decoder_attention_mask": dec_mask}
    lp, gr = _score_batch(cfg, params, inputs, targets, weights.astype(np.float32))
    logprob[rows], greedy[rows] = np.asarray(lp)[:len(rows)], np.asarray(gr)[:len(rows)]
  return logprob, greedy

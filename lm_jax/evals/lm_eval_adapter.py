"""lm-evaluation-harness tasks on the params a run holds in memory, no export: config.eval.lm_eval_tasks.

`JaxLM` (`jax_lm()`) is the harness' model interface (lm_eval.api.model.TemplateLM) over a decoder's params and the
run's tokenizer: loglikelihood requests go through lm_jax.decoding.score, loglikelihood_rolling through the same on the
harness' rolling windows, generate_until through decoding.generate. Requests become tokens as the harness' HFLM
makes them for an export (TemplateLM's context / continuation split, eos as the context of an empty one, left
truncation to model.max_positions, HFLM's stop sequences), so a task's numbers are those of `lm_eval --model hf` on
the export of the same step, within float tolerance (tests/test_lm_eval_train.py).

Task names are looked up in configs/lm_eval first (offline, data from $LM_JAX_DATA), then among the harness' own
tasks, whose index is only built when a name is not local (it takes seconds) and whose data come from the Hugging
Face Hub. Every process runs every request, as the model is sharded over all of them; the metrics are the same on
each and process 0 writes them. lm-eval (its core, which needs no PyTorch) is a dependency in requirements.txt;
it is imported when a run has tasks (`_lm_eval`), not at every start (1.1 s of CPU with Hugging Face datasets).
"""
import difflib
import functools
import logging

from lm_jax import config_lib, decoding, models, objectives, params as params_lib

TASKS_DIR = config_lib.REPO / "configs" / "lm_eval"
PREFIX = "lm_eval/"   # of the metrics in the eval records
MAX_GEN_TOKS = 256    # generate_until's length when a task names none (HFLM's)


def check(config):
  """ConfigError (one line) for config.eval fields a run cannot evaluate with, before anything is built."""
  e, family = config.eval, models.family(config.model)
  if not e.lm_eval_tasks:
    return
  if objectives.get(config.objective).rollouts:
    raise config_lib.ConfigError(f"config.eval.lm_eval_tasks: objective {config.objective!r} trains on rollouts "
                                 "(lm_jax.rlhf.ppo), whose loop runs no lm-eval tasks")
  if family.layout != "decoder":
    raise config_lib.ConfigError(
        f"config.eval.lm_eval_tasks needs a decoder-only model (GPT, GPT-2); model.family={family.name!r} is an "
        f"{family.layout}")
  if not all(isinstance(name, str) and name for name in e.lm_eval_tasks):
    raise config_lib.ConfigError(f"config.eval.lm_eval_tasks must be task names, got {tuple(e.lm_eval_tasks)!r}")
  if e.lm_eval_limit < 0:
    raise config_lib.ConfigError(f"config.eval.lm_eval_limit must be >= 0, got {e.lm_eval_limit}")
  if config.eval_every < 1 or e.lm_eval_every < 0 or e.lm_eval_every % config.eval_every:
    raise config_lib.ConfigError(
        f"config.eval.lm_eval_every={e.lm_eval_every} must be a multiple of config.eval_every={config.eval_every} "
        f"> 0 (0 = at every eval): the tasks run with the held-out eval")


def metrics(results: dict) -> dict:
  """The harness' results {task: {'acc,none': ..., 'acc_stderr,none': ..., 'alias': ..., 'sample_len': ...}} ->
  {'lm_eval/task_acc': ...}: the metrics ('metric,filter' keys) that are numbers, without standard errors, the
  filter named unless it is 'none'."""
  out = {}
  for task, values in results.items():
    for key, value in values.items():
      metric, comma, filter_name = key.partition(",")
      if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      out[f"{PREFIX}{task}_{metric}" + (f"_{filter_name}" if filter_name not in ("", "none") else "")] = float(value)
  return out


@functools.cache
def _lm_eval():
  """The lm_eval package, imported on first use. It imports Hugging Face datasets, whose import logs 'JAX version
  ... available' at INFO before it sets its logger's level (WARNING): set first, so the console stays the
  training log."""
  logging.getLogger("datasets").setLevel(logging.WARNING)
  import lm_eval
  import lm_eval.api.model
  import lm_eval.models.utils
  import lm_eval.tasks
  import lm_eval.utils
  return lm_eval


def _task_manager(names: list[str]):
  """configs/lm_eval's tasks, with the harness' own indexed too when a name is not among them; ConfigError naming
  the first unknown name."""
  tasks = _lm_eval().tasks
  manager = tasks.TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
  if set(names) <= set(manager.all_tasks):
    return manager
  manager = tasks.TaskManager(include_path=str(TASKS_DIR))
  unknown = [name for name in names if name not in manager.all_tasks]
  if unknown:
    close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=1)
    raise config_lib.ConfigError(f"config.eval.lm_eval_tasks: no task {unknown[0]!r} in configs/lm_eval or "
                                 "lm-evaluation-harness" + (f"; did you mean {close[0]!r}?" if close else ""))
  return manager


class Harness:
  """params -> {'lm_eval/<task>_<metric>': value} of config.eval.lm_eval_tasks. Built once: the task names are
  checked and the tasks' data read here, so a wrong name or a missing file stops the run before it trains."""

  def __init__(self, config, tokenizer):
    check(config)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)   # its INFO lines and per-task warnings, at every eval
    self.config, self.tokenizer, self.names = config, tokenizer, list(config.eval.lm_eval_tasks)
    self.manager = _task_manager(self.names)
    try:
      self.manager.load(self.names)
    except (ValueError, OSError) as e:   # the tasks' data: configs/lm_eval's files, the Hub's datasets
      raise ValueError(f"config.eval.lm_eval_tasks: cannot load {', '.join(self.names)}: {e}") from e

  def __call__(self, params) -> dict:
    c = self.config
    lm = jax_lm()(c.model, params_lib.for_inference(c, params), self.tokenizer, c.batch_size // c.microbatches)
    out = _lm_eval().simple_evaluate(model=lm, tasks=self.names, task_manager=self.manager,
                                     limit=c.eval.lm_eval_limit or None, bootstrap_iters=0, log_samples=False,
                                     torch_random_seed=None)
    return metrics(out["results"])


@functools.cache
def jax_lm() -> type:
  """JaxLM, the harness' model interface (a lm_eval TemplateLM subclass), defined on first use with lm_eval."""
  lm_eval = _lm_eval()

  class JaxLM(lm_eval.api.model.TemplateLM):
    """The harness' model interface over a decoder's plain params (under the trainer's mesh and axis rules) and an
    lm_jax tokenizer. batch_size: rows per forward pass and prompts per generate call."""

    def __init__(self, model_cfg, params, tokenizer, batch_size: int):
      super().__init__()
      self.model_cfg, self.params, self.tok, self.batch_size = model_cfg, params, tokenizer, batch_size

    @property
    def eot_token_id(self) -> int:
      return self.tok.eos_id

    @property
    def max_length(self) -> int:
      return self.model_cfg.max_positions

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
      return self.tok.encode(string)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
      return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
      """[(strings, context ids, continuation ids)] -> [(log-likelihood, greedy)], the pair cut on the left to the
      model.max_positions + 1 tokens one causal pass reads (HFLM's truncation)."""
      pairs = []
      for _, context, continuation in requests:
        seq = (list(context) + list(continuation))[-(self.max_length + 1):]
        n = min(len(continuation), len(seq) - 1)
        pairs.append((seq[:-n], seq[-n:]))
      logprob, greedy = decoding.score(self.model_cfg, self.params, [c for c, _ in pairs], [x for _, x in pairs],
                                       batch_size=self.batch_size)
      return [(float(lp), bool(g)) for lp, g in zip(logprob, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
      """Each text's log-likelihood over disjoint windows of model.max_positions tokens (the first conditioned on
      eos), as HFLM scores them."""
      owners, windows = [], []
      for i, request in enumerate(requests):
        rolling = lm_eval.utils.get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                          prefix_token=self.prefix_token_id,
                                                          max_seq_len=self.max_length, context_len=1)
        for context, continuation in map(lm_eval.utils.make_disjoint_window, rolling):
          owners.append(i)
          windows.append((None, context, continuation))
      totals = [0.0] * len(requests)
      for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows) if windows else []):
        totals[i] += logprob
      return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
      """Continuations of max_gen_toks tokens (greedy unless do_sample / temperature > 0), cut at the first stop
      sequence or eos, from prompts cut on the left to model.max_positions - max_gen_toks tokens (HFLM's rules)."""
      eos = self.tok.decode([self.eot_token_id])
      out = [None] * len(requests)
      groups = {}   # requests with the same generation options decode together
      for i, request in enumerate(requests):
        context, gen_kwargs = request.args
        kwargs = lm_eval.models.utils.normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
        until = lm_eval.models.utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        groups.setdefault(repr(sorted(kwargs.items())), (kwargs, []))[1].append((i, context, until))
      for kwargs, items in groups.values():
        options = self._decoding_options(kwargs)
        room = self.max_length - options["max_new_tokens"]
        for start in range(0, len(items), self.batch_size):
          batch = items[start:start + self.batch_size]
          prompts = [self.tok_encode(context)[-room:] or [self.eot_token_id] for _, context, _ in batch]
          prompts += [prompts[0]] * (self.batch_size - len(prompts))   # one shape for every batch
          tokens = decoding.generate(self.model_cfg, self.params, prompts, eos_id=self.eot_token_id,
                                     pad_id=self.model_cfg.pad_token_id, **options)
          for (i, _, until), ids in zip(batch, tokens):
            text = self.tok.decode([t for t in ids if t != self.eot_token_id])
            out[i] = lm_eval.models.utils.postprocess_generated_text(text, until, None)
      return out

    def _decoding_options(self, kwargs: dict) -> dict:
      """The harness' normalized generation kwargs -> decoding.generate's options; ValueError for others."""
      known = {"max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}
      if set(kwargs) - known:
        raise ValueError(f"generate_until: generation kwargs {sorted(set(kwargs) - known)} are not supported "
                         f"(supported: until, {', '.join(sorted(known))})")
      if kwargs["max_gen_toks"] >= self.max_length:
        raise ValueError(f"generate_until: max_gen_toks={kwargs['max_gen_toks']} leaves no room for the prompt in "
                         f"model.max_positions={self.max_length}")
      options = {"max_new_tokens": kwargs["max_gen_toks"]}
      if kwargs["do_sample"]:
        options.update(method="sample", temperature=kwargs["temperature"] or 1.0, top_k=kwargs.get("top_k") or 0,
                       top_p=kwargs.get("top_p") or 1.0)
      return options

  return JaxLM

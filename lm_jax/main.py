"""Command line: `python -m lm_jax.main --config=configs/gpt1.py:tiny --workdir=DIR [--mode=...]
[--config.FIELD=VALUE ...]`.

Every mode reads the same config, so the run that trained a model is the one that evaluates,
exports and summarises it. A user's mistake prints one line `error: ...` on stderr and exits 2 (flags,
config) or 1 (data, checkpoints, files); see lm_jax.config_lib.user_errors. --mode=train runs lm_jax.train.train,
or for an objective that trains on its own rollouts (Objective.rollouts: PPO) lm_jax.rlhf.ppo.train, which builds on
lm_jax.train (main -> rlhf -> train -> objectives; nothing below main imports rlhf).
"""
import atexit
import os
import sys

from lm_jax import malloc
from lm_jax.plan import quiet_start

malloc.keep_freed_memory()  # before anything starts JAX's backend
if quiet_start.wanted(sys.argv):
  quiet_start.install(sys.argv)   # before JAX is imported: its plugins log on import

from absl import app, flags  # noqa: E402

from lm_jax import config_lib  # noqa: E402
from lm_jax.obs import metrics_log  # noqa: E402

_CONFIG = flags.DEFINE_string("config", None, "configs/<file>.py[:<variant>]; override fields with --config.a.b=v")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory: checkpoints, metrics.jsonl, tokenizer")
_MODE = flags.DEFINE_enum("mode", "train",
                          ["train", "eval", "export", "summary", "generate", "fill_mask", "predict", "zeroshot",
                           "compile"],
                          "what to do (predict: task.test_split predictions of a fine-tuned model as a TSV; "
                          "zeroshot: GPT-1's zero-shot heuristics on config.task, docs/zeroshot.md; compile: the "
                          "train and eval steps compiled for --topology, docs/scale.md)")
_EXPORT_DIR = flags.DEFINE_string("export_dir", None, "--mode=export: Hugging Face output directory")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "--mode=export: replace a non-empty --export_dir whole (without it "
                                "one is refused)")
_EXPORT_MERGED = flags.DEFINE_bool("export_merged", False, "--mode=export of a LoRA run: the model with its adapters "
                                   "merged, instead of the base model + adapter/ in the PEFT format")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "--mode=generate: a prompt; --mode=fill_mask: a text with "
                                    "[MASK]s (repeatable)")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "--mode=generate: tokens to generate per prompt")
_METHOD = flags.DEFINE_enum("method", "greedy", ["greedy", "sample", "beam"], "--mode=generate: decoding method")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "--method=sample: softmax temperature")
_TOP_K = flags.DEFINE_integer("top_k", 0, "--method=sample: keep the k most likely tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "--method=sample: nucleus probability mass (1.0 = all)")
_NUM_BEAMS = flags.DEFINE_integer("num_beams", 4, "--method=beam: beams")
_SEED = flags.DEFINE_integer("seed", 0, "--method=sample: random seed")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "prompts, one per line (with or instead of --prompt)")
_INIT_FROM = flags.DEFINE_string("init_from", None, "a Hugging Face directory or run workdir to evaluate / start "
                                 "from (sets config.init_from)")
_ZEROSHOT = flags.DEFINE_enum("zeroshot", "sentiment", ["sentiment", "choice", "acceptability"],
                              "--mode=zeroshot: the heuristic")
_CUE = flags.DEFINE_string("cue", "very", "--zeroshot=sentiment: the word appended before the label words")
_THRESHOLD = flags.DEFINE_float("threshold", None, "--zeroshot=acceptability: a fixed threshold on the mean "
                                "log-probability per token")
_THRESHOLD_SPLIT = flags.DEFINE_string("threshold_split", "", "--zeroshot=acceptability: choose the threshold on "
                                       "this split (best Matthews correlation)")
_TOPOLOGY = flags.DEFINE_string("topology", None, "--mode=compile: e.g. v4-32, v5e-64, 2xv5e-256, h100-8 "
                                "(lm_jax/plan/topology.py)")
_PLAN = flags.DEFINE_bool("plan", False, "--mode=compile: search mesh, microbatches, remat and scan for the fastest "
                          "setting that fits")
_PLAN_FITS = flags.DEFINE_integer("plan_fits", 3, "--plan: compile candidates until this many fit (at most twice as "
                                  "many compiles)")
_MFU = flags.DEFINE_float("mfu", 0.4, "--mode=compile: the MFU the predicted step time assumes")
_REPORT_JSON = flags.DEFINE_string("report_json", "", "--mode=compile: also write the report as JSON here")


# The modes each mode-specific flag applies to: given with another mode it is refused, not ignored (a --topology
# without --mode=compile once trained BERT-large on the CPU).
_MODE_FLAGS = {
    **dict.fromkeys(["topology", "plan", "mfu", "report_json"], ("compile",)),
    **dict.fromkeys(["export_dir", "overwrite", "export_merged"], ("export",)),
    **dict.fromkeys(["prompt", "prompts_file"], ("generate", "fill_mask")),
    **dict.fromkeys(["max_new_tokens", "method", "temperature", "top_k", "top_p", "num_beams", "seed"],
                    ("generate",)),
    **dict.fromkeys(["zeroshot", "cue", "threshold", "threshold_split"], ("zeroshot",)),
}


def main(args):
  _, overrides = args
  metrics_log.quiet_libraries()   # before any orbax call: its INFO lines would precede a one-line error
  with config_lib.user_errors():
    check_flags(_MODE.value)
    config = config_lib.load(_CONFIG.value, overrides)
    if _INIT_FROM.value:
      check_init_from(config.init_from, overrides)
      config.init_from = _INIT_FROM.value
    _run(config, _MODE.value)


def check_flags(mode: str):
  """UsageError (exit 2) for a flag of another mode, and for compile flags out of range: checked before the config
  is read, so a mistaken command line writes nothing."""
  for name, modes in _MODE_FLAGS.items():
    if flags.FLAGS[name].present and mode not in modes:
      raise app.UsageError(f"--{name} is a flag of --mode={' / --mode='.join(modes)}, not --mode={mode}")
  if flags.FLAGS["plan_fits"].present and not _PLAN.value:
    raise app.UsageError("--plan_fits is a flag of --plan (--mode=compile --plan)")
  if not 0 < _MFU.value <= 1:
    raise app.UsageError(f"--mfu={_MFU.value} must be in (0, 1]")
  if _PLAN_FITS.value < 1:
    raise app.UsageError(f"--plan_fits={_PLAN_FITS.value} must be at least 1")


def check_init_from(config_value: str, overrides: list[str]):
  """UsageError when --init_from and a --config.init_from on the same command line name different models (the flag
  won silently); a config file's own init_from gives way to the flag."""
  given = any(o.removeprefix("--config.").partition("=")[0] == "init_from" for o in overrides)
  if given and os.path.abspath(config_value) != os.path.abspath(_INIT_FROM.value):
    raise app.UsageError(f"--init_from={_INIT_FROM.value} and --config.init_from={config_value} differ; give one")


def _run(config, mode):
  if mode == "summary":
    from lm_jax import summary
    summary.print_summary(config)
    return
  if mode == "compile":
    if not _TOPOLOGY.value:
      raise app.UsageError("--topology is required for --mode=compile (e.g. v4-8, v5e-16, h100-8)")
    from lm_jax.plan import topology
    topology.check_kernel(config.model.attention, _TOPOLOGY.value)   # a wrong name or kernel: before any compile
    topology.prepare()   # before JAX starts a backend
    from lm_jax.plan import aot, planner
    aot.check_compiler(_TOPOLOGY.value)   # libtpu / the CUDA plugin: only .venv-aot has them (README)
    if _PLAN.value:
      planner.run(config, _TOPOLOGY.value, mfu=_MFU.value, json_path=_REPORT_JSON.value, keep=_PLAN_FITS.value,
               max_compiles=2 * _PLAN_FITS.value)
    else:
      aot.run(config, _TOPOLOGY.value, mfu=_MFU.value, json_path=_REPORT_JSON.value)
    return
  if not _WORKDIR.value:
    raise app.UsageError(f"--workdir is required for --mode={mode}")
  if os.path.isfile(_WORKDIR.value):
    raise app.UsageError(f"--workdir={_WORKDIR.value} is a file; a workdir is a directory")
  from lm_jax import checkpoint, distributed, storage, workdir_lock
  if unsafe := storage.url_unsafe(_WORKDIR.value):
    raise app.UsageError(f"--workdir={_WORKDIR.value}: {unsafe!r} in a remote workdir's "
                         "name is URL or glob syntax to the storage libraries (its files would land elsewhere); use "
                         "letters, digits and - _ . ~ /")
  distributed.maybe_initialize()
  checkpoint.bound_storage_retries(config.storage_retry_s)
  if _WORKDIR.value.startswith("gs://"):
    storage.bound_upload_retries(config.storage_retry_s)
  with workdir_lock.removed_if_unused(_WORKDIR.value):   # a run that stops at start leaves no workdir it created
    try:
      _run_in_workdir(config, mode)
    except storage.Unreachable:   # its one line, then exit: no library's exit-time retries (storage.exit_at_once)
      atexit.register(storage.exit_at_once, 1)
      raise


def _run_in_workdir(config, mode):
  from lm_jax import checkpoint_export, objectives, train
  from lm_jax.evals import run_eval
  from lm_jax.rlhf import ppo
  if mode == "train":
    trainer = ppo.train if objectives.get(config.objective).rollouts else train.train
    trainer(config, _WORKDIR.value)
  elif mode == "eval":
    run_eval.evaluate_checkpoint(config, _WORKDIR.value)
  elif mode == "fill_mask":
    _print_fills(config)
  elif mode == "generate":
    _print_generations(config)
  elif mode == "predict":
    from lm_jax.evals import predict
    s, params, _ = run_eval.restore_params(config, _WORKDIR.value)
    path, metrics = predict.predict(s, params, _WORKDIR.value)
    print(f"predictions: {path}" + "".join(f" | {k} {v:.4f}" for k, v in metrics.items()), flush=True)
  elif mode == "zeroshot":
    import json
    from lm_jax.evals import zeroshot
    result = zeroshot.run(config, _WORKDIR.value, _ZEROSHOT.value, cue=_CUE.value, threshold=_THRESHOLD.value,
                          threshold_split=_THRESHOLD_SPLIT.value)
    print(json.dumps(result), flush=True)
  else:
    if not _EXPORT_DIR.value:
      raise app.UsageError("--export_dir is required for --mode=export")
    checkpoint_export.export_checkpoint(config, _WORKDIR.value, _EXPORT_DIR.value, merged=_EXPORT_MERGED.value,
                            overwrite=_OVERWRITE.value)


def _print_generations(config):
  from lm_jax.evals import inference
  options = dict(max_new_tokens=_MAX_NEW.value, method=_METHOD.value, temperature=_TEMPERATURE.value,
                 top_k=_TOP_K.value, top_p=_TOP_P.value, num_beams=_NUM_BEAMS.value, seed=_SEED.value)
  inference.check_generate_flags({name for name in options if flags.FLAGS[name].present}, **options)
  texts = inference.read_prompts(_PROMPT.value, _PROMPTS_FILE.value)
  for text, continuation in zip(texts, inference.generate_text(config, _WORKDIR.value, texts, **options)):
    print(f"{text}\n  -> {continuation}")


def _print_fills(config):
  from lm_jax.evals import inference
  texts = inference.read_prompts(_PROMPT.value, _PROMPTS_FILE.value)
  for text, masks in zip(texts, inference.fill_mask(config, _WORKDIR.value, texts)):
    print(text)
    for k, best in enumerate(masks):
      print(f"  [MASK] {k + 1}: " + "  ".join(f"{token!r} {p:.3f}" for token, p in best))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=config_lib.parse_flags)

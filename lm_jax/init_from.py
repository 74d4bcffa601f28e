"""Where a run's model starts and where eval / export / predict take params from: config.init_from, a Hugging Face
directory or another run's workdir.

- resolve(config): the run's model config takes the architecture of config.init_from (a Hugging Face directory's
  config.json, or the saved config of another run's workdir) and keeps its own runtime fields and num_labels; the
  tokenizer is the pre-trained one unless data.tokenizer names another. An objective's added_tokens (GPT-1's
  start / delimiter / extract) enlarge the vocabulary: model.vocab_size = pre-trained + added_tokens, recorded as
  model.added_tokens so that a run started from such a run keeps its vocabulary.
- initial_params: every parameter the run's model shares with the pre-trained one (same path and shape) starts
  from the pre-trained value, an enlarged embedding table its first rows; the rest (new task heads, the added
  tokens' rows) keeps the fresh init drawn from the run's seed; the
  pre-trained heads the run's model lacks are dropped (BERT §4: the MLM / NSP heads give way to the classifier).
  finetune.reinit_top_layers resets the top layers of every layer stack to the fresh init.
- eval_source / restore_params: a run with a checkpoint of its own evaluates, exports and predicts it; without one,
  config.init_from's model.
A Hugging Face directory is read here only: source_model (its config.json and tokenizer) and pretrained_params (its
weights, lm_jax.hf.export.load_hf), whether a run starts from it or evaluates, exports, probes or decodes it.
"""
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from lm_jax import (checkpoint, config_lib, layout as layout_lib, models, objectives, optim, params as params_lib,
                    storage)
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.hf import export
from lm_jax.models import layers

# Model fields the run chooses whatever the pre-trained model had: how it runs, and its task head.
RUN_FIELDS = (*checkpoint.RUNTIME_MODEL_FIELDS, "scan_layers", "param_dtype", "num_labels", "frozen_reference")


def check(config):
  """One-line ValueError for a config.finetune.reinit_top_layers that cannot apply."""
  top = config.finetune.reinit_top_layers
  if not 0 <= top <= config.model.num_layers:
    raise ValueError(f"config.finetune.reinit_top_layers must be in [0, model.num_layers={config.model.num_layers}],"
                     f" got {top}")
  if top and not config.init_from:
    raise ValueError("config.finetune.reinit_top_layers needs config.init_from (the model to start from)")


def is_hf(path: str) -> bool:
  """Whether `path` is a Hugging Face model directory (rather than a run's workdir), local or remote."""
  if storage.is_remote(path):
    return storage.path(f"{path.rstrip('/')}/config.json").exists()
  return os.path.isfile(os.path.join(path, "config.json"))


# ------------------------------------------------------------------------------------------ the pre-trained model
def saved_config(path: str) -> dict:
  """The saved config of the latest checkpoint of the run in `path` (read only: nothing is written there)."""
  _require_checkpoint(path)
  mngr = checkpoint.manager(path, 1, read_only=True)
  try:
    return _latest_config(mngr, path)
  finally:
    mngr.close()


def _require_checkpoint(path: str):
  if os.path.isfile(os.path.join(path, "adapter_config.json")) and not is_hf(path):
    raise ValueError(f"config.init_from={path!r} is a PEFT adapter, not a model: put its base model in "
                     f"config.init_from and the adapter in config.{_adapter_field(path)}.init_from")
  if not checkpoint.has_checkpoint(path):
    what = "does not exist" if not os.path.exists(path) else "is neither a Hugging Face directory (config.json) nor " \
        "a workdir with a checkpoint"
    raise FileNotFoundError(f"config.init_from={path!r} {what}")


def _adapter_field(path: str) -> str:
  """'ia3' for a PEFT IA3 adapter directory, else 'lora' (LoRA and QLoRA; also for an unreadable adapter_config)."""
  try:
    kind = json.loads(pathlib.Path(path, "adapter_config.json").read_text()).get("peft_type", "")
  except (OSError, ValueError, AttributeError):
    kind = ""
  return "ia3" if str(kind).upper() == "IA3" else "lora"


def _latest_config(mngr, path: str) -> dict:
  saved = checkpoint.read_config(mngr)   # the newest step still there: a trainer may be deleting old ones
  if saved is None:
    _require_checkpoint(path)
  return saved


def source_model(path: str) -> tuple[ml_collections.ConfigDict, str]:
  """(model config, tokenizer path) of the pre-trained model in `path`."""
  if is_hf(path):
    path = storage.local_dir(path)   # a remote export's files are read from a local copy
    return export._read_config(os.path.join(path, "config.json")), path
  saved = saved_config(path)
  model = ml_collections.ConfigDict(saved["model"])
  tokenizer = saved["data"].get("tokenizer") or next(iter(sorted(str(p) for p in storage.path(path).glob(
      f"tokenizer_{model.family}_*.model"))), "")
  if not tokenizer:
    raise FileNotFoundError(f"config.init_from={path!r}: the run names no data.tokenizer and has no trained "
                            "tokenizer_*.model")
  return model, tokenizer


def resolve(config):
  """config with the model architecture (and tokenizer) of config.init_from; config itself without init_from."""
  if not config.init_from:
    return config
  model, tokenizer = source_model(config.init_from)
  if model.family != config.model.family:
    raise ValueError(f"config.init_from={config.init_from!r} holds a {model.family!r} model but "
                     f"config.model.family={config.model.family!r}")
  if config.data.tokenizer:
    _check_tokenizer(config.data.tokenizer, tokenizer, config)
  merged = config.model.to_dict()
  merged.update({k: v for k, v in model.to_dict().items() if k not in RUN_FIELDS})
  added = objectives.get(config.objective).added_tokens
  if added and not model.get("added_tokens"):   # a run that has them already (e.g. WORKDIR/best) keeps its vocab
    merged.update(vocab_size=model.vocab_size + added, added_tokens=added)
  return config_lib.replaced(config, {"model": ml_collections.ConfigDict(merged),
                                      "data.tokenizer": config.data.tokenizer or tokenizer})


def _check_tokenizer(own: str, pretrained: str, config):
  """config.data.tokenizer may name the pre-trained model's tokenizer by another path, not another tokenizer (the
  pre-trained ids would mean other pieces; DPO's reference and PPO's policy are this model too)."""
  if os.path.realpath(own) == os.path.realpath(pretrained):
    return
  try:
    tokenizer_lib.check_same(tokenizer_lib.load(own, models.family(config.model)), pretrained,
                             f"config.init_from={config.init_from!r}", "config.data.tokenizer")
  except FileNotFoundError:   # a Hugging Face directory without a tokenizer: data.tokenizer is the only one
    if not is_hf(config.init_from):
      raise


def pretrained_params(config, mesh, rules) -> dict:
  """The params of config.init_from in the layout of config.model (resolved), on the host or on `mesh`; a LoRA
  run's adapters merged into its kernels. The one place a Hugging Face directory's weights are read."""
  path, m = config.init_from, config.model
  if is_hf(path):
    _, params = export.load_hf(path, **{k: m[k] for k in RUN_FIELDS if k in m and k != "num_labels"})
    return params
  _require_checkpoint(path)
  mngr = checkpoint.manager(path, 1, read_only=True)   # one manager for the saved config and the params
  try:
    source = ml_collections.ConfigDict(_latest_config(mngr, path))
    lay = layout_lib.build(source, mesh, rules)
    restored = checkpoint.restore_latest(mngr, lay.abstract_state, lay.state_sharding, source, with_data=False)
  finally:
    mngr.close()
  params = optim.eval_params(restored.state, lay.policy.trainable)   # schedule-free: its average
  if lay.policy.method:   # an adapter run's model is its merged one (NF4 kernels dequantised)
    params = jax.jit(lambda p: params_lib.folded(lay.policy, p))(params)
  if source.model.scan_layers == m.scan_layers:
    return params
  return models.family(m).rescan(source.model, m, params)


# ---------------------------------------------------------------------------------------------- initial params
def _reinit_top(params: dict, fresh: dict, k: int) -> dict:
  """Looped params with the top k layers of every layer stack taken from `fresh`."""
  if not k or not isinstance(params, dict):
    return params
  out = {}
  looped = sum(1 for key in params if layers.LOOPED.fullmatch(key))
  for key, value in params.items():
    m = layers.LOOPED.fullmatch(key)
    if m:
      out[key] = fresh[key] if int(m.group(1)) >= looped - k else value
    else:
      out[key] = _reinit_top(value, fresh[key], k)
  return out


def reinit_top(model_cfg, params: dict, fresh: dict, k: int) -> dict:
  """params with the top k layers of every layer stack taken from `fresh`; scanned stacks (on the host) through
  their looped layers, whichever way the family lays them out (Family.relaid)."""
  if not k or not model_cfg.scan_layers:
    return _reinit_top(params, fresh, k)
  relaid = models.family(model_cfg).relaid
  looped = _reinit_top(relaid(model_cfg, params, scan=False), relaid(model_cfg, fresh, scan=False), k)
  return relaid(model_cfg, looped, scan=True)


def _extends(old, new) -> bool:
  """Whether embedding table `new` has `old`'s rows and more (a vocabulary with added tokens)."""
  return np.ndim(old) == np.ndim(new) == 2 and np.shape(old)[1] == np.shape(new)[1] and len(old) < len(new)


def initial_params(config, fresh: dict, pretrained: dict) -> tuple[dict, str]:
  """(params, a one-line report): `pretrained` wherever it has the run's parameter with the same shape (the first
  rows of an enlarged embedding table), `fresh` (the run's seeded init) elsewhere and in the top
  finetune.reinit_top_layers layers."""
  new, old = traverse_util.flatten_dict(fresh), traverse_util.flatten_dict(pretrained)
  if models.REFERENCE in fresh and models.REFERENCE not in pretrained:   # DPO's reference: the pre-trained model
    old.update({(models.REFERENCE, *p): jax.numpy.array(leaf, copy=True) for p, leaf in list(old.items())})
  taken = {p for p, leaf in new.items() if p in old and np.shape(old[p]) == np.shape(leaf)}
  grown = {p for p, leaf in new.items() if p in old and p[-1] == "embedding" and _extends(old[p], leaf)}

  def start(p, leaf):
    if p in grown:
      return jnp.concatenate([old[p], leaf[len(old[p]):]])   # on the devices: arrays may span hosts
    return old[p] if p in taken else leaf
  params_lib.check_fresh(config, set(new) - taken - grown)
  params = traverse_util.unflatten_dict({p: start(p, leaf) for p, leaf in new.items()})
  top = config.finetune.reinit_top_layers
  params = reinit_top(config.model, params, fresh, top)
  names = lambda paths: ", ".join(sorted({p[0] for p in paths})) or "none"
  report = (f"init_from {config.init_from}: {len(taken)} of {len(new)} parameter tensors pre-trained; "
            + "".join(f"{'/'.join(p)}: {len(old[p])} pre-trained rows + {len(new[p]) - len(old[p])} fresh; "
                      for p in sorted(grown))
            + f"fresh init: {names(set(new) - taken - grown)}; dropped: {names(set(old) - set(new))}"
            + (f"; top {top} layers re-initialised" if top else ""))
  return params, report


def start_params(config, fresh: dict, mesh, rules, params_sharding) -> tuple[dict, str]:
  """(params placed by params_sharding, a one-line report): a fresh run's first params, config.init_from's where
  they fit (initial_params); the optimizer states stay zeros."""
  pretrained = params_lib.from_pretrained(config, pretrained_params(config, mesh, rules))
  params, report = initial_params(config, fresh, pretrained)
  return jax.device_put(params, params_sharding), report


# ------------------------------------------------------------------------------- params for eval / export / predict
def eval_source(config, workdir: str) -> tuple[ml_collections.ConfigDict, str]:
  """(config, directory) of the params eval / export / predict use: the latest checkpoint in workdir, or without one
  config.init_from's (a fine-tuned run evaluates its own). A Hugging Face directory's model config replaces
  config.model (runtime fields such as dtype and scan_layers stay the run's); its tokenizer is used unless
  data.tokenizer names one. Checked before a tokenizer is built or data read: a workdir without a checkpoint and
  without config.init_from, or whose task head config.init_from lacks, is a one-line FileNotFoundError."""
  if checkpoint.has_checkpoint(workdir):
    return config, workdir
  no_checkpoint = f"no checkpoint in {checkpoint.directory(workdir)}"
  if not config.init_from:
    raise FileNotFoundError(f"{no_checkpoint}; train first (--mode=train) or pass --init_from")
  if not is_hf(config.init_from):
    _require_checkpoint(config.init_from)
    return config, config.init_from
  model, tokenizer = source_model(config.init_from)
  heads = config.model.get("num_labels", 0)
  if heads and model.get("num_labels", 0) != heads:
    raise FileNotFoundError(f"{no_checkpoint}: train first (--mode=train); config.init_from={config.init_from!r} "
                            f"has no {heads}-label head of its own (num_labels={model.get('num_labels', 0)})")
  model.update({k: config.model[k] for k in (*checkpoint.RUNTIME_MODEL_FIELDS, "scan_layers")})
  models.validate(model)
  config = config_lib.replaced(config, {"model": model, "data.tokenizer": config.data.tokenizer or tokenizer})
  return config, config.init_from


def restore_params(s, source: str) -> tuple[dict, int]:
  """(params placed on the mesh, step) of eval_source's `source` for s (the setup.Setup of eval_source's config):
  a Hugging Face directory's weights (step 0), or the latest checkpoint in a workdir."""
  if source == s.config.init_from and is_hf(source):
    params = params_lib.from_pretrained(s.policy, pretrained_params(s.config, s.mesh, s.rules), fill=True)
    return jax.device_put(params, s.state_sharding["params"]), 0
  mngr = checkpoint.manager(source, s.config.keep_checkpoints, read_only=True)
  with jax.set_mesh(s.mesh):
    restored = checkpoint.restore_latest(mngr, s.abstract_state, s.state_sharding, s.config, with_data=False)
  mngr.close()
  if restored is None:
    raise FileNotFoundError(f"no checkpoint in {mngr.directory}; train first (--mode=train)")
  return optim.eval_params(restored.state, s.policy.trainable), restored.step

"""Hugging Face files: config.json + model.safetensors, as transformers' from_pretrained reads them, and with a
tokenizer its files (lm_jax/hf/tokenizer.py) and generation_config.json, so that AutoTokenizer, pipeline(...)
and lm-evaluation-harness take the directory as it is.

save_hf writes the layout of the family's HF class (lm_jax/hf/<family>.py's ARCHITECTURE: BertForPreTraining, which
BertForMaskedLM also loads, OpenAIGPTLMHeadModel, GPT2LMHeadModel, T5ForConditionalGeneration; scanned layers are
unstacked, float32). load_hf reads safetensors only, never pickles; it also takes encoder-only BertModel checkpoints
(missing pooler / MLM / NSP heads are initialised randomly with a warning, like transformers does). A missing,
unreadable or unfitting file is a one-line error that names the file, and the tensor where one is at fault.

`writing` makes an export atomic (lm_jax.checkpoint_export writes through it): the files go to a temporary
directory beside the target, which is renamed to the target only once every file is written, so an error, a full
disk or SIGTERM leaves the target as it was and no files of two exports ever mix (an unmerged export's adapter/
beside merged weights would apply the adapters twice). A non-empty target is refused unless `overwrite`, which
replaces it whole. Every file gets the same mode (the umask's). A remote target (gs://...) has no directory rename:
the export is written to a local temporary directory, then uploaded with config.json, which every reader (load_hf,
transformers, lm-eval) needs, last and any old config.json deleted first, so a reader finds the old export, no
export, or the new one whole; a failed upload removes what it uploaded. load_hf reads a remote export from a local
copy (lm_jax.storage.local_dir).
"""
import contextlib
import fcntl
import glob
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from lm_jax import hf, models, storage
from lm_jax.obs import metrics_log
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.hf import convert, tokenizer as hf_tokenizer


def save_hf(model_cfg, params, out_dir: str, tokenizer: tokenizer_lib.Tokenizer | None = None) -> None:
  """config.json, model.safetensors and, for a model that generates, generation_config.json; with `tokenizer` (the
  run's) also the tokenizer files, which give its ids."""
  fam = models.family(model_cfg)
  mod = hf.family_module(fam.name)
  if model_cfg.get("mup_base_width", 0) not in (0, model_cfg.d_model):
    raise ValueError(f"model.mup_base_width={model_cfg.mup_base_width}: a µP model's readout and attention multipliers "
                     "have no place in the Hugging Face classes (docs/mup.md)")
  config = mod.hf_config(model_cfg)
  if tokenizer is not None and fam.layout == "decoder" and tokenizer.eos_id is not None:
    # The tokenizer's own ids: without them transformers fills in GPT-2's 50256, outside a trained vocabulary.
    config.update(bos_token_id=tokenizer.eos_id, eos_token_id=tokenizer.eos_id)   # GPT-2: bos = eos = end of text
  tensors = mod.to_hf(model_cfg, params)
  if tokenizer is not None:   # first: a tokenizer that does not fit stops the export before any file is written
    need = tokenizer.vocab_size + tokenizer_lib.num_sentinels(fam)
    if need > model_cfg.vocab_size:
      raise ValueError(f"the tokenizer has {need} ids, more than the model's vocab_size={model_cfg.vocab_size}")
    hf_tokenizer.save(tokenizer, fam.name, out_dir,   # relative positions (T5) have no length limit
                      model_max_length=model_cfg.max_positions if fam.learned_positions else None)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  weights = os.path.join(out_dir, "model.safetensors")
  try:
    save_file(tensors, weights, metadata={"format": "pt"})
  except SafetensorError as e:   # a full disk comes back as Rust's IoError text, 20 lines of traceback unwrapped
    code = re.search(r"code: (\d+)|os error (\d+)", str(e))
    if code is None:
      raise
    errno_ = int(code.group(1) or code.group(2))
    raise OSError(errno_, os.strerror(errno_), weights) from None
  os.chmod(weights, stat.S_IMODE(os.stat(os.path.join(out_dir, "config.json")).st_mode))  # safetensors writes 0600
  if fam.layout != "encoder":
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump(_generation_config(model_cfg, fam.layout, tokenizer), f, indent=2)


def check_target(out_dir: str, overwrite: bool = False):
  """One-line error for an export target that `writing` would refuse: call it before the export's work."""
  if storage.is_remote(out_dir):
    found = storage.find(out_dir)
    if found and not overwrite:   # a bucket has no rename: a killed export's uploads sit in the target itself
      torn = f"{str(out_dir).rstrip('/')}/config.json" not in found
      raise FileExistsError(f"export directory {out_dir} " + (
          "holds an unfinished export (no config.json: an export stopped while uploading)" if torn else
          "is not empty") + "; pass --overwrite to replace it whole, or choose another --export_dir")
    return
  if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
    raise FileExistsError(f"export directory {out_dir} is a file")
  if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
    raise FileExistsError(f"export directory {out_dir} is not empty; pass --overwrite to replace it whole, or "
                          "choose another --export_dir")


@contextlib.contextmanager
def writing(out_dir: str, overwrite: bool = False):
  """Yields a temporary directory beside out_dir to write an export into; at the end of the block it becomes out_dir
  (replacing one that exists, with `overwrite`), with every file and folder at the umask's mode. An exception or
  SIGTERM inside the block removes it and leaves out_dir untouched."""
  check_target(out_dir, overwrite)
  if storage.is_remote(out_dir):
    tmp = tempfile.mkdtemp(prefix="lm_jax-export-")
    try:
      yield tmp
      storage.upload_dir(tmp, out_dir, last="config.json")
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
    return
  out_dir = os.path.abspath(out_dir)
  os.makedirs(os.path.dirname(out_dir), exist_ok=True)
  _remove_stale_partials(out_dir)
  tmp, held = _partial(out_dir)
  main_thread = threading.current_thread() is threading.main_thread()
  previous = signal.signal(signal.SIGTERM, _cancel) if main_thread else None
  old = tmp + ".old"   # an existing out_dir (overwrite, or empty) is set aside, replaced, then removed
  try:
    yield tmp
    _umask_modes(tmp)
    if os.path.lexists(out_dir):
      os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if os.path.islink(old):   # out_dir was a link: the link is replaced, its target's files stay
      os.unlink(old)
    else:
      shutil.rmtree(old, ignore_errors=True)
  except BaseException as e:
    if os.path.lexists(old) and not os.path.lexists(out_dir):
      os.rename(old, out_dir)
    for path in (tmp, old):
      shutil.rmtree(path, ignore_errors=True)
    if isinstance(e, OSError) and e.strerror:   # a full disk: name the target, not the temporary file
      raise OSError(e.errno, f"exporting to {out_dir} failed ({e.strerror}); nothing was written") from e
    raise
  finally:
    os.close(held)
    if main_thread:
      signal.signal(signal.SIGTERM, previous)


def _partial(out_dir: str) -> tuple[str, int]:
  """A new folder .NAME.partial-XXXXXXXX beside out_dir and an open descriptor holding its flock: the kernel drops
  the lock with the process however it ends, so a folder nobody holds is a killed export's (_remove_stale_partials).
  Locked under another name, then renamed: a partial folder is never seen unlocked while its export lives."""
  parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
  starting = tempfile.mkdtemp(prefix=f".{name}.starting-", dir=parent)
  held = os.open(starting, os.O_RDONLY | os.O_DIRECTORY)
  with contextlib.suppress(OSError):   # a file system without locks: its partial folders are never removed
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
  tmp = os.path.join(parent, f".{name}.partial-{os.path.basename(starting).rsplit('-', 1)[1]}")
  os.rename(starting, tmp)
  return tmp, held


def _remove_stale_partials(out_dir: str):
  """Removes the folders that killed exports to out_dir left beside it, with one warning line: .NAME.partial-* ones
  no live export holds (_partial), and .NAME.partial-*.old ones (a replaced export) once out_dir exists again and
  their partial folder is gone. Only names of this module's own pattern are touched."""
  parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
  pattern = re.compile(rf"\.{re.escape(name)}\.partial-[a-z0-9_]{{8}}(\.old)?")
  removed = []
  for entry in sorted(os.listdir(parent)):
    path = os.path.join(parent, entry)
    match = pattern.fullmatch(entry)
    if not match or os.path.islink(path) or not os.path.isdir(path):
      continue
    if match[1] and (not os.path.isdir(out_dir) or os.path.lexists(path.removesuffix(".old"))):
      continue   # set aside mid-swap: the only copy of the export it replaced
    if match[1] or _unheld(path):
      shutil.rmtree(path, ignore_errors=True)
      removed.append(entry)
  if removed:
    metrics_log.warn(f"removed {len(removed)} unfinished export folder(s) beside {out_dir} that killed exports left "
                     f"({', '.join(removed)})")


def _unheld(folder: str) -> bool:
  """Whether no process holds folder's flock (False where the file system has no locks: nothing is decided)."""
  fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except OSError:
    return False
  finally:
    os.close(fd)


def _cancel(signum, frame):
  del frame
  print(f"error: {signal.Signals(signum).name}: export cancelled, nothing written", file=sys.stderr, flush=True)
  raise SystemExit(128 + signum)


def _umask_modes(root: str):
  """Every file under root at 0666 and every folder at 0777, less the umask: what open() and mkdir() give."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(root, 0o777 & ~umask)
  for folder, dirs, files in os.walk(root):
    for name in dirs:
      os.chmod(os.path.join(folder, name), 0o777 & ~umask)
    for name in files:
      os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _generation_config(model_cfg, layout, tokenizer) -> dict:
  """Ids generate() needs: a decoder's end of text is its tokenizer's (the eos lm_jax appends to every document). No
  max_length: generate() stops at the model's positions by itself, and a set one warns whenever max_new_tokens is
  passed."""
  if layout == "encoder_decoder" or tokenizer is None:
    out = {"eos_token_id": model_cfg.eos_token_id, "pad_token_id": model_cfg.pad_token_id}
  else:
    out = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
  if layout == "encoder_decoder":
    out["decoder_start_token_id"] = model_cfg.decoder_start_token_id
  return {k: v for k, v in out.items() if v is not None}


def load_hf(path: str, **overrides):
  """-> (model_cfg, params) from a directory with config.json and *.safetensors (shards too).
  `overrides` set model config fields that do not change the weights, e.g. scan_layers=True."""
  path = _local(path)
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found")
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors in {path} (pickle checkpoints such as pytorch_model.bin are not read)")
  model_cfg = _read_config(config_path)
  model_cfg.update(overrides)
  models.validate(model_cfg)
  tensors, sources = {}, {}
  for file in files:
    read = _read_float32(file)
    tensors |= read
    sources |= dict.fromkeys(read, file)
  try:
    return model_cfg, hf.family_module(model_cfg).from_hf(model_cfg, tensors)
  except convert.TensorError as e:   # a missing tensor is in no file: name the directory
    raise ValueError(f"{sources.get(e.tensor, path)}: {e}") from None


def load_hf_tokenizer(path: str) -> tokenizer_lib.Tokenizer:
  """The tokenizer of a Hugging Face directory (tokenizer.json, vocab.txt or a SentencePiece *.model), with the
  special ids of the family its config.json names: what save_hf wrote gives the exported tokenizer's ids."""
  path = _local(path)
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{config_path} not found")
  family = _read_config(config_path).family
  if not glob.glob(os.path.join(path, "*.model")) and not any(
      os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "vocab.txt")):
    raise FileNotFoundError(f"{path} has no tokenizer.json, vocab.txt or *.model (exported without a tokenizer?)")
  return tokenizer_lib.load(path, models.family(family))


def _local(path: str) -> str:
  """A remote export's local copy (its config.json checked first, so a missing export is named by its URL)."""
  if storage.is_remote(path) and not storage.path(f"{path.rstrip('/')}/config.json").exists():
    raise FileNotFoundError(f"{path.rstrip('/')}/config.json not found")
  return storage.local_dir(path)


def _read_config(config_path: str):
  """Our model config from an HF config.json; errors name the file."""
  try:
    with open(config_path, encoding="utf-8") as f:
      fields = json.load(f)
  except ValueError as e:   # JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{config_path}: not valid JSON ({e})") from None
  if not isinstance(fields, dict):
    raise ValueError(f"{config_path}: expected a JSON object, got {type(fields).__name__}")
  mod = hf.by_model_type(fields.get("model_type"))
  if mod is None:
    raise ValueError(f"{config_path}: unsupported model_type {fields.get('model_type')!r}; known: "
                     f"{', '.join(hf.model_types())}")
  try:
    model_cfg = mod.config_from_hf(fields)
    models.validate(model_cfg)
  except KeyError as e:
    raise ValueError(f"{config_path}: no field {e.args[0]!r}") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"{config_path}: {e}") from None
  return model_cfg


def _read_float32(file: str) -> dict:
  """Tensors of one safetensors file as float32 numpy. Read through JAX because released checkpoints
  are often bfloat16, which safetensors' numpy reader rejects."""
  try:
    with safe_open(file, framework="flax") as f:
      return {k: np.asarray(f.get_tensor(k)).astype(np.float32) for k in f.keys()}
  except SafetensorError as e:
    raise ValueError(f"{file}: not a readable safetensors file ({e})") from None

"""A run's setup: config -> validated config, workdir lock, tokenizer, mesh and layout, before the first step. The
trainers (train, rlhf/ppo) and the read-only modes (evals/run_eval) start here, so the eval of a run is built as
its training was. Dependencies: checks, init_from, layout, sharding, workdir_lock, data/tokenizer,
evals/lm_eval_adapter (its config check); nothing of the trainers.
"""
import contextlib
import dataclasses

import jax
from etils import epath

from lm_jax import checks, init_from, layout as layout_lib, models, sharding, workdir_lock
from lm_jax.data import tokenizer as tokenizer_lib
from lm_jax.evals import lm_eval_adapter
from lm_jax.obs import metrics_log


@dataclasses.dataclass(frozen=True)
class Setup(layout_lib.Layout):
  """Everything a run builds from its config before the first step: its layout and its tokenizer."""
  tokenizer: tokenizer_lib.Tokenizer


def setup(config, workdir: str, devices=None, *, held: contextlib.ExitStack | None = None) -> Setup:
  """Validates the config (one-line errors before anything is built), then builds the run's parts. With
  config.init_from the model architecture and tokenizer are the pre-trained model's (init_from.resolve). A trainer
  passes `held`, the stack its run holds: the workdir's lock (lm_jax.workdir_lock) goes into it once the config is
  valid and before anything is written there, so a mistaken config leaves no trace and a second run writes nothing."""
  metrics_log.quiet_libraries()
  config = init_from.resolve(config)
  devices = jax.devices() if devices is None else list(devices)
  checks.validate(config, len(devices), jax.process_count())
  lm_eval_adapter.check(config)
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  if held is not None:
    held.enter_context(workdir_lock.hold(workdir))
  tokenizer = tokenizer_lib.load_or_train(config, workdir, models.family(config.model))
  layout = layout_lib.build(config, sharding.make_mesh(config, devices))
  return Setup(**vars(layout), tokenizer=tokenizer)

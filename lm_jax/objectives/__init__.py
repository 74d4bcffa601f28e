"""Training objectives, keyed by config.objective: the unit of extension.

An objective is one file here that builds a `registry.Objective` and registers it. It owns everything
specific to it, so no other module branches on its name:

  name, layouts    its key and the model layouts it trains ('encoder', 'decoder', 'encoder_decoder'): every
                   family of such a layout (lm_jax.models.family) trains with it, a new one included
  check            its config checks (after the generic ones below), one-line ValueError naming the field
  lengths          input / target / scored lengths per example: tokens per example and FLOPs per example
                   (Objective.tokens_per_example / flops_per_example) for the trainer, memory and bench/
  rows             how documents become model rows: a data.rows.Stream or data.rows.PerDocument layout
  transform        rows -> batch features on the host, once per batch (masking, span corruption);
                   registry.no_transform when the rows already are the batch
  features         the batch features it produces: {name: (per-example shape, dtype)}
  denominators     global normalisers from the FULL batch, so microbatch sums equal the full-batch value
  loss             (config, params, batch, den, *, rng, train) -> (loss, metrics); the metrics are also
                   its eval metrics (averaged over eval batches; `token_loss` gives perplexity and bits)
  predict          (optional) (config, params, batch) -> per-example {prediction, label, weight, index}: the eval
                   adds metrics over the whole eval set's predictions (F1, Matthews, Pearson / Spearman;
                   lm_jax.evals.evaluate.prediction_metrics) and --mode=predict writes them
  added_tokens     (optional) special tokens it appends to the pre-trained vocabulary as new embedding rows
                   (init_from.resolve): ids vocab_size - added_tokens .. vocab_size - 1, unknown to the tokenizer
  rollouts         (optional) True: it trains on rollouts of its own policy (PPO: rollouts, scoring, updates), so
                   lm_jax.rlhf.ppo.train runs it (main.py picks it), not train.train

A test (or a user's script) can register its own objective with `register` and train it through the
unchanged trainer.
"""
from lm_jax import models
from lm_jax.config_lib import require
from lm_jax.objectives import (classify, clm, dpo, gpt_classify, mlm, ppo, reward, sft, span_corruption,
                               text_to_text)
from lm_jax.objectives.registry import Lengths, Objective, get, names, register

for _module in (mlm, clm, span_corruption, classify, gpt_classify, text_to_text, sft, reward, dpo, ppo):
  register(_module.OBJECTIVE)


def check(config):
  """One-line ValueError naming the field if config.objective cannot run with this model and data config;
  the trainer calls it before anything is built."""
  objective = get(config.objective)
  m, d = config.model, config.data
  family = models.family(m)
  fitting = [f for f in models.names() if models.family(f).layout in objective.layouts]   # for the message
  needed = " or ".join(f"config.model.family={f!r}" for f in fitting)
  require(family.layout in objective.layouts,
           f"config.objective={config.objective!r} needs {needed}, got {m.family!r}")
  require(m.vocab_size > 0, f"config.model.vocab_size must be > 0, got {m.vocab_size}")
  require(d.seq_len >= 1, f"config.data.seq_len must be >= 1, got {d.seq_len}")
  if family.learned_positions:
    require(d.seq_len <= m.max_positions,
             f"config.data.seq_len={d.seq_len} exceeds config.model.max_positions={m.max_positions}")
  require(config.get("z_loss", 0.0) >= 0, f"config.z_loss must be >= 0, got {config.get('z_loss')}")
  ls = config.get("label_smoothing", 0.0)
  require(0 <= ls < 1, f"config.label_smoothing must be in [0, 1), got {ls}")
  require(not d.get("windows", False) or objective is clm.OBJECTIVE,   # data/windows.py emits clm's batch
          f"config.data.windows trains a causal LM: config.objective must be 'clm', got {config.objective!r}")
  objective.check(config)


__all__ = ["Lengths", "Objective", "check", "get", "names", "register"]

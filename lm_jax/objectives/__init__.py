"""Pre-training objectives, keyed by config.objective. Each declares its model family, the batch features the
pipeline must produce, the global loss denominators and its loss; adding an objective is adding one file here."""
import dataclasses
import functools
from typing import Callable

from lm_jax.data import corruption
from lm_jax.objectives import clm, mlm, span_corruption

NUM_SENTINELS = 100  # T5's <extra_id_0..99> at the top of the vocabulary


@dataclasses.dataclass(frozen=True)
class Objective:
  """features(config) -> {name: (per-example shape, numpy dtype)}; denominators(batch) -> {str: scalar} from the
  FULL batch; loss(model_cfg, params, batch, den, *, rng, train) -> (loss, metrics), all sums / den, so summing
  over microbatches gives exactly the full-batch values. Denominators are at least 1, so a batch without scored
  tokens gives 0, not NaN."""
  name: str
  family: str
  features: Callable
  denominators: Callable
  loss: Callable


_REGISTRY = {"mlm": ("bert", mlm), "clm": ("gpt", clm), "span_corruption": ("t5", span_corruption)}


def get(name, config=None):
  """The objective called `name`; with `config`, its loss uses config.loss_z and config.label_smoothing (default 0)."""
  if name not in _REGISTRY:
    raise ValueError(f"config.objective={name!r} is unknown; known: {', '.join(sorted(_REGISTRY))}")
  family, module = _REGISTRY[name]
  options = {}
  if config is not None:
    options = dict(z_loss=float(config.get("loss_z", 0.0)), label_smoothing=float(config.get("label_smoothing", 0.0)))
  return Objective(name, family, module.features, module.denominators, functools.partial(module.loss, **options))


def _require(ok, message):
  if not ok:
    raise ValueError(message)


def check(config):
  """Raises a one-line ValueError naming the field if config.objective cannot run with this model and data config;
  the trainer calls it before anything compiles."""
  objective = get(config.objective)
  m, d = config.model, config.data
  _require(m.family == objective.family, f"config.objective={config.objective!r} needs "
           f"config.model.family={objective.family!r}, got {m.family!r}")
  _require(m.vocab_size > 0, f"config.model.vocab_size must be > 0, got {m.vocab_size}")
  _require(d.seq_len >= 1, f"config.data.seq_len must be >= 1, got {d.seq_len}")
  if m.family in ("bert", "gpt"):
    _require(d.seq_len <= m.max_positions,
             f"config.data.seq_len={d.seq_len} exceeds config.model.max_positions={m.max_positions}")
  _require(config.get("loss_z", 0.0) >= 0, f"config.loss_z must be >= 0, got {config.get('loss_z')}")
  ls = config.get("label_smoothing", 0.0)
  _require(0 <= ls < 1, f"config.label_smoothing must be in [0, 1), got {ls}")
  if objective.name == "mlm":
    _require(0 < d.mlm_probability < 1, f"config.data.mlm_probability must be in (0, 1), got {d.mlm_probability}")
    _require(1 <= d.max_predictions_per_seq <= d.seq_len, f"config.data.max_predictions_per_seq must be in "
             f"[1, seq_len={d.seq_len}], got {d.max_predictions_per_seq}")
    _require(not d.nsp or m.type_vocab_size >= 2,
             f"config.data.nsp needs config.model.type_vocab_size >= 2, got {m.type_vocab_size}")
  if objective.name == "span_corruption":
    _require(0 < d.noise_density < 1, f"config.data.noise_density must be in (0, 1), got {d.noise_density}")
    _require(d.mean_noise_span_length >= 1,
             f"config.data.mean_noise_span_length must be >= 1, got {d.mean_noise_span_length}")
    specials = len({m.pad_token_id, m.eos_token_id, m.decoder_start_token_id}) + 1  # + unk
    _require(m.vocab_size > NUM_SENTINELS + specials, f"config.model.vocab_size={m.vocab_size} leaves no room for "
             f"{NUM_SENTINELS} sentinels and {specials} special tokens")
    raw, targets = corruption.span_lengths(d.seq_len, d.noise_density, d.mean_noise_span_length)
    _require(d.target_len == 0 or d.target_len >= targets, f"config.data.target_len={d.target_len} is "
             f"shorter than the {targets} targets of seq_len={d.seq_len} (raw {raw}); use 0 for auto")

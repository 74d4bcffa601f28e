"""The Objective record and the registry that config.objective names."""
import dataclasses
from typing import Callable

from lm_jax import models
from lm_jax.flops import Lengths


@dataclasses.dataclass(frozen=True)
class Objective:
  """Everything specific to one training objective (see lm_jax/objectives/__init__.py)."""
  name: str
  layouts: tuple          # the model layouts it trains (lm_jax.models.LAYOUTS)
  check: Callable         # config -> None, or a one-line ValueError naming the field
  lengths: Callable[..., Lengths]  # config -> its sequence lengths
  rows: Callable          # (config, tokenizer) -> data.rows.Stream | data.rows.PerDocument
  transform: Callable     # (config, tokenizer) -> fn(rows dict, np.random.Generator) -> batch features
  features: Callable      # config -> {name: (per-example shape, numpy dtype)}
  denominators: Callable  # batch -> {name: scalar} of the FULL batch, each >= 1
  loss: Callable          # (config, params, batch, den, *, rng, train) -> (loss, metrics); sums / den
  metric_denominators: dict = dataclasses.field(default_factory=dict)  # metric -> den key; default: min(den keys)
  predict: Callable | None = None  # (config, params, batch) -> per-example {prediction, label, weight, index}
  predict_texts: Callable | None = None  # (config, params, tokenizer, split, generate) -> {index, prediction, target,
                                         # exact_match} when predictions are decoded texts, else None
  added_tokens: int = 0  # special tokens appended to the pre-trained vocabulary (init_from.resolve)
  rollouts: bool = False  # trains on rollouts of its own policy (PPO): lm_jax.rlhf.ppo.train runs it, not train.train

  def __reduce__(self):
    """Pickled as its name, read back from the registry (importing this module registers every objective): a
    process of lm_jax.prepare's pool gets the objective, whose functions may be lambdas that do not pickle."""
    return get, (self.name,)

  def tokens_per_example(self, config) -> int:
    lengths = self.lengths(config)
    return lengths.inputs + lengths.targets

  def denominator_of(self, metric: str, den: dict) -> str:
    """The denominator key `metric` is divided by (for exact corpus-level eval sums): its metric_denominators entry,
    else the alphabetically first key (jit returns dicts with sorted keys, so 'first' must not mean insertion
    order); objectives with several denominators list their metrics."""
    return self.metric_denominators.get(metric, min(den))

  def flops_per_example(self, config) -> float:
    """Training matmul FLOPs of one example: 3x the family's forward count for the objective's lengths (lm_jax.flops
    says what that counts), the numerator of MFU."""
    return 3.0 * models.forward_flops(config.model, self.lengths(config))


def no_transform(config, tokenizer):
  """The `transform` of objectives whose rows already are the batch (no host-side masking or corruption)."""
  del config, tokenizer
  return lambda batch_rows, rng: batch_rows


_REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
  """Makes `objective` available as config.objective=objective.name (a later registration replaces it)."""
  _REGISTRY[objective.name] = objective
  return objective


def get(name: str) -> Objective:
  if name not in _REGISTRY:
    raise ValueError(f"config.objective={name!r} is unknown; known: {', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY)
